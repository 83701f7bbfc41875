"""The last output of every child that crashed, kept on disk past its job's end: ``roving logs --failed``.

A worker's output is easy to lose: the terminal scrolled away, a cluster's job log was removed with the
job, the next run wrote over it. So when a child of this process ends with a failure it did not ask for
(an exit code other than 0, or a signal roving did not send: not a pool's own ``terminate`` at its end),
its last :data:`KEPT_LINES` lines of output are written to a record of its own, with who and what it was:
``$XDG_STATE_HOME/roving/failed/<time>-<session>/<name>.log`` (``~/.local/state`` without XDG). The
folders are this user's only (0700; a folder that is a link, another user's or open to others is refused,
not used), each record is created 0600 and written whole (a new file, renamed into place), and only the
latest :data:`KEEP_SESSIONS` sessions are kept.

Lines come from what roving copied of the child's output (``child_output="prefix"``) or from its log file
(``"files"``); with ``"off"`` the record says that nothing was kept. Output that arrives after the exit was
noticed is taken in by a second write a moment later (and at this process's exit at the latest).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import stat
import threading
import time
from typing import Callable, Dict, List, Optional

from .system.private import create_private, private_dir
from .errors import CrashLogError

__all__ = ["Record", "keep", "record", "records", "folder", "KEPT_LINES", "KEEP_SESSIONS", "CrashLogError"]

KEPT_LINES = 200
KEEP_SESSIONS = 20
_SETTLE_S = 2.0  # how long after the exit late output lines are still taken in



@dataclasses.dataclass(frozen=True)
class Record:
    """One crashed child: its name, job, backend, host, exit code and cause, when it ended, its last lines."""

    name: str
    session: str
    job: str
    backend: str
    host: str
    exitcode: Optional[int]
    cause: str
    ended: float
    lines: List[str]
    path: str = ""

    def header(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.ended))
        where = f" on {self.host}" if self.host else ""
        return (f"== {self.name} (job {self.job}, {self.backend}{where}, session {self.session}): {self.cause}, "
                f"{when} ==")


def folder() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "roving", "failed")


def _private(path: str, make: bool) -> bool:
    """Whether ``path`` is a private folder of this user (made 0700 with its parents when ``make``);
    CrashLogError when it exists and is not."""
    if make:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        private_dir(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise CrashLogError(f"{path} is not a private folder of this user (a link, another user's, or open to "
                            "others): no failure records are kept or read there")
    return True


def _write(path: str, data: Dict[str, object]) -> None:
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with create_private(tmp, "w") as f:  # 0600, no link followed (roving.system.private)
        json.dump(data, f)
    os.replace(tmp, path)


def _prune(root: str) -> None:
    sessions = sorted(e for e in os.listdir(root) if not e.startswith("."))
    for old in sessions[:-KEEP_SESSIONS]:
        where = os.path.join(root, old)
        if os.path.islink(where) or not os.path.isdir(where):
            continue
        for entry in os.listdir(where):
            os.unlink(os.path.join(where, entry))
        os.rmdir(where)


_session_folders: Dict[str, str] = {}
_pending: Dict[str, Callable[[], None]] = {}
_lock = threading.Lock()


def _session_folder(session: str) -> str:
    root = folder()
    with _lock:
        found = _session_folders.get(f"{root}\0{session}")
        if found is None:
            _private(root, make=True)
            found = os.path.join(root, f"{time.strftime('%Y%m%d-%H%M%S')}-{session}")
            _private(found, make=True)
            _prune(root)
            _session_folders[f"{root}\0{session}"] = found
        return found


def record(name: str, session: str, job: str, backend: str, host: str, exitcode: Optional[int], cause: str,
           lines: Callable[[], List[str]]) -> None:
    """Keep the crash of child ``name``: written at once with ``lines()`` (its last output lines as known
    now), and again once late lines had time to arrive. Never raises: a record that cannot be written is
    logged."""
    import logging

    try:
        where = _session_folder(session)
    except Exception as exc:
        logging.getLogger(__name__).warning("the failure record of %s could not be written: %s", name, exc)
        return

    def write() -> None:
        if not os.path.isdir(where):  # pruned meanwhile: this run is no longer among those kept
            return
        try:
            safe = "".join(c if c.isalnum() or c in "-_.:" else "_" for c in name)
            _write(os.path.join(where, f"{safe}.log"), {
                "name": name, "session": session, "job": job, "backend": backend, "host": host,
                "exitcode": exitcode, "cause": cause, "ended": ended, "lines": list(lines())[-KEPT_LINES:]})
        except Exception as exc:
            logging.getLogger(__name__).warning("the failure record of %s could not be written: %s", name, exc)

    ended = time.time()
    write()
    key = f"{session}/{name}"

    def settle() -> None:
        with _lock:
            if _pending.pop(key, None) is None:
                return
        write()

    with _lock:
        _pending[key] = write
    timer = threading.Timer(_SETTLE_S, settle)
    timer.daemon = True
    timer.start()


def keep(name: str, session: str, job: str, backend: str, exitcode: int, cause: str, output: str,
         log_path: str) -> None:
    """Keep the crash of child ``name`` (see :func:`record`), its lines taken from where its output went
    (``output``, the ``child_output`` option): what roving copied of it, its log file ``log_path``, or
    nothing."""
    from . import observe

    lines: Callable[[], List[str]]
    if output == "prefix":
        lines = functools.partial(observe.lines_of, name)
    elif output == "files":
        lines = functools.partial(_tail, log_path, KEPT_LINES)
    else:
        lines = lambda: ['(nothing kept: child_output="off")']
    record(name, session, job, backend, "", exitcode,
           cause or (f"killed by signal {-exitcode}" if exitcode < 0 else f"exited with code {exitcode}"), lines)


def _tail(path: str, n: int) -> List[str]:
    """The last ``n`` lines of the log file ``path`` (not followed through a link); none if unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return []
    with os.fdopen(fd, "rb") as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - 256 * n), os.SEEK_SET)
        return [line.decode(errors="replace") for line in f.read().splitlines()[-n:]]


def flush() -> None:
    """Write every record still waiting for late lines now (at this process's exit)."""
    with _lock:
        waiting = list(_pending.values())
        _pending.clear()
    for write in waiting:
        write()


def records() -> List[Record]:
    """Every kept record, the newest session first, each session's in the order its children ended.
    CrashLogError when the folder is not private."""
    root = folder()
    if not _private(root, make=False):
        return []
    found: List[Record] = []
    for session in sorted((e for e in os.listdir(root) if not e.startswith(".")), reverse=True):
        where = os.path.join(root, session)
        if not _private(where, make=False):
            continue
        batch = []
        for entry in os.listdir(where):
            path = os.path.join(where, entry)
            if not entry.endswith(".log"):
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                continue
            with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
                try:
                    data = json.load(f)
                    batch.append(Record(**{k: data[k] for k in ("name", "session", "job", "backend", "host",
                                                                 "exitcode", "cause", "ended", "lines")},
                                        path=path))
                except (ValueError, KeyError, TypeError):
                    continue  # not one of ours
        found += sorted(batch, key=lambda r: r.ended)
    return found
