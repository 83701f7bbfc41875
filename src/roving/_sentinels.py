"""One thread that notices when any of many jobs ends, through their sentinels.

A sentinel is a file descriptor that becomes readable when its job ends
(:meth:`roving.backends.base.Backend.sentinel`). :class:`SentinelWatcher` waits on all of them at once
and calls back once per sentinel, in its own thread; roving.process uses one to notice every child's
end even if nobody joins it (so that the pipe ends the child held are released and a reader on the
other end sees EOFError).
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from typing import Any, Callable, Optional

from .system.selector_thread import SelectorThread

log = logging.getLogger(__name__)

__all__ = ["SentinelWatcher", "watcher"]


class SentinelWatcher:
    """Waits on sentinels in one daemon thread and calls ``on_end(owner)`` once each becomes readable.

    The owner is held only weakly: an owner freed before its sentinel fired is not called back (its
    sentinel is closed through :meth:`close_fd`). An exception of a callback is logged and stops
    nothing else. Sentinels are closed only in the watcher's thread, so that a number is not reused
    while the selector still knows it (:class:`roving.system.selector_thread.SelectorThread`).
    """

    def __init__(self) -> None:
        self._thread = SelectorThread("roving-sentinels")

    def watch(self, fd: int, owner: Any, on_end: Callable[[Any], None]) -> None:
        """Call ``on_end(owner)`` once ``fd`` becomes readable (``on_end`` must not hold ``owner``)."""
        self._thread.watch(fd, functools.partial(self._ended, fd, weakref.ref(owner), on_end))

    def close_fd(self, fd: int) -> None:
        """Stop watching ``fd`` and close it (in the watcher's thread). Returns at once."""
        self._thread.forget(fd, functools.partial(_close, fd))

    def _ended(self, fd: int, ref: "weakref.ref[Any]", on_end: Callable[[Any], None]) -> None:
        """``fd`` is readable (in the watcher's thread): it is watched no more; its owner, if alive, is told."""
        self._thread.forget(fd)
        owner = ref()
        if owner is None:  # freed without close(): its finalizer has queued the sentinel's closing
            return
        try:
            on_end(owner)
        except Exception:  # never let one child stop the watcher
            log.exception("roving: could not reap %s", owner)


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


_instance: Optional[SentinelWatcher] = None
_instance_lock = threading.Lock()


def watcher() -> SentinelWatcher:
    """This process's watcher, started on first use."""
    global _instance
    if _instance is None:
        with _instance_lock:
            if _instance is None:
                _instance = SentinelWatcher()
    return _instance
