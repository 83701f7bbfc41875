"""One daemon thread that waits on many readable files at once and calls each one's handler, in that
thread, whenever it is readable: what roving's sentinel watcher (:mod:`roving._sentinels`, a job's end)
and the output pump (:class:`roving.backends.output.OutputPump`, children's pipes) are built on.

It is one of roving's system helpers (:mod:`roving.system`), below every layer that needs it (the
backends' output pump is the lowest); it imports nothing of roving.
"""
from __future__ import annotations

import logging
import os
import selectors
import threading
import time
from typing import Callable, List, Optional, Protocol, Tuple, Union


class HasFileno(Protocol):
    """A file, socket or pipe end: what has a descriptor to wait on."""

    def fileno(self) -> int: ...


#: What the thread waits on: a file descriptor, or an object with ``fileno()``.
Watchable = Union[int, HasFileno]

log = logging.getLogger(__name__)

__all__ = ["SelectorThread", "Watchable", "HasFileno"]

#: After select() itself failed (an fd closed under it, say), the thread waits this long before the next.
_RETRY_S = 0.05


class SelectorThread:
    """Waits on files in one daemon thread named ``name``; :meth:`watch` and :meth:`forget` may be called
    from any thread and return at once (the change is made in the watching thread, in the order asked).

    Guarantees: a handler runs only in the watching thread, one at a time; an exception it raises is
    logged and the file is no longer watched (the others go on); a file is forgotten (and whatever
    ``then`` does, closing it, say) only in the watching thread, so that its number is not reused while
    the selector still knows it.
    """

    def __init__(self, name: str) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        # (file, handler) to watch, or (file, None, then) to forget, in the order asked
        self._changes: List[Tuple[Watchable, Optional[Callable[[], None]], Optional[Callable[[], None]]]] = []
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def watch(self, fileobj: Watchable, on_ready: Callable[[], None]) -> None:
        """Call ``on_ready()`` each time ``fileobj`` (a file descriptor or an object with ``fileno()``) is
        readable, until it is forgotten. One that cannot be watched (closed already) is logged and left."""
        self._change((fileobj, on_ready, None))

    def forget(self, fileobj: Watchable, then: Optional[Callable[[], None]] = None) -> None:
        """Stop watching ``fileobj``, then call ``then()`` (in the watching thread; at once when called
        from a handler, which is in that thread)."""
        if threading.current_thread() is self.thread:
            self._forget(fileobj, then)
        else:
            self._change((fileobj, None, then))

    def _change(self, change: Tuple[Watchable, Optional[Callable[[], None]], Optional[Callable[[], None]]]) -> None:
        with self._lock:
            self._changes.append(change)
        os.write(self._wake_w, b"x")

    def _run(self) -> None:
        while True:
            self._step()

    def _step(self) -> None:
        """One wait and what it found, in a frame of its own: no local variable keeps what a handler
        touched alive while the thread waits."""
        try:
            events = self._selector.select()
        except OSError as exc:
            log.warning("roving: %s: waiting on its files: %s", self.thread.name, exc)
            time.sleep(_RETRY_S)
            return
        for key, _ in events:
            if key.data is None:
                self._take_changes()
                continue
            try:
                key.data()
            except Exception:  # never let one file stop the others
                log.exception("roving: %s: the handler of %r failed; it is no longer watched", self.thread.name,
                              key.fileobj)
                self._forget(key.fileobj, None)

    def _take_changes(self) -> None:
        os.read(self._wake_r, 4096)  # select() found it readable
        with self._lock:
            changes, self._changes = self._changes, []
        for fileobj, on_ready, then in changes:
            if on_ready is None:
                self._forget(fileobj, then)
                continue
            try:
                self._selector.register(fileobj, selectors.EVENT_READ, on_ready)
            except (ValueError, KeyError, OSError) as exc:  # closed already, or watched twice
                log.warning("roving: %s: cannot watch %r: %s", self.thread.name, fileobj, exc)

    def _forget(self, fileobj: Watchable, then: Optional[Callable[[], None]]) -> None:
        try:
            self._selector.unregister(fileobj)
        except (KeyError, ValueError):
            pass
        if then is not None:
            try:
                then()
            except Exception:
                log.exception("roving: %s: after forgetting %r", self.thread.name, fileobj)
