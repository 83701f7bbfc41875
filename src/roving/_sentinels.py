"""One thread that notices when any of many jobs ends, through their sentinels.

A sentinel is a file descriptor that becomes readable when its job ends
(:meth:`roving.backends.base.Backend.sentinel`). :class:`SentinelWatcher` waits on all of them at once
and calls back once per sentinel, in its own thread; roving.process uses one to notice every child's
end even if nobody joins it (so that the pipe ends the child held are released and a reader on the
other end sees EOFError).
"""
from __future__ import annotations

import logging
import os
import selectors
import threading
import weakref
from typing import Any, Callable, List, Optional, Tuple

log = logging.getLogger(__name__)

__all__ = ["SentinelWatcher", "watcher"]


class SentinelWatcher:
    """Waits on sentinels in one daemon thread and calls ``on_end(owner)`` once each becomes readable.

    The owner is held only weakly: an owner freed before its sentinel fired is not called back (its
    sentinel is closed through :meth:`close_fd`). An exception of a callback is logged and stops
    nothing else. Sentinels are closed only in the watcher's thread, so that a number is not reused
    while the selector still knows it.
    """

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._add: List[Tuple[int, "weakref.ref[Any]", Callable[[Any], None]]] = []
        self._remove: List[int] = []
        threading.Thread(target=self._run, name="roving-sentinels", daemon=True).start()

    def watch(self, fd: int, owner: Any, on_end: Callable[[Any], None]) -> None:
        """Call ``on_end(owner)`` once ``fd`` becomes readable (``on_end`` must not hold ``owner``)."""
        with self._lock:
            self._add.append((fd, weakref.ref(owner), on_end))
        os.write(self._wake_w, b"x")

    def close_fd(self, fd: int) -> None:
        """Stop watching ``fd`` and close it (in the watcher's thread). Returns at once."""
        with self._lock:
            self._remove.append(fd)
        os.write(self._wake_w, b"x")

    def _run(self) -> None:
        while True:
            self._step()

    def _step(self) -> None:
        """One wait and what it found, in a frame of its own: no local variable keeps an owner alive
        while the watcher waits."""
        for key, _ in self._selector.select():
            if key.data is None:
                os.read(self._wake_r, 4096)
                with self._lock:
                    add, self._add = self._add, []
                    remove, self._remove = self._remove, []
                for fd, ref, on_end in add:
                    self._selector.register(fd, selectors.EVENT_READ, (ref, on_end))
                for fd in remove:
                    self._unregister(fd)
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                continue
            self._unregister(key.fd)
            ref, on_end = key.data
            owner = ref()
            if owner is None:  # freed without close(): its finalizer has queued the sentinel's closing
                continue
            try:
                on_end(owner)
            except Exception:  # never let one child stop the watcher
                log.exception("roving: could not reap %s", owner)
            del owner

    def _unregister(self, fd: int) -> None:
        try:
            self._selector.unregister(fd)
        except (KeyError, ValueError):
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
