"""The Reaper: a small watcher process that cancels this process's jobs once this process is gone.

:class:`Reaper` is the parent's side, one per backend that starts jobs on a cluster. It starts the
watcher (``python -m roving.backends.reaper_main NAME``, in a session of its own, so that a Ctrl-C to the
terminal does not stop it first) when the first job is added, and tells it each job id through a pipe:
``+ID`` when the job is started, ``-ID`` when it is seen to end. The first line is the parent's resolved
configuration (JSON), which the watcher takes on to reach the same cluster. The kernel closes the pipe
whatever way the parent ends, ``kill -9`` included; the watcher then cancels every job it was told of
and not told was done (:meth:`roving.backends.base.Backend.cancel_ids`), and exits.

It also removes the folders that hold the session secret's files (:meth:`Reaper.folder`: the local and
Slurm backends' ``roving-secrets-*``, each container's ``roving-secret-*``), which a parent killed with
SIGKILL cannot remove itself: only those the parent named through the pipe (no other process writes it),
only while the folder there is still the one named (same device and inode: a folder made since under the
name is left alone), only this user's, and never through a link (their entries are unlinked, not followed).

The watcher program is :mod:`roving.backends.reaper_main`: it uses the backends (to cancel), so it stands
above them, while this module stands below them (they use it). It is run by its file's path, not with
``-m``: it imports only the standard library until it has jobs to cancel, so a watcher that only removes a
folder (the local backend's) costs an interpreter's start, not roving's imports.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from typing import List, Optional

from .. import config as _config

__all__ = ["Reaper", "watcher_command"]


def watcher_command(backend_name: str) -> List[str]:
    """How the watcher is started: this interpreter running :mod:`roving.backends.reaper_main` by path."""
    return [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "reaper_main.py"),
            backend_name]


class Reaper:
    """The parent's side of the watcher that cancels a backend's jobs once this process is gone.

    :meth:`add` and :meth:`done` never block on the watcher and never raise: a watcher that is gone
    (it cannot be, while this process lives, unless killed from outside) is written to no more.
    """

    def __init__(self, backend_name: str) -> None:
        self._backend_name = backend_name
        self._proc: Optional[subprocess.Popen] = None
        self._lock = threading.Lock()

    def _send(self, line: str) -> None:
        with self._lock:
            if self._proc is None:
                env = dict(os.environ)
                env.pop("ROVING_CHILD", None)
                env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
                self._proc = subprocess.Popen(
                    watcher_command(self._backend_name), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env,
                    start_new_session=True, close_fds=True)
                cfg = dataclasses.asdict(_config.current())
                assert self._proc.stdin is not None  # stdin=PIPE
                self._proc.stdin.write((json.dumps(cfg) + "\n").encode())
            try:
                assert self._proc.stdin is not None  # stdin=PIPE
                self._proc.stdin.write((line + "\n").encode())
                self._proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                pass

    def add(self, job_id: str) -> None:
        """A job was started: the watcher cancels it if this process ends before :meth:`done`."""
        self._send("+" + job_id)

    def done(self, job_id: str) -> None:
        """The job has ended (or was cancelled here): the watcher forgets it."""
        if self._proc is not None:
            self._send("-" + job_id)

    def folder(self, path: str) -> None:
        """``path`` is a folder of secret files this process just made (``roving-secret*``): the watcher
        removes it if this process ends before :meth:`folder_gone`. Its device and inode go with it, so that
        the watcher removes that very folder and no other made since under its name."""
        try:
            st = os.lstat(path)
        except OSError:  # gone already
            return
        self._send("d+" + json.dumps([st.st_dev, st.st_ino, os.path.abspath(path)]))

    def folder_gone(self, path: str) -> None:
        """The folder ``path`` was removed here: the watcher forgets it."""
        if self._proc is not None:
            self._send("d-" + json.dumps(os.path.abspath(path)))
