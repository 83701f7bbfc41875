"""A stream served by an I/O thread: the node's side of the streams that other processes open to it.

:class:`ServedStream` never blocks: :meth:`~ServedStream.pump` returns the messages that have come in
whole so far, and :meth:`~ServedStream.write` (any thread) sends what the socket takes now and queues
the rest for the I/O thread. The blocking side of the same streams is :class:`.stream.Stream`.
"""
from __future__ import annotations

import collections
import itertools
import threading
from typing import TYPE_CHECKING, Any, Callable, Deque, List, Optional, Sequence, Tuple, Union

from . import tls
from .framing import Reader, advance, encode

if TYPE_CHECKING:
    from .stream import Stream


class ServedStream:
    """A stream that an I/O thread serves: never blocks. ``pump`` returns the messages that have come
    in whole so far; ``write`` (from any thread) sends what the socket takes now and queues the rest,
    which the I/O thread writes as the socket drains (:meth:`flush` when it polls writable).

    Guarantees: messages are written whole and in the order of ``write`` calls; a message that cannot
    be written in full because the stream ended has its ``undeliverable`` callback returned by
    :meth:`drop` (a message that did reach the kernel is considered delivered).
    """

    _IOV = 512

    def __init__(self, stream: Stream, want_write: Callable[["ServedStream"], None]) -> None:
        self.sock = stream.sock
        self.sock.setblocking(False)
        self.fd = self.sock.fileno()
        self._want_write = want_write
        self._lock = threading.Lock()
        self._out: Deque[Any] = collections.deque()  # buffers still to write
        self._ends: Deque[Tuple[int, Optional[Callable[[], None]]]] = collections.deque()
        self._queued = 0  # bytes in _out; _ends holds (bytes left until a message's end, callback)
        self.closed = False
        self._reader = Reader(self.sock)
        self._tls = stream.encrypted
        self._retry = False  # a TLS write could not finish: the same bytes go first again
        #: Who opened the stream (:class:`.identity.Peer`), as its handshake proved.
        self.peer = stream.peer

    def _write_some(self, todo: Deque[Any]) -> int:
        """Write what the socket takes now from the front of ``todo`` and drop it from there; the bytes
        written. BlockingIOError when it takes nothing."""
        if not self._tls:
            sent = self.sock.sendmsg(list(itertools.islice(todo, self._IOV)))
            advance(todo, sent)
            return sent
        sent = 0
        while todo:
            try:
                n = tls.write(self.sock, todo, self._retry)
            except BlockingIOError:
                self._retry = True
                if sent:
                    return sent
                raise
            self._retry = False
            sent += n
            advance(todo, n)
        return sent

    @property
    def pending(self) -> bool:
        return bool(self._out)

    # -- writing -----------------------------------------------------------------------------
    def write(self, kind: bytes, frames: Sequence[Any],
              undeliverable: Optional[Callable[[], None]] = None) -> bool:
        """Send or queue one message; False (nothing sent) when the stream has ended."""
        todo: Union[List[Any], Deque[Any]]  # a deque once partly written
        todo = encode(kind, frames)
        size = sum(len(v) for v in todo)
        notify = False
        with self._lock:
            if self.closed:
                return False
            if not self._out:
                try:
                    if self._tls:
                        todo = collections.deque(todo)
                        sent = self._write_some(todo)  # takes what it wrote off todo
                    else:
                        sent = self.sock.sendmsg(todo[:self._IOV])
                except BlockingIOError:
                    sent = 0
                except OSError:
                    self.closed = True
                    return False
                if sent == size:
                    return True
                if not self._tls:
                    todo = collections.deque(todo)
                    advance(todo, sent)
                size -= sent
                notify = True
            self._out.extend(todo)
            self._queued += size
            self._ends.append((self._queued, undeliverable))
        if notify:
            self._want_write(self)
        return True

    def flush(self) -> None:
        """Write what the socket takes now of the queued messages (the I/O thread, when writable)."""
        with self._lock:
            while self._out and not self.closed:
                try:
                    sent = self._write_some(self._out)
                except BlockingIOError:
                    return
                except OSError:
                    self.closed = True
                    return
                self._queued -= sent
                self._ends = collections.deque((end - sent, fn) for end, fn in self._ends if end - sent > 0)

    # -- reading -----------------------------------------------------------------------------
    def pump(self) -> Tuple[List[Tuple[bytes, List[Any]]], bool]:
        """Read what has come: (whole messages, whether the stream has ended)."""
        reader = self._reader
        messages: List[Tuple[bytes, List[Any]]] = []
        while not reader.ended:
            try:
                reader.step()
            except BlockingIOError:
                break
            except OSError:
                reader.ended = True
            messages.extend(reader.ready)
            reader.ready.clear()
        return messages, reader.ended

    def drop(self) -> List[Callable[[], None]]:
        """Close; returns the callbacks of messages that were not written in full."""
        with self._lock:
            self.closed = True
            callbacks = [fn for _, fn in self._ends if fn is not None]
            self._out.clear()
            self._ends.clear()
        try:
            self.sock.close()
        except OSError:
            pass
        return callbacks


