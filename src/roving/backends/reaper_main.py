"""The watcher program of :class:`roving.backends.reaper.Reaper`: ``python .../reaper_main.py NAME``.

Reads the parent's resolved configuration (one JSON line), then, as the parent goes on, ``+ID`` / ``-ID``
lines as it starts jobs and sees them end, and ``d+[DEV, INO, PATH]`` / ``d-PATH`` lines (JSON) as it makes
and removes folders of secret files. When its input closes (the parent ended, however), it cancels the jobs
still listed with backend NAME, removes the folders still listed (:func:`remove_secret_folder`), and exits.
Ctrl-C is ignored (the parent's terminal may send it to the whole group; the watcher must outlive the
parent). Nothing imports this module.

It is run by its path, so Python puts this file's folder first on ``sys.path``, where this package's
``docker.py`` and ``kubernetes.py`` would hide the client libraries of the same names: the folder is taken
off before anything but the standard library is imported, and roving itself is imported only when there are
jobs to cancel.
"""
from __future__ import annotations

import json
import os
import signal
import stat
import sys
from typing import Any, Dict, List, Tuple

if __name__ == "__main__":
    _HERE = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _HERE]

#: The names of the folders of secret files roving makes: the local and Slurm backends' ``roving-secrets-*``
#: and each container's ``roving-secret-*``. A folder named otherwise is never removed.
SECRET_FOLDER_PREFIX = "roving-secret"

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def remove_secret_folder(path: str, dev: int, ino: int) -> bool:
    """Remove the folder ``path`` and the files in it, if it can be proven to be the one its parent made and
    named: named ``roving-secret*``, a folder (not a link: it is opened without following one) of this user,
    with the device and inode the parent sent. Its entries are unlinked, never followed (a link in it goes,
    what it points to stays); a folder in it keeps it from being removed. Whether it was removed."""
    parent, name = os.path.split(os.path.abspath(path))
    if not name.startswith(SECRET_FOLDER_PREFIX):
        return False
    try:
        parent_fd = os.open(parent, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    except OSError:
        return False
    try:
        try:
            fd = os.open(name, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=parent_fd)
        except OSError:  # gone, or a link, or not a folder
            return False
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (dev, ino) or st.st_uid != os.getuid():
                return False
            for entry in os.listdir(fd):
                if not stat.S_ISDIR(os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode):
                    os.unlink(entry, dir_fd=fd)
        finally:
            os.close(fd)
        os.rmdir(name, dir_fd=parent_fd)
        return True
    except OSError:  # removed meanwhile, or a folder in it
        return False
    finally:
        os.close(parent_fd)


def _cancel(name: str, options: Dict[str, Any], job_ids: List[str]) -> None:
    from roving import backends
    from roving import config as _config

    fields: Dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    _config.adopt(_config.Config(**fields))
    backends.get(name).cancel_ids(job_ids)


def main() -> int:
    """The watcher: read the configuration, the job ids and the folders until the input closes, then cancel
    the jobs and remove the folders."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    name = sys.argv[1]
    first = sys.stdin.readline()
    if not first:
        return 0
    live: Dict[str, bool] = {}
    folders: Dict[str, Tuple[int, int]] = {}
    for line in sys.stdin:
        line = line.strip()
        if line.startswith("+"):
            live[line[1:]] = True
        elif line.startswith("-"):
            live.pop(line[1:], None)
        elif line.startswith("d+"):
            dev, ino, path = json.loads(line[2:])
            folders[path] = (int(dev), int(ino))
        elif line.startswith("d-"):
            folders.pop(json.loads(line[2:]), None)
    try:
        if live:  # the jobs first: a container's folder is in use until the container is gone
            _cancel(name, json.loads(first), list(live))
    finally:
        for path, (dev, ino) in folders.items():
            remove_secret_folder(path, dev, ino)
    return 0


if __name__ == "__main__":
    sys.exit(main())
