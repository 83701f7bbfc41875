"""Direct, authenticated message streams between two processes of one session.

Most traffic goes through the node that owns a mailbox (:mod:`roving.transport.node`): simple, and right
for queues with many readers and writers, but every message then crosses the I/O threads of both
processes. Two processes that talk to each other alone (the two ends of a pipe) can open one TCP
connection of their own instead, read and written by the very threads that call ``recv`` and ``send``
(:mod:`roving.transport.link` decides when).

Guarantees:

* Both sides prove that they know the session secret (:mod:`roving.transport.auth`, fresh nonces each
  way) before either reads anything else; the listener then reads one small JSON request, and nothing
  from the connection is unpickled before that. A peer that fails is dropped and logged.
* A message is one gather write: its frames leave from the caller's buffers without a copy. On the
  receiving side a large frame is read straight into a buffer of its own, which the unpickled object then
  uses as its memory (numpy arrays, tensors, bytearrays).
* Messages arrive whole and in the order written, or the stream reports its end: :meth:`Stream.recv`
  raises EOFError when the peer closed or died (a message cut short by that is dropped, never returned).
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import select
import socket
import struct
import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

from . import auth

log = logging.getLogger(__name__)

_GREETING = b"roving-stream/1\n"
_HEAD = struct.Struct("<cI")  # kind, number of frames; then one <Q per frame: length << 1 | is-bytes
_LENGTH = struct.Struct("<Q")
_MAX_REQUEST = 16384
_BUFFER = 256 * 1024
_OWN_BUFFER = 64 * 1024  # frames at least this large are read into a buffer of their own
_HANDSHAKE_TIMEOUT = 10.0


def _fresh_buffers():
    """Makers of uninitialised bytes and bytearray objects, filled by the reader before anyone sees
    them (the C API's documented way to build one), so that a large frame is written once, by the
    kernel, instead of being zeroed first and, for bytes, copied again."""
    try:
        api = ctypes.pythonapi
        new_bytes, as_string = api.PyBytes_FromStringAndSize, api.PyBytes_AsString
        new_bytearray = api.PyByteArray_FromStringAndSize
    except AttributeError:  # not CPython
        return (lambda n: None), bytearray
    new_bytes.restype = new_bytearray.restype = ctypes.py_object
    new_bytes.argtypes = new_bytearray.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
    as_string.restype, as_string.argtypes = ctypes.c_void_p, [ctypes.py_object]

    def bytes_to_fill(n: int) -> Tuple[bytes, memoryview]:
        obj = new_bytes(None, n)
        return obj, memoryview((ctypes.c_char * n).from_address(as_string(obj))).cast("B")

    return bytes_to_fill, (lambda n: new_bytearray(None, n))


_bytes_to_fill, _bytearray = _fresh_buffers()


def _is_bytes(frame: Any) -> bool:
    """Whether a frame is (the memory of) a bytes object: it is rebuilt as one on the other side."""
    return type(frame) is bytes or type(frame) is memoryview and type(frame.obj) is bytes


class StreamError(ConnectionError):
    """A stream could not be opened, or the peer refused it."""


class Stream:
    """One end of an open stream. ``send`` and ``recv`` may run in different threads; each of them is
    for one thread at a time (callers hold :attr:`write_lock` / :attr:`read_lock`)."""

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.write_lock = threading.Lock()
        self.read_lock = threading.Lock()
        self._buf = bytearray(_BUFFER)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        self._poller = select.poll()
        self._poller.register(sock.fileno(), select.POLLIN)
        self.closed = False

    # -- writing -----------------------------------------------------------------------------
    def send(self, kind: bytes, frames: Sequence[Any]) -> None:
        """Write one message; returns once all of it is in the kernel. OSError if the peer has gone."""
        views = [memoryview(f).cast("B") if type(f) is not bytes else f for f in frames]
        lengths = [len(v) for v in views]
        marks = [n << 1 | _is_bytes(f) for n, f in zip(lengths, frames)]
        header = _HEAD.pack(kind, len(views)) + struct.pack(f"<{len(views)}Q", *marks)
        todo: List[Any] = [header, *views]
        total = len(header) + sum(lengths)
        sent = self.sock.sendmsg(todo)
        while sent < total:  # a partial write: drop what went, go on from the rest
            total -= sent
            while sent:
                first = len(todo[0])
                if sent >= first:
                    sent -= first
                    todo.pop(0)
                else:
                    todo[0] = memoryview(todo[0])[sent:]
                    sent = 0
            sent = self.sock.sendmsg(todo)

    # -- reading -----------------------------------------------------------------------------
    def readable(self, timeout: Optional[float]) -> bool:
        """Whether a message (or the end of the stream) can be read within ``timeout`` s (None: wait)."""
        if self._end > self._start:
            return True
        ms = None if timeout is None else max(0, int(timeout * 1000 + 0.999))
        while True:
            try:
                return bool(self._poller.poll(ms))
            except InterruptedError:  # pragma: no cover - PEP 475 retries for us
                continue

    def _fill(self, need: int) -> None:
        """Make at least ``need`` bytes available from ``_start``; EOFError if the stream ends first."""
        if self._end - self._start >= need:
            return
        if self._start and (self._start + need > len(self._buf) or self._start == self._end):
            left = self._end - self._start
            self._view[:left] = self._view[self._start:self._end]
            self._start, self._end = 0, left
        if need > len(self._buf):
            self._buf.extend(bytes(need - len(self._buf)))
            self._view.release()
            self._view = memoryview(self._buf)
        while self._end - self._start < need:
            got = self.sock.recv_into(self._view[self._end:])
            if not got:
                raise EOFError("the stream ended")
            self._end += got

    def _take(self, mark: int) -> Any:
        length = mark >> 1
        if length >= _OWN_BUFFER:
            made = _bytes_to_fill(length) if mark & 1 else None
            if made is None:
                frame = _bytearray(length)
                view = memoryview(frame)
            else:
                frame, view = made
            have = min(length, self._end - self._start)
            view[:have] = self._view[self._start:self._start + have]
            self._start += have
            try:
                while have < length:
                    got = self.sock.recv_into(view[have:])
                    if not got:
                        raise EOFError("the stream ended inside a message")
                    have += got
            finally:
                view.release()
            return frame
        self._fill(length)
        frame = self._buf[self._start:self._start + length] if mark & 1 == 0 else \
            bytes(self._view[self._start:self._start + length])
        self._start += length
        return frame

    def recv(self) -> Tuple[bytes, List[Any]]:
        """Read one message: (kind, frames). Blocks; EOFError once the peer has closed or gone."""
        try:
            self._fill(_HEAD.size)
            kind, count = _HEAD.unpack_from(self._view, self._start)
            self._start += _HEAD.size
            self._fill(count * 8)
            marks = struct.unpack_from(f"<{count}Q", self._view, self._start)
            self._start += count * 8
            return kind, [self._take(mark) for mark in marks]
        except OSError as exc:
            raise EOFError(f"the stream broke: {exc}") from exc

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.sock.close()
            except OSError:
                pass


# -- opening streams ---------------------------------------------------------------------------

def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise StreamError("the peer closed the connection during the handshake")
        data += chunk
    return bytes(data)


def connect(address: str, secret: bytes, request: dict, timeout: float) -> Stream:
    """Open a stream to the listener at ``address`` ("host:port") and make ``request`` of it.

    Raises StreamError (or auth.AuthenticationError) when it cannot connect, authenticate or the
    listener refuses the request, all within about ``timeout`` seconds.
    """
    host, _, port = address.rpartition(":")
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    except OSError as exc:
        raise StreamError(f"cannot reach the roving stream listener at {address}: {exc}") from exc
    try:
        client_nonce = auth.new_nonce()
        sock.sendall(_GREETING + client_nonce)
        answer = _recv_exact(sock, 2 * auth.NONCE_BYTES)
        server_nonce, proof = answer[:auth.NONCE_BYTES], answer[auth.NONCE_BYTES:]
        if not auth.verify(auth.server_proof(secret, client_nonce, server_nonce), proof):
            raise auth.AuthenticationError(f"the roving stream listener at {address} failed to "
                                           "authenticate")
        body = json.dumps(request).encode()
        sock.sendall(auth.client_proof(secret, client_nonce, server_nonce) + _LENGTH.pack(len(body)) + body)
        verdict = _recv_exact(sock, 1)
    except OSError as exc:
        sock.close()
        if isinstance(exc, (StreamError, auth.AuthenticationError)):
            raise
        raise StreamError(f"opening a stream to {address} failed: {exc}") from exc
    except BaseException:
        sock.close()
        raise
    if verdict != b"\x01":
        sock.close()
        raise StreamError(f"the roving process at {address} refused the stream")
    return Stream(sock)


class Listener:
    """Accepts streams for this process: ``on_open(request, stream)`` decides each authenticated one.

    ``on_open`` must call :func:`accept` on the stream before anything else is written to it, and
    return True; returning False (or raising) refuses it. It runs on a thread of its own per stream.
    """

    def __init__(self, secret: bytes, host: str, advertise: Optional[str],
                 on_open: Callable[[dict, "Stream"], bool]) -> None:
        self._secret = secret
        self._on_open = on_open
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(128)
        port = self._sock.getsockname()[1]
        shown = advertise or host
        self.address = f"[{shown}]:{port}" if ":" in shown else f"{shown}:{port}"
        self._running = True
        self._thread = threading.Thread(target=self._accept_loop, name="roving-streams", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while self._running:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                if not self._running:
                    return
                continue
            threading.Thread(target=self._admit, args=(sock,), name="roving-stream-admit",
                             daemon=True).start()

    def _admit(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(_HANDSHAKE_TIMEOUT)
            greeting = _recv_exact(sock, len(_GREETING) + auth.NONCE_BYTES)
            if greeting[:len(_GREETING)] != _GREETING:
                raise StreamError("not a roving stream")
            client_nonce, server_nonce = greeting[len(_GREETING):], auth.new_nonce()
            sock.sendall(server_nonce + auth.server_proof(self._secret, client_nonce, server_nonce))
            proof = _recv_exact(sock, 32)
            if not auth.verify(auth.client_proof(self._secret, client_nonce, server_nonce), proof):
                raise auth.AuthenticationError("a peer failed authentication")
            (size,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
            if size > _MAX_REQUEST:
                raise StreamError(f"stream request of {size} bytes is too large")
            request = json.loads(_recv_exact(sock, size))
            if not isinstance(request, dict):
                raise StreamError("stream request is not an object")
        except (OSError, ValueError) as exc:
            log.warning("roving stream listener %s: dropped a connection: %s", self.address, exc)
            sock.close()
            return
        stream = Stream(sock)
        try:
            ok = self._on_open(request, stream)
        except Exception:
            log.exception("roving stream listener: handling a stream request failed")
            ok = False
        if not ok:
            try:
                sock.sendall(b"\x00")
            except OSError:
                pass
            stream.close()

    def close(self) -> None:
        self._running = False
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def accept(stream: Stream) -> None:
    """Tell the opening side that its request was taken (call from ``on_open``)."""
    stream.sock.sendall(b"\x01")


def new_token() -> str:
    return os.urandom(12).hex()
