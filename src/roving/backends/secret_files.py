"""The session secret handed to jobs in private files, never in their environment (:class:`SecretFiles`):
what the local and Slurm backends use. Imported with :mod:`.base`, so that its exit handler is registered
before roving.process registers its own (see :func:`_remove_secret_folders`)."""
from __future__ import annotations

import atexit
import dataclasses
import os
import secrets
import shutil
import tempfile
import threading
from typing import List, Optional

from ..system.private import create_private, private_dir
from .base import JobSpec
from .reaper import Reaper

__all__ = ["SecretFiles"]

_secret_folders: List[str] = []
_secret_folders_lock = threading.Lock()


def _remove_secret_folders() -> None:
    """At exit: remove the folders of :class:`SecretFiles`, with the files of jobs that never ran.

    Registered when this module is first imported, before roving.process registers the handler that
    joins a program's unjoined children (handlers run in reverse), so a child started just before its
    parent's end still finds its file. Registering a handler when a folder is made would run it first,
    and such a child would die before it ran.
    """
    with _secret_folders_lock:
        folders = list(_secret_folders)
        _secret_folders.clear()
    for folder in folders:
        shutil.rmtree(folder, True)


atexit.register(_remove_secret_folders)


class SecretFiles:
    """Hands the session secret to jobs in private files, never in their environment.

    :meth:`moved` gives a copy of a job's spec whose environment no longer holds the secret
    (``spec.session.secret_env``) but names, in ``spec.session.secret_file_env``, a new file that
    does: 0600, created without following links, in a private folder (0700) made on first use under
    ``base``. So neither the job's ``/proc/PID/environ`` (the kernel's copy of the environment it
    started with, which removing the variable from ``os.environ`` does not clear) nor a cluster's
    record of the job's environment (Slurm's ``--export``) carries it. The child reads the file and
    removes it (:func:`roving.system.private.take_private`); the files of jobs that never ran go with
    the folder at this process's exit, after its children were joined (:func:`_remove_secret_folders`), or,
    when this process is killed (SIGKILL), by ``reaper``'s watcher (:meth:`roving.backends.reaper.Reaper.folder`).
    ``base`` must be a folder the job's machine sees (a shared home for a cluster). Thread-safe.
    """

    def __init__(self, base: str, reaper: Optional[Reaper] = None) -> None:
        self._base = base
        self._reaper = reaper
        self._folder: Optional[str] = None
        self._lock = threading.Lock()

    def _made(self) -> str:
        with self._lock:
            if self._folder is None or not os.path.isdir(self._folder):
                if not os.path.isdir(self._base):
                    private_dir(self._base)  # made 0700; one that exists (/tmp) holds a folder of ours
                self._folder = tempfile.mkdtemp(prefix="roving-secrets-", dir=self._base)  # 0700
                with _secret_folders_lock:
                    _secret_folders.append(self._folder)
                if self._reaper is not None:  # named before any secret is in it
                    self._reaper.folder(self._folder)
            return self._folder

    def moved(self, spec: JobSpec) -> JobSpec:
        """``spec`` with its secret in a file (``spec`` itself when its environment holds none)."""
        secret = spec.env.get(spec.session.secret_env)
        if not secret:
            return spec
        path = os.path.join(self._made(), f"{secrets.token_hex(8)}.secret")
        with create_private(path, "w") as f:
            f.write(secret)
        env = {k: v for k, v in spec.env.items() if k != spec.session.secret_env}
        env[spec.session.secret_file_env] = path
        return dataclasses.replace(spec, env=env)


