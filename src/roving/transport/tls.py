"""TLS streams that a reader and a writer thread use at once (:mod:`roving.transport.stream`).

OpenSSL's connection object may be used by one thread at a time; a stream is read by one thread while
another writes it. :class:`TlsSocket` serialises the calls into OpenSSL and waits for the socket
outside its lock. The handshake and the keys are :mod:`roving.transport.crypto`'s.
"""
from __future__ import annotations

import select
import socket
import ssl
import threading
from typing import Any, Callable, Deque, Optional, Union

_JOIN = 64 * 1024  # over TLS, buffers smaller than this are joined into one write (one record)


class TlsSocket:
    """A TLS connection that two threads may read and write at once (a stream's reader and writer):
    OpenSSL's object is used by one thread at a time, the socket is non-blocking underneath, and a
    blocking call waits outside the lock. ``blocking=False`` makes calls raise BlockingIOError instead
    of waiting (an I/O thread's stream)."""

    def __init__(self, ssock: ssl.SSLSocket) -> None:
        ssock.setblocking(False)
        self.ssock = ssock
        self.blocking = True
        self._lock = threading.Lock()
        self._fd = ssock.fileno()

    def fileno(self) -> int:
        return self._fd

    def _call(self, fn: Callable[[], int], want: int) -> int:
        while True:
            with self._lock:
                try:
                    return fn()
                except ssl.SSLWantReadError:
                    want = select.POLLIN
                except ssl.SSLWantWriteError:
                    want = select.POLLOUT
            if not self.blocking:
                raise BlockingIOError("the TLS stream has nothing to give or take now")
            poller = select.poll()
            poller.register(self._fd, want)
            poller.poll()

    def recv_into(self, view: Union[bytearray, memoryview]) -> int:
        return self._call(lambda: self.ssock.recv_into(view), select.POLLIN)

    def send(self, data: Union[bytes, bytearray, memoryview]) -> int:
        return self._call(lambda: self.ssock.send(data), select.POLLOUT)

    def sendall(self, data: Union[bytes, bytearray, memoryview]) -> None:
        view = memoryview(data).cast("B")
        while view:
            view = view[self.send(view):]

    def peer_certificate(self) -> bytes:
        """The certificate (DER) that TLS verified for the peer."""
        with self._lock:
            return self.ssock.getpeercert(binary_form=True) or b""

    def pending(self) -> int:
        with self._lock:
            return self.ssock.pending()

    def setblocking(self, flag: bool) -> None:
        self.blocking = flag

    def settimeout(self, value: Optional[float]) -> None:
        self.blocking = value != 0

    def setsockopt(self, level: int, option: int, value: Union[int, bytes]) -> None:
        self.ssock.setsockopt(level, option, value)

    def shutdown(self, how: int) -> None:
        socket.socket.shutdown(self.ssock, how)  # the TCP connection: a thread waiting on it returns

    def close(self) -> None:
        self.ssock.close()


def write(sock: TlsSocket, todo: Deque[Any], retry: bool) -> int:
    """Write the front of ``todo`` to a TLS stream; the bytes written. Small buffers at the front are
    joined first, in place (unless this is the retry of a write that could not finish: OpenSSL wants
    the same bytes again), so that a small message is one record."""
    if not retry and len(todo) > 1 and len(todo[0]) < _JOIN:
        size = count = 0
        for buf in todo:
            if size + len(buf) > _JOIN and count:
                break
            size += len(buf)
            count += 1
        if count > 1:
            joined = b"".join([todo.popleft() for _ in range(count)])
            todo.appendleft(joined)
    return sock.send(todo[0])

