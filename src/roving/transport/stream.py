"""Direct, authenticated message streams between two processes of one session.

A ZeroMQ message crosses ZeroMQ's I/O thread on both sides, and roving's node thread on the owner's:
measured here, a ZeroMQ round trip alone costs about twice a multiprocessing Pipe's. A stream is one TCP
connection whose bytes are read and written by the threads that need them:

* a thread that makes requests of another process's node (queue puts and gets, pipe operations) has a
  stream to that node: it writes its requests and reads its answers itself, and the node's I/O thread
  serves the node's side without ever blocking (:class:`ServedStream`);
* the two ends of a pipe used by two processes talk over a stream of their own, with no I/O thread on
  either side (:mod:`roving.transport.link` decides when).

Guarantees:

* Both sides prove that they know the session secret (:mod:`roving.transport.auth`, fresh nonces each
  way) before either reads anything else; the listener then reads one small JSON request, and nothing
  from the connection is unpickled before that. A peer that fails is dropped and logged (throttled).
* A stream whose address is not loopback (any stream, with ``encrypt="always"``) is TLS 1.3, mutual,
  with the session's key (:mod:`roving.transport.crypto`): what it carries can be neither read nor
  changed on the way; bytes altered or injected make it end (EOFError), never arrive. The opener asks
  for TLS in its first line; the listener refuses plain text from an address that is not loopback.
* Before authentication the listener bounds what a peer can hold: the whole handshake has one deadline
  (:data:`HANDSHAKE_TIMEOUT`), at most :data:`_MAX_HANDSHAKES` run at once and
  :data:`_MAX_HANDSHAKES_PER_SOURCE` per source address, and the request read is at most
  :data:`_MAX_REQUEST` bytes.
* A message is one gather write: its frames leave from the caller's buffers without a copy. On the
  receiving side a large frame is read straight into a buffer of its own, which the unpickled object then
  uses as its memory (numpy arrays, tensors, bytearrays).
* Messages arrive whole and in the order written, or the stream reports its end: :meth:`Stream.recv`
  raises EOFError when the peer closed or died (a message cut short by that is dropped, never returned).
"""
from __future__ import annotations

import collections
import ctypes
import json
import logging
import os
import itertools
import select
import socket
import ssl
import struct
import threading
import time
from typing import Any, Callable, Deque, List, Optional, Sequence, Tuple

from . import addressing, auth
from . import crypto
from .guard import Admission, Refusals

log = logging.getLogger(__name__)

_GREETING = b"roving-stream/1\n"  # a plain-text stream follows
_GREETING_TLS = b"roving-stream/T\n"  # a TLS handshake follows, then the stream
_HEAD = struct.Struct("<cI")  # kind, number of frames; then one <Q per frame: length << 1 | is-bytes
_LENGTH = struct.Struct("<Q")
_MAX_REQUEST = 16384
_BUFFER = 256 * 1024
_OWN_BUFFER = 64 * 1024  # frames at least this large are read into a buffer of their own
#: Seconds a peer has for the whole handshake (TLS included), however it spreads its bytes.
HANDSHAKE_TIMEOUT = 10.0
_MAX_HANDSHAKES = 128  # connections authenticating at once; more are dropped
_MAX_HANDSHAKES_PER_SOURCE = 16  # of them from one address
_JOIN = 64 * 1024  # over TLS, buffers smaller than this are joined into one write (one record)


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


def _wire(kind: bytes, frames: Sequence[Any]) -> List[Any]:
    """A message as the buffers to write: its header, then its frames (not copied)."""
    views = [f if type(f) is bytes else memoryview(f).cast("B") for f in frames]
    marks = [len(v) << 1 | _is_bytes(f) for v, f in zip(views, frames)]
    # (empty frames are in the header only: a zero-length buffer would never count as written)
    return [_HEAD.pack(kind, len(views)) + struct.pack(f"<{len(views)}Q", *marks), *(v for v in views if len(v))]


def _advance(todo: Deque[Any], sent: int) -> None:
    """Drop ``sent`` bytes from the front of a list of buffers."""
    while sent:
        first = len(todo[0])
        if sent >= first:
            sent -= first
            todo.popleft()
        else:
            todo[0] = memoryview(todo[0])[sent:]
            sent = 0


class _TlsSocket:
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

    def recv_into(self, view: Any) -> int:
        return self._call(lambda: self.ssock.recv_into(view), select.POLLIN)

    def send(self, data: Any) -> int:
        return self._call(lambda: self.ssock.send(data), select.POLLOUT)

    def sendall(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while view:
            view = view[self.send(view):]

    def pending(self) -> int:
        with self._lock:
            return self.ssock.pending()

    def setblocking(self, flag: bool) -> None:
        self.blocking = flag

    def settimeout(self, value: Optional[float]) -> None:
        self.blocking = value != 0

    def setsockopt(self, *args: Any) -> None:
        self.ssock.setsockopt(*args)

    def shutdown(self, how: int) -> None:
        socket.socket.shutdown(self.ssock, how)  # the TCP connection: a thread waiting on it returns

    def close(self) -> None:
        self.ssock.close()


def _tls_write(sock: _TlsSocket, todo: Deque[Any], retry: bool) -> int:
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


class _Reader:
    """Assembles the messages of a stream from its bytes. All its state lives here, so a read that is
    interrupted (a signal, or nothing yet on a non-blocking socket) resumes where it stopped."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.ready: Deque[Tuple[bytes, List[Any]]] = collections.deque()
        self.ended = False
        self._buf = bytearray(_BUFFER)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        self._msg: Optional[Tuple[bytes, Tuple[int, ...], List[Any]]] = None
        self._big: Optional[List[Any]] = None  # [frame, view, bytes in]: a large frame being read

    def buffered(self) -> bool:
        return bool(self.ready) or self._end > self._start

    def step(self) -> None:
        """Parse what is buffered; if that completes no message, read once from the socket (blocking,
        or BlockingIOError on a non-blocking socket with nothing to read) and parse again."""
        while self._parse():
            pass
        if self.ready:
            return
        if self._big is not None:
            frame, view, have = self._big
            got = self.sock.recv_into(view[have:])
            if got:
                self._big[2] = have + got
                if have + got == len(view):
                    view.release()
                    self._big = None
                    self._msg[2].append(frame)
        else:
            if self._start == self._end:
                self._start = self._end = 0
            elif self._end == len(self._buf):
                self._compact()
            got = self.sock.recv_into(self._view[self._end:])
            self._end += got
        if not got:
            self.ended = True
            return
        while self._parse():
            pass

    def _compact(self) -> None:
        left = self._end - self._start
        if self._start:
            self._view[:left] = self._view[self._start:self._end]
            self._start, self._end = 0, left
        if self._end == len(self._buf):  # a header larger than the buffer: grow it
            self._view.release()
            self._buf.extend(bytes(len(self._buf)))
            self._view = memoryview(self._buf)

    def _parse(self) -> bool:
        """Take what the buffer holds of the current message; True when that completed one."""
        if self._big is not None:
            return False
        avail = self._end - self._start
        if self._msg is None:
            if avail < _HEAD.size:
                return False
            kind, count = _HEAD.unpack_from(self._view, self._start)
            if avail < _HEAD.size + 8 * count:
                if self._start + _HEAD.size + 8 * count > len(self._buf):
                    self._compact()
                return False
            marks = struct.unpack_from(f"<{count}Q", self._view, self._start + _HEAD.size)
            self._start += _HEAD.size + 8 * count
            self._msg = (kind, marks, [])
        kind, marks, frames = self._msg
        while len(frames) < len(marks):
            mark = marks[len(frames)]
            length, avail = mark >> 1, self._end - self._start
            if length >= _OWN_BUFFER:
                made = _bytes_to_fill(length) if mark & 1 else None
                if made is None:
                    frame = _bytearray(length)
                    view = memoryview(frame)
                else:
                    frame, view = made
                have = min(length, avail)
                view[:have] = self._view[self._start:self._start + have]
                self._start += have
                if have < length:
                    self._big = [frame, view, have]
                    return False
                view.release()
                frames.append(frame)
            elif avail >= length:
                chunk = self._view[self._start:self._start + length]
                frames.append(bytes(chunk) if mark & 1 else bytearray(chunk))
                self._start += length
            else:
                if self._start + length > len(self._buf):
                    self._compact()
                return False
        self.ready.append((kind, frames))
        self._msg = None
        return True


#: TCP keepalive of every connection: a peer whose machine vanished without closing (power lost, a
#: network partition) is found after ``IDLE + COUNT x INTERVAL`` seconds of silence (25 s), and a read
#: waiting on it fails then instead of waiting for ever. Probes are answered by the peer's kernel, so a
#: peer that is busy or waits on purpose is never taken for dead.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 10, 5, 3


def keep_alive(sock: socket.socket) -> None:
    """Turn on TCP keepalive with the timings above (where the platform lets them be set)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class StreamError(ConnectionError):
    """A stream could not be opened, or the peer refused it."""


class Stream:
    """One end of an open stream, used with blocking calls. ``send`` and ``recv`` may run in different
    threads at once; each is for one thread at a time (callers hold :attr:`write_lock` /
    :attr:`read_lock`). A ``recv`` interrupted by a signal loses nothing: the next one resumes. A
    ``send`` interrupted after part of a message went out closes the stream (the peer drops the part).
    """

    def __init__(self, sock: Any) -> None:
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        keep_alive(sock)
        self.sock = sock
        #: Whether the stream is TLS (roving.transport.crypto).
        self.encrypted = type(sock) is _TlsSocket
        self.write_lock = threading.Lock()
        self.read_lock = threading.Lock()
        self._reader = _Reader(sock)
        self._poller = select.poll()
        self._poller.register(sock.fileno(), select.POLLIN)
        self.closed = False

    # -- writing -----------------------------------------------------------------------------
    def send(self, kind: bytes, frames: Sequence[Any]) -> None:
        """Write one message; returns once all of it is in the kernel. OSError if the peer has gone."""
        if self.closed:
            raise BrokenPipeError("the stream is closed")
        todo = collections.deque(_wire(kind, frames))
        total = sum(len(v) for v in todo)
        sent = 0
        try:
            if self.encrypted:
                while todo:
                    n = _tls_write(self.sock, todo, False)
                    sent += n
                    _advance(todo, n)
                return
            while todo:
                n = self.sock.sendmsg(list(itertools.islice(todo, 512)) if len(todo) > 512 else todo)
                sent += n
                _advance(todo, n)
        except BaseException:
            if 0 < sent < total:  # the peer would read the rest of a message as the next one
                self.close()
            raise

    # -- reading -----------------------------------------------------------------------------
    def readable(self, timeout: Optional[float]) -> bool:
        """Whether a message (or the end of the stream) can be read within ``timeout`` s (None: wait)."""
        if self._reader.buffered() or self._reader.ended:
            return True
        if self.encrypted and self.sock.pending():  # decrypted already, so the socket has it no more
            return True
        ms = None if timeout is None else max(0, int(timeout * 1000 + 0.999))
        return bool(self._poller.poll(ms))

    def recv(self) -> Tuple[bytes, List[Any]]:
        """Read one message: (kind, frames). Blocks; EOFError once the peer has closed or gone."""
        reader = self._reader
        while not reader.ready:
            if reader.ended or self.closed:
                raise EOFError("the stream ended")
            try:
                reader.step()
            except OSError as exc:
                reader.ended = True
                raise EOFError(f"the stream broke: {exc}") from exc
        return reader.ready.popleft()

    def close(self) -> None:
        """Close; a thread blocked reading or writing it returns (EOFError, OSError)."""
        if not self.closed:
            self.closed = True
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                self.sock.close()
            except OSError:
                pass


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
        self._reader = _Reader(self.sock)
        self._tls = stream.encrypted
        self._retry = False  # a TLS write could not finish: the same bytes go first again

    def _write_some(self, todo: Deque[Any]) -> int:
        """Write what the socket takes now from the front of ``todo`` and drop it from there; the bytes
        written. BlockingIOError when it takes nothing."""
        if not self._tls:
            sent = self.sock.sendmsg(list(itertools.islice(todo, self._IOV)))
            _advance(todo, sent)
            return sent
        sent = 0
        while todo:
            try:
                n = _tls_write(self.sock, todo, self._retry)
            except BlockingIOError:
                self._retry = True
                if sent:
                    return sent
                raise
            self._retry = False
            sent += n
            _advance(todo, n)
        return sent

    @property
    def pending(self) -> bool:
        return bool(self._out)

    # -- writing -----------------------------------------------------------------------------
    def write(self, kind: bytes, frames: Sequence[Any],
              undeliverable: Optional[Callable[[], None]] = None) -> bool:
        """Send or queue one message; False (nothing sent) when the stream has ended."""
        todo = _wire(kind, frames)
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
                    _advance(todo, sent)
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


# -- opening streams ---------------------------------------------------------------------------

def _recv_exact(sock: Any, size: int, deadline: float) -> bytes:
    """``size`` bytes, all of them before ``deadline`` (time.monotonic()), or StreamError."""
    data = bytearray()
    while len(data) < size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise StreamError("the handshake did not finish in time")
        sock.settimeout(left)
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise StreamError("the peer closed the connection during the handshake")
        data += chunk
    return bytes(data)


def _tls_handshake(sock: socket.socket, secret: bytes, server: bool, deadline: float) -> _TlsSocket:
    """Run the TLS 1.3 handshake over ``sock`` before ``deadline``; the TLS stream, or OSError."""
    server_ctx, client_ctx = crypto.tls_contexts(secret)
    ctx = server_ctx if server else client_ctx
    ssock = ctx.wrap_socket(sock, server_side=server, do_handshake_on_connect=False)
    ssock.setblocking(False)
    while True:
        try:
            ssock.do_handshake()
            break
        except ssl.SSLWantReadError:
            want = select.POLLIN
        except ssl.SSLWantWriteError:
            want = select.POLLOUT
        left = deadline - time.monotonic()
        poller = select.poll()
        poller.register(ssock.fileno(), want)
        if left <= 0 or not poller.poll(left * 1000):
            raise StreamError("the TLS handshake did not finish in time")
    return _TlsSocket(ssock)


class _Timed:
    """A socket's blocking reads and writes, each bounded by what is left until one deadline."""

    def __init__(self, sock: Any, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline

    def settimeout(self, left: float) -> None:
        if type(self.sock) is not _TlsSocket:
            self.sock.settimeout(left)

    def recv(self, size: int) -> bytes:
        if type(self.sock) is not _TlsSocket:
            return self.sock.recv(size)
        buf = bytearray(size)
        while True:  # a record may come in parts: wait again, until the deadline
            if not _wait(self.sock, select.POLLIN, self.deadline):
                raise StreamError("the handshake did not finish in time")
            self.sock.blocking = False
            try:
                got = self.sock.recv_into(buf)
                return bytes(buf[:got])
            except BlockingIOError:
                continue
            finally:
                self.sock.blocking = True

    def sendall(self, data: bytes) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise StreamError("the handshake did not finish in time")
        if type(self.sock) is _TlsSocket:
            self.sock.sendall(data)  # small: the kernel takes it at once
        else:
            self.sock.settimeout(left)
            self.sock.sendall(data)


def _wait(sock: _TlsSocket, want: int, deadline: float) -> bool:
    if want == select.POLLIN and sock.pending():
        return True
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    poller = select.poll()
    poller.register(sock.fileno(), want)
    return bool(poller.poll(left * 1000))


def connect(address: str, secret: bytes, request: dict, timeout: float,
            encrypt: Optional[str] = None) -> Stream:
    """Open a stream to the listener at ``address`` ("host:port") and make ``request`` of it.

    The stream is TLS when ``encrypt`` (default: the ``encrypt`` option) asks for it at this address
    (:func:`roving.transport.crypto.stream_encrypted`). Raises StreamError (or auth.AuthenticationError)
    when it cannot connect, authenticate or the listener refuses the request, all within about
    ``timeout`` seconds.
    """
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    tls = crypto.stream_encrypted(host, encrypt or crypto.mode())
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    except OSError as exc:
        raise StreamError(f"cannot reach the roving stream listener at {address}: {exc}") from exc
    link: Any = sock
    try:
        client_nonce = auth.new_nonce()
        if tls:
            sock.sendall(_GREETING_TLS)
            try:
                link = _tls_handshake(sock, secret, False, deadline)
            except ssl.SSLError as exc:
                raise auth.AuthenticationError(
                    f"the roving stream listener at {address} failed the TLS handshake (not of this "
                    f"session?): {exc}") from exc
            wire = _Timed(link, deadline)
            wire.sendall(client_nonce)
        else:
            wire = _Timed(link, deadline)
            wire.sendall(_GREETING + client_nonce)
        try:
            answer = _recv_exact(wire, 2 * auth.NONCE_BYTES, deadline)
        except (ssl.SSLError, ConnectionResetError, StreamError) as exc:
            if not tls or "in time" in str(exc):
                raise
            raise auth.AuthenticationError(
                f"the roving stream listener at {address} ended the TLS stream after its handshake: it "
                f"refused this process's certificate (another session's?) ({exc})") from exc
        server_nonce, proof = answer[:auth.NONCE_BYTES], answer[auth.NONCE_BYTES:]
        if not auth.verify(auth.server_proof(secret, client_nonce, server_nonce), proof):
            raise auth.AuthenticationError(f"the roving stream listener at {address} failed to "
                                           "authenticate")
        body = json.dumps(request).encode()
        wire.sendall(auth.client_proof(secret, client_nonce, server_nonce) + _LENGTH.pack(len(body)) + body)
        verdict = _recv_exact(wire, 1, deadline)
    except OSError as exc:
        link.close()
        if isinstance(exc, (StreamError, auth.AuthenticationError)):
            raise
        raise StreamError(f"opening a stream to {address} failed: {exc}") from exc
    except BaseException:
        link.close()
        raise
    if verdict != b"\x01":
        link.close()
        raise StreamError(f"the roving process at {address} refused the stream")
    return Stream(link)


class Listener:
    """Accepts streams for this process: ``on_open(request, stream)`` decides each authenticated one.

    ``on_open`` must call :func:`accept` on the stream before anything else is written to it, and
    return True; returning False (or raising) refuses it. It runs on a thread of its own per stream.
    Streams are TLS as ``encrypt`` (default: the ``encrypt`` option) requires for their source address;
    an opener that asks for TLS always gets it.
    """

    def __init__(self, secret: bytes, host: str, advertise: Optional[str],
                 on_open: Callable[[dict, "Stream"], bool],
                 port_range: Optional[Tuple[int, int]] = None, encrypt: Optional[str] = None) -> None:
        self._secret = secret
        self._on_open = on_open
        self._encrypt = encrypt or crypto.mode()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            addressing.bind_in_range(lambda port: self._sock.bind((host, port)), port_range, host)
        except OSError as exc:
            self._sock.close()
            if isinstance(exc, addressing.AddressError):
                raise
            raise addressing.AddressError(f"cannot listen on {host} ({exc}): is it an address of this "
                                          "machine?") from None
        self._sock.listen(128)
        port = self._sock.getsockname()[1]
        shown = advertise or host
        self.address = f"[{shown}]:{port}" if ":" in shown else f"{shown}:{port}"
        self._running = True
        self._admission = Admission(_MAX_HANDSHAKES, _MAX_HANDSHAKES_PER_SOURCE)
        #: Refused connections, logged at most once a minute per source address.
        self.refusals = Refusals(log, f"stream listener {self.address}")
        self._thread = threading.Thread(target=self._accept_loop, name="roving-streams", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        """Accept connections until closed. Nothing stops it but :meth:`close`: a connection that cannot
        be taken on (out of file descriptors or threads) is dropped with a warning, and the loop pauses
        briefly so that a lasting shortage does not spin."""
        while self._running:
            try:
                sock, peer = self._sock.accept()
            except OSError as exc:
                if not self._running:
                    return
                self.refusals.refuse("(accept)", f"accepting a connection failed: {exc}")
                time.sleep(0.05)
                continue
            source = str(peer[0])
            why = self._admission.enter(source)
            if why:
                self.refusals.refuse(source, why)
                sock.close()
                continue
            try:
                threading.Thread(target=self._admit, args=(sock, source), name="roving-stream-admit",
                                 daemon=True).start()
            except RuntimeError as exc:  # no thread can be started now
                self._admission.leave(source)
                self.refusals.refuse(source, f"no thread for it: {exc}")
                sock.close()
                time.sleep(0.05)

    def _admit(self, sock: socket.socket, source: str) -> None:
        try:
            self._handshake(sock, source)
        finally:
            self._admission.leave(source)

    def _handshake(self, sock: socket.socket, source: str) -> None:
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT
        link: Any = sock
        try:
            greeting = _recv_exact(_Timed(sock, deadline), len(_GREETING), deadline)
            if greeting == _GREETING_TLS:
                link = _tls_handshake(sock, self._secret, True, deadline)
            elif greeting != _GREETING:
                raise StreamError("not a roving stream")
            elif crypto.stream_encrypted(source, self._encrypt):
                raise StreamError("plain text refused: streams from this address must be encrypted "
                                  f"(encrypt={self._encrypt!r})")
            wire = _Timed(link, deadline)
            client_nonce, server_nonce = _recv_exact(wire, auth.NONCE_BYTES, deadline), auth.new_nonce()
            wire.sendall(server_nonce + auth.server_proof(self._secret, client_nonce, server_nonce))
            proof = _recv_exact(wire, 32, deadline)
            if not auth.verify(auth.client_proof(self._secret, client_nonce, server_nonce), proof):
                raise auth.AuthenticationError("it failed to prove the session secret")
            (size,) = _LENGTH.unpack(_recv_exact(wire, _LENGTH.size, deadline))
            if size > _MAX_REQUEST:
                raise StreamError(f"stream request of {size} bytes is too large")
            request = json.loads(_recv_exact(wire, size, deadline))
            if not isinstance(request, dict):
                raise StreamError("stream request is not an object")
        except Exception as exc:  # not a roving peer, a wrong secret, a bad request, a timeout
            self.refusals.refuse(source, str(exc) or type(exc).__name__)
            link.close()
            return
        stream = Stream(link)
        try:
            ok = self._on_open(request, stream)
        except Exception:
            log.exception("roving stream listener: handling a stream request failed")
            ok = False
        if not ok:
            try:
                link.sendall(b"\x00")
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
