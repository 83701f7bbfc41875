"""The Reaper: a small watcher process that cancels this process's jobs once this process is gone.

:class:`Reaper` is the parent's side, one per backend that starts jobs on a cluster. It starts the
watcher (``python -m roving.backends.reaper_main NAME``, in a session of its own, so that a Ctrl-C to the
terminal does not stop it first) when the first job is added, and tells it each job id through a pipe:
``+ID`` when the job is started, ``-ID`` when it is seen to end. The first line is the parent's resolved
configuration (JSON), which the watcher takes on to reach the same cluster. The kernel closes the pipe
whatever way the parent ends, ``kill -9`` included; the watcher then cancels every job it was told of
and not told was done (:meth:`roving.backends.base.Backend.cancel_ids`), and exits.

The watcher program is :mod:`roving.backends.reaper_main`: it uses the backends (to cancel), so it stands
above them, while this module stands below them (they use it).
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from typing import Optional

from .. import config as _config

__all__ = ["Reaper"]


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
                    [sys.executable, "-m", "roving.backends.reaper_main", self._backend_name],
                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, start_new_session=True,
                    close_fds=True)
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
