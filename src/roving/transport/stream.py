"""Direct, authenticated message streams between two processes of one session.

A ZeroMQ message crosses ZeroMQ's I/O thread on both sides, and roving's node thread on the owner's:
measured here, a ZeroMQ round trip alone costs about twice a multiprocessing Pipe's. A stream is one TCP
connection whose bytes are read and written by the threads that need them:

* a thread that makes requests of another process's node (queue puts and gets, pipe operations) has a
  stream to that node: it writes its requests and reads its answers itself, and the node's I/O thread
  serves the node's side without ever blocking (:class:`.served.ServedStream`);
* the two ends of a pipe used by two processes talk over a stream of their own, with no I/O thread on
  either side (:mod:`roving.transport.link` decides when).

Guarantees:

* Both sides prove that they know the session secret (:mod:`roving.transport.auth`, fresh nonces each
  way) and who they are (:mod:`.identity`: each its certificate, issued by the session CA, and a
  signature over this handshake) before either reads anything else; the listener then reads one small
  JSON request, and nothing from the connection is unpickled before that. A peer that fails (or whose
  credentials were revoked) is told so with one byte, dropped and logged (throttled). An opener that
  names the node it means (``expect``) refuses any other process's listener, of the same session or
  not: a stream relayed elsewhere ends there. Each side's :attr:`Stream.peer` says who the other is.
* Each side's proof is bound to the connection it came on (:mod:`.auth` says how and why): over TLS the
  certificate in the proof must be the one TLS verified for the peer, over plain text (loopback) the
  signatures name both ends' addresses. A process of the session that sits between two others, ends
  TLS on both sides as itself (or forwards the plain bytes) and relays their proofs is refused by both
  (IdentityError at the opener, naming the address; a refusal logged at the listener): it can only talk
  to each as itself.
* A stream whose address is not loopback (any stream, with ``encrypt="always"``) is TLS 1.3, mutual,
  each side with its own certificate (:mod:`roving.transport.crypto`): what it carries can be neither
  read nor changed on the way; bytes altered or injected make it end (EOFError), never arrive. The opener asks
  for TLS in its first line; the listener refuses plain text from an address that is not loopback.
* Before authentication the listener bounds what a peer can hold: the whole handshake has one deadline
  (:data:`HANDSHAKE_TIMEOUT`), at most :data:`_MAX_HANDSHAKES` run at once, shared fairly between
  source addresses (:class:`.guard.Admission`: a flood from many addresses makes room for a peer from
  another at once), :data:`_MAX_HANDSHAKES_PER_SOURCE` per source address; it reads at most
  :data:`MAX_UNPROVEN` bytes of a peer's own before the peer has proven the member secret and its identity
  (over TLS, after TLS's handshake, whose messages OpenSSL bounds itself), and the request read after
  that is at most :data:`_MAX_REQUEST` bytes.
* A message is one gather write: its frames leave from the caller's buffers without a copy. On the
  receiving side a large frame is read straight into a buffer of its own, which the unpickled object then
  uses as its memory (numpy arrays, tensors, bytearrays).
* Messages arrive whole and in the order written, or the stream reports its end: :meth:`Stream.recv`
  raises EOFError when the peer closed or died (a message cut short by that is dropped, never returned).

This module opens streams (:func:`connect`, :class:`Listener`) and reads and writes them with blocking
calls (:class:`Stream`); how messages are laid out in bytes is :mod:`.framing`'s, the TLS socket that
two threads share is :mod:`.tls`'s, and the I/O thread's side of a stream is :mod:`.served`'s.
"""
from __future__ import annotations

import collections
import functools
import ipaddress
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
from typing import Any, Callable, List, Optional, Sequence, Tuple

from . import addressing, auth
from . import progress
from . import crypto
from . import identity
from . import tls
from .errors import AddressError, AuthenticationError, IdentityError, PeerLeftError, StreamError
from .framing import Reader, advance, encode
from .guard import Admission, Handshake, Refusals

log = logging.getLogger(__name__)

_GREETING = b"roving-stream/1\n"  # a plain-text stream follows
_GREETING_TLS = b"roving-stream/T\n"  # a TLS handshake follows, then the stream
_LENGTH = struct.Struct("<Q")
_CERT_LENGTH = struct.Struct("<H")
_DENIED = b"\x02"  # the listener's verdict on a peer whose proof or identity it refused
_MAX_REQUEST = 16384
#: The most bytes a listener reads of a peer before the peer has proven the member secret and its
#: identity: the greeting, its nonce, its proof, certificate and signature (an opener reads no more of a
#: listener before checking it). A certificate that would take more is refused unread.
MAX_UNPROVEN = 16384
_MAX_CERT = MAX_UNPROVEN - len(_GREETING) - auth.NONCE_BYTES - auth.PROOF_BYTES - _CERT_LENGTH.size \
    - identity.SIGNATURE_BYTES
#: Seconds a peer has for the whole handshake (TLS included), however it spreads its bytes.
HANDSHAKE_TIMEOUT = 10.0
_MAX_HANDSHAKES = 128  # connections authenticating at once; more are dropped
_MAX_HANDSHAKES_PER_SOURCE = 16  # of them from one address


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
        self.encrypted = type(sock) is tls.TlsSocket
        self.write_lock = threading.Lock()
        self.read_lock = threading.Lock()
        self._reader = Reader(sock)
        self._poller = select.poll()
        self._poller.register(sock.fileno(), select.POLLIN)
        self.closed = False
        #: Who is at the other end (:class:`.identity.Peer`), as its handshake proved.
        self.peer: Optional[identity.Peer] = None

    # -- writing -----------------------------------------------------------------------------
    def send(self, kind: bytes, frames: Sequence[Any]) -> None:
        """Write one message; returns once all of it is in the kernel. OSError if the peer has gone."""
        if self.closed:
            raise BrokenPipeError("the stream is closed")
        todo = collections.deque(encode(kind, frames))
        total = sum(len(v) for v in todo)
        sent = 0
        told = progress.Progress(f"sending a message to {progress.peer_of(self.sock)}", total) \
            if total >= progress.FROM else None
        try:
            if self.encrypted:
                while todo:
                    n = tls.write(self.sock, todo, False)
                    sent += n
                    advance(todo, n)
                    if told is not None:
                        told.advance(sent)
            while todo:
                n = self.sock.sendmsg(list(itertools.islice(todo, 512)) if len(todo) > 512 else todo)
                sent += n
                advance(todo, n)
                if told is not None:
                    told.advance(sent)
            if told is not None:
                told.finish()
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

    def interrupt(self) -> None:
        """From any thread: end the stream both ways, leaving the socket open (its owner closes it); a
        thread blocked reading or writing it returns (EOFError, OSError). Safe beside the owner's use,
        as closing the socket under it is not (TLS state in use, a descriptor number reused)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """Close; a thread blocked reading or writing it returns (EOFError, OSError)."""
        if not self.closed:
            self.closed = True
            self.interrupt()
            try:
                self.sock.close()
            except OSError:
                pass


# -- opening streams ---------------------------------------------------------------------------

#: A handshake that ended for these did not fail: its peer went away (a worker ending as its pool
#: closes); counted as refused, but not worth a warning.
_LEFT = (PeerLeftError, ConnectionResetError, BrokenPipeError, ssl.SSLEOFError)


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
            raise PeerLeftError("the peer closed the connection during the handshake")
        data += chunk
    return bytes(data)


#: OpenSSL's reasons for a TLS record that did not decrypt, seen here or told by the peer's alert.
_SPOILED = ("BAD_RECORD_MAC", "DECRYPTION_FAILED")


def _spoiled(exc: ssl.SSLError) -> bool:
    """Whether a TLS error is a record that did not decrypt (changed on the way, or bytes that something
    else wrote into the connection): that connection is no use, but it says nothing of this process's
    certificate, and a new connection may well pass."""
    return any(part in (exc.reason or "") for part in _SPOILED)


def _tls_handshake(sock: socket.socket, creds: identity.Credentials, server: bool,
                   deadline: float) -> tls.TlsSocket:
    """Run the TLS 1.3 handshake over ``sock`` before ``deadline``; the TLS stream, or OSError."""
    server_ctx, client_ctx = crypto.tls_contexts(creds)
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
    return tls.TlsSocket(ssock)


class _Timed:
    """A socket's blocking reads and writes, each bounded by what is left until one deadline."""

    def __init__(self, sock: Any, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline

    def settimeout(self, left: float) -> None:
        if type(self.sock) is not tls.TlsSocket:
            self.sock.settimeout(left)

    def recv(self, size: int) -> bytes:
        if type(self.sock) is not tls.TlsSocket:
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
        if type(self.sock) is tls.TlsSocket:
            self.sock.sendall(data)  # small: the kernel takes it at once
        else:
            self.sock.settimeout(left)
            self.sock.sendall(data)


def _wait(sock: tls.TlsSocket, want: int, deadline: float) -> bool:
    if want == select.POLLIN and sock.pending():
        return True
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    poller = select.poll()
    poller.register(sock.fileno(), want)
    return bool(poller.poll(left * 1000))


def _binding(sock: socket.socket, opener: bool) -> bytes:
    """What a plain-text stream's proofs are bound to (:mod:`.auth`): the opener's and the listener's
    address (IP, port), as this side of the connection sees them; nothing unless both are loopback."""
    ends = [sock.getsockname(), sock.getpeername()]
    if not opener:
        ends.reverse()
    named = []
    for host, port, *_ in ends:
        if not host.startswith("127."):  # else IPv4 loopback, as the kernel writes it: the usual case, at once
            ip = ipaddress.ip_address(host.partition("%")[0])
            ip = getattr(ip, "ipv4_mapped", None) or ip  # ::ffff:127.0.0.1, as a dual-stack socket shows it
            if not ip.is_loopback:
                return b""
            host = str(ip)
        named.append(f"{host} {port}")
    return ("tcp " + " ".join(named)).encode()


def _size_of_certificate(header: bytes, who: str) -> int:
    """The size a peer declares for its certificate; StreamError when it is more than it may send
    before it has proven itself (:data:`MAX_UNPROVEN`)."""
    (size,) = _CERT_LENGTH.unpack(header[-_CERT_LENGTH.size:])
    if size > _MAX_CERT:
        raise StreamError(f"{who} declared a certificate of {size} bytes, more than a peer may send before it "
                          f"has proven itself ({MAX_UNPROVEN} bytes in all): refused unread")
    return size


def _check_channel(link: Any, cert: bytes, who: str) -> None:
    """Over TLS: IdentityError unless ``cert``, the certificate of the peer's proof, is the one TLS verified
    for the peer (so the proof was made on this connection, not relayed onto it)."""
    if type(link) is tls.TlsSocket and link.peer_certificate() != bytes(cert):
        raise IdentityError(
            f"{who} proved itself with a certificate other than the one its TLS connection was made with: "
            "a process of the session relaying the stream between two others (it ends TLS on both sides "
            "as itself); refused")


def connect(address: str, secret: "bytes | identity.Credentials", request: dict, timeout: float,
            encrypt: Optional[str] = None, expect: Optional[str] = None) -> Stream:
    """Open a stream to the listener at ``address`` ("host:port") and make ``request`` of it.

    ``secret``: this process's credentials (:mod:`.identity`; raw secret bytes: the ad hoc ones they
    make). ``expect``: the node key of the process meant (:func:`.identity.node_key` of its node's
    address); a listener of any other process, though of the same session, is refused (IdentityError).
    The stream's :attr:`Stream.peer` says who answered.

    The stream is TLS when ``encrypt`` (default: the ``encrypt`` option) asks for it at this address
    (:func:`roving.transport.crypto.stream_encrypted`). Raises StreamError (or AuthenticationError,
    IdentityError) when it cannot connect, authenticate or the listener refuses the request,
    all within about ``timeout`` seconds.

    Long for a reason: the handshake's steps in the order they happen on the wire (connect, the
    greeting, TLS where asked, the proofs both ways, the request and its verdict), each with the error it raises, read
    top to bottom beside the listener's side (``Listener._admit``).
    """
    creds = identity.credentials(secret)
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    tls = crypto.stream_encrypted(host, encrypt or crypto.mode())
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
        # at once, not only once open: else the TLS hello, which follows the greeting, waits for the
        # greeting's delayed ACK (40 ms on Linux) before it is sent
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError as exc:
        raise StreamError(f"cannot reach the roving stream listener at {address}: {exc}") from exc
    link: Any = sock
    who = f"the roving stream listener at {address}"
    try:
        if tls:
            sock.sendall(_GREETING_TLS)
            try:
                link = _tls_handshake(sock, creds, False, deadline)
            except ssl.SSLError as exc:
                if _spoiled(exc):
                    raise
                raise AuthenticationError(
                    f"{who} failed the TLS handshake (not of this session?): {exc}") from exc
            handshake = auth.ClientHandshake(creds, expect)
            wire = _Timed(link, deadline)
            wire.sendall(handshake.hello)
        else:
            handshake = auth.ClientHandshake(creds, expect, _binding(sock, opener=True))
            wire = _Timed(link, deadline)
            wire.sendall(_GREETING + handshake.hello)
        try:
            answer = _recv_exact(wire, auth.NONCE_BYTES + auth.PROOF_BYTES + _CERT_LENGTH.size, deadline)
            size = _size_of_certificate(answer, who)
            proven = _recv_exact(wire, size + identity.SIGNATURE_BYTES, deadline)
        except ssl.SSLError as exc:
            if _spoiled(exc):
                raise
            raise AuthenticationError(
                f"{who} ended the TLS stream after its handshake: it refused this process's certificate "
                f"(another session's, or revoked?) ({exc})") from exc
        _check_channel(link, proven[:size], who)
        proof, signature = handshake.answer(answer[:auth.NONCE_BYTES],
                                            answer[auth.NONCE_BYTES:auth.NONCE_BYTES + auth.PROOF_BYTES],
                                            proven[:size], proven[size:], who)
        body = json.dumps(request).encode()
        wire.sendall(proof + _CERT_LENGTH.pack(len(creds.cert_der)) + creds.cert_der + signature
                     + _LENGTH.pack(len(body)) + body)
        verdict = _recv_exact(wire, 1, deadline)
    except OSError as exc:
        link.close()
        if isinstance(exc, (StreamError, AuthenticationError, IdentityError)):
            raise
        raise StreamError(f"opening a stream to {address} failed: {exc}") from exc
    except BaseException:
        link.close()
        raise
    if verdict == _DENIED:
        link.close()
        raise AuthenticationError(f"{who} refused this process's secret or identity: is it part of the "
                                       "same roving session, and not revoked?")
    if verdict != b"\x01":
        link.close()
        raise StreamError(f"the roving process at {address} refused the stream")
    stream = Stream(link)
    stream.peer = handshake.peer
    return stream


class Listener:
    """Accepts streams for this process: ``on_open(request, stream)`` decides each authenticated one.

    ``on_open`` must call :func:`accept` on the stream before anything else is written to it, and
    return True; returning False (or raising) refuses it. It runs on a thread of its own per stream.
    Streams are TLS as ``encrypt`` (default: the ``encrypt`` option) requires for their source address;
    an opener that asks for TLS always gets it.
    """

    def __init__(self, secret: "bytes | identity.Credentials", host: str, advertise: Optional[str],
                 on_open: Callable[[dict, "Stream"], bool],
                 port_range: Optional[Tuple[int, int]] = None, encrypt: Optional[str] = None) -> None:
        self._creds = identity.credentials(secret)
        self._on_open = on_open
        self._encrypt = encrypt or crypto.mode()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            addressing.bind_in_range(lambda port: self._sock.bind((host, port)), port_range, host)
        except OSError as exc:
            self._sock.close()
            if isinstance(exc, AddressError):
                raise
            raise AddressError(f"cannot listen on {host} ({exc}): is it an address of this "
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
            try:  # a handle on the connection that the TLS layer does not take over: for an eviction
                pin = sock.dup()
            except OSError as exc:
                self.refusals.refuse(source, f"no descriptor for it: {exc}")
                sock.close()
                time.sleep(0.05)
                continue
            ticket = self._admission.enter(source, functools.partial(pin.shutdown, socket.SHUT_RDWR))
            if ticket.refused:
                self.refusals.refuse(source, ticket.refused)
                pin.close()
                sock.close()
                continue
            try:
                threading.Thread(target=self._admit, args=(sock, pin, ticket), name="roving-stream-admit",
                                 daemon=True).start()
            except RuntimeError as exc:  # no thread can be started now
                self._admission.leave(ticket)
                self.refusals.refuse(source, f"no thread for it: {exc}")
                pin.close()
                sock.close()
                time.sleep(0.05)

    def _admit(self, sock: socket.socket, pin: socket.socket, ticket: Handshake) -> None:
        opened = None
        try:
            opened = self._handshake(sock, ticket.address)
        finally:
            # left before on_open runs: an authenticated stream is no longer a handshake to evict
            self._admission.leave(ticket, opened is not None)
            pin.close()
        if opened is not None:
            self._open(*opened)

    def _handshake(self, sock: socket.socket, source: str) -> Optional[Tuple[Any, dict, identity.Peer]]:
        """The TLS layer (or the plain socket), the request and the identity of a peer that authenticated,
        or None (the connection is closed and the refusal logged)."""
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT
        link: Any = sock
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no handshake step waits on an ACK
            greeting = _recv_exact(_Timed(sock, deadline), len(_GREETING), deadline)
            binding = b""
            if greeting == _GREETING_TLS:
                link = _tls_handshake(sock, self._creds, True, deadline)
            elif greeting != _GREETING:
                raise StreamError("not a roving stream")
            elif crypto.stream_encrypted(source, self._encrypt):
                raise StreamError("plain text refused: streams from this address must be encrypted "
                                  f"(encrypt={self._encrypt!r})")
            else:
                binding = _binding(sock, opener=False)
            wire = _Timed(link, deadline)
            handshake = auth.ServerHandshake(self._creds, _recv_exact(wire, auth.NONCE_BYTES, deadline), binding)
            cert = handshake.cert
            wire.sendall(handshake.nonce + handshake.proof + _CERT_LENGTH.pack(len(cert)) + cert
                         + handshake.signature)
            answer = _recv_exact(wire, auth.PROOF_BYTES + _CERT_LENGTH.size, deadline)
            size = _size_of_certificate(answer, "the peer")
            proven = _recv_exact(wire, size + identity.SIGNATURE_BYTES, deadline)
            try:
                _check_channel(link, proven[:size], "the peer")
                peer = handshake.accepts(answer[:auth.PROOF_BYTES], proven[:size], proven[size:])
            except (AuthenticationError, IdentityError):
                wire.sendall(_DENIED)  # it is told why it gets no stream (it learns nothing else)
                raise
            (size,) = _LENGTH.unpack(_recv_exact(wire, _LENGTH.size, deadline))
            if size > _MAX_REQUEST:
                raise StreamError(f"stream request of {size} bytes is too large")
            request = json.loads(_recv_exact(wire, size, deadline))
            if not isinstance(request, dict):
                raise StreamError("stream request is not an object")
        except Exception as exc:  # not a roving peer, a wrong secret, a bad request, a timeout
            self.refusals.refuse(source, str(exc) or type(exc).__name__, quiet=isinstance(exc, _LEFT))
            link.close()
            return None
        return link, request, peer

    def _open(self, link: Any, request: dict, peer: identity.Peer) -> None:
        stream = Stream(link)
        stream.peer = peer
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
