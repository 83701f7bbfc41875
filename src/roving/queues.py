"""Queue, SimpleQueue and JoinableQueue with the semantics of :mod:`multiprocessing`.

A queue lives in the mailbox of the process that created it; any roving process of the session that
receives the queue object (as an argument, or inside another message) can use it, whichever backend
started it. Readers are served in the order they started waiting: an item is handed straight to a
reader that is waiting, so it never sits with a reader that is busy.

``put`` serializes the object before it returns: later changes to the object do not reach the queue.
On an unbounded queue ``put`` does not wait for the owner to acknowledge (items from one thread arrive
in order); on a bounded queue it waits for room, up to ``timeout``.
"""
from __future__ import annotations

import queue as _queue
from typing import Any, Optional

from .stdlib_process import refuse_standard_start
from .transport import endpoint as _endpoint
from .transport import node as _node
from .transport import session as _session
from .transport import timeouts
from .transport import wire as _wire
from .transport.serialize import dumps, loads

__all__ = ["Queue", "SimpleQueue", "JoinableQueue"]


def wait_time(block: bool, timeout: Optional[float]) -> float:
    """multiprocessing's (block, timeout) as the transport's timeout: -1 forever, 0 no wait."""
    if block and timeout is not None and timeout < 0:
        raise ValueError("'timeout' must be a non-negative number")  # as queue.Queue
    return timeouts.to_wire(block, timeout)


def raise_error(frames: list) -> None:
    raise OSError(bytes(frames[0]).decode() if frames else "roving transport error")


class Queue:
    """A process-shared FIFO queue; see :class:`multiprocessing.Queue`."""

    def __init__(self, maxsize: int = 0, *, ctx: object = None) -> None:
        node = _session.current().node()
        self._address = node.address
        self._maxsize = maxsize if maxsize > 0 else 0
        self._box = node.mailboxes.new_box(self._maxsize)
        self._setup()

    def _setup(self) -> None:
        self._closed = False
        self._endpoint = _session.current().endpoint(self._address)

    def __getstate__(self) -> tuple:
        refuse_standard_start(type(self).__name__)
        return self._address, self._box, self._maxsize

    def __setstate__(self, state: tuple) -> None:
        self._address, self._box, self._maxsize = state
        self._setup()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._address}#{self._box}>"

    def _check_closed(self) -> None:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")

    def put(self, obj: object, block: bool = True, timeout: Optional[float] = None) -> None:
        """Add ``obj``. Raises queue.Full if a bounded queue stays full for ``timeout`` seconds."""
        self._check_closed()
        wait = wait_time(block, timeout)
        frames = dumps(obj)
        if not self._maxsize:
            self._endpoint.tell(_node.PUT_NOREPLY, self._box, frames)
            return
        status, out = self._endpoint.call(_node.PUT, self._box, wait, frames)
        if status == _node.FULL:
            raise _queue.Full
        if status == _node.ERROR:
            raise_error(out)

    def put_nowait(self, obj: object) -> None:
        self.put(obj, False)

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        """Remove and return the oldest item. Raises queue.Empty if none comes within ``timeout``."""
        self._check_closed()
        status, frames = self._endpoint.call(_node.GET, self._box, wait_time(block, timeout))
        if status == _node.OK:
            return loads(frames)
        if status == _node.ERROR:
            raise_error(frames)
        raise _queue.Empty

    def get_nowait(self) -> Any:
        return self.get(False)

    def _sizes(self) -> _wire.Sizes:
        status, frames = self._endpoint.call(_node.SIZE, self._box, 0)
        if status == _node.ERROR:
            raise_error(frames)
        return _wire.unpack_sizes(frames[0])

    def qsize(self) -> int:
        """Items in the queue now (those still in flight from other processes are not counted)."""
        self._check_closed()
        return self._sizes().items

    def empty(self) -> bool:
        return self.qsize() == 0

    def full(self) -> bool:
        return bool(self._maxsize) and self.qsize() >= self._maxsize

    def close(self) -> None:
        """This process will put no more items. Items already put are still delivered."""
        self._closed = True

    def join_thread(self) -> None:
        """After close(): items this process put are handed to the transport, which delivers them
        before the process exits. Returns at once."""
        if not self._closed:
            raise AssertionError(f"Queue {self!r} not closed")  # what multiprocessing raises

    def cancel_join_thread(self) -> None:
        """Accepted for compatibility; put() has already serialized every item, so nothing is pending."""

    def abandon(self) -> None:
        """The process that created this queue is known to be gone: what this process sent to it (on
        this queue or any other of that process) without an answer is given up, and exit does not wait
        for it to arrive. Never blocks. A later put goes over a new connection, and fails if nothing
        answers there."""
        _endpoint.abandon(self._address)


class JoinableQueue(Queue):
    """A Queue whose consumers report each item done, and whose producers can wait for that."""

    def task_done(self) -> None:
        """One item taken from the queue is processed. ValueError if called more often than items put."""
        status, frames = self._endpoint.call(_node.TASK_DONE, self._box, 0)
        if status == _node.ERROR:
            raise ValueError(bytes(frames[0]).decode() if frames else "task_done() called too many times")

    def join(self, timeout: Optional[float] = None) -> bool:
        """Block until every item put has been marked done. roving adds ``timeout``: returns False if
        it passed first, True otherwise."""
        status, frames = self._endpoint.call(_node.JOIN, self._box, wait_time(True, timeout))
        if status == _node.ERROR:
            raise_error(frames)
        return status == _node.OK


class SimpleQueue:
    """An unbounded queue with get, put, empty and close; see :class:`multiprocessing.SimpleQueue`."""

    def __init__(self, *, ctx: object = None) -> None:
        self._queue = Queue()

    def _check_closed(self) -> None:
        if self._queue._closed:
            raise OSError("handle is closed")

    def put(self, obj: object) -> None:
        self._check_closed()
        self._queue.put(obj)

    def get(self) -> Any:
        self._check_closed()
        return self._queue.get()

    def empty(self) -> bool:
        self._check_closed()
        return self._queue.empty()

    def close(self) -> None:
        self._queue.close()

    def __repr__(self) -> str:
        return f"<SimpleQueue {self._queue._address}#{self._queue._box}>"
