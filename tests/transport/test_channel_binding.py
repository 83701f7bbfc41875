"""Streams bound to their channel (issue 51): a process of the session that sits between two others'
stream, ends both legs as itself (TLS with its own, valid certificate; or the plain TCP connections on
loopback) and relays their proofs is refused by both; a proof whose certificate is not the one TLS
verified is refused; and a listener reads at most 16 KiB of a peer before the peer has proven itself."""
from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any, List, Optional

import pytest

from helpers_core import TIMEOUT, wait_until
from roving.transport import auth, identity
from roving.transport import stream as _stream
from roving.transport import tls as _tls

_CHALLENGE = auth.NONCE_BYTES + auth.PROOF_BYTES + _stream._CERT_LENGTH.size


class _Session:
    """Credentials of processes of one session, as its root's CA issues them."""

    def __init__(self) -> None:
        self.root = identity.root(os.urandom(32), "root-" + os.urandom(4).hex())

    def issue(self, name: str) -> identity.Credentials:
        return identity.Credentials(self.root.secret, self.root.authority.issue(f"{name}-{os.urandom(4).hex()}"))


class _Served:
    """A stream listener of the process ``creds`` that takes every stream and echoes one message on it."""

    def __init__(self, creds: identity.Credentials, encrypt: str) -> None:
        self.opened: List[Any] = []
        self.listener = _stream.Listener(creds, "127.0.0.1", None, self._on_open, encrypt=encrypt)
        self.address = self.listener.address

    def _on_open(self, request: dict, stream: _stream.Stream) -> bool:
        self.opened.append(stream.peer)  # before the opener learns that it is taken
        _stream.accept(stream)
        threading.Thread(target=self._echo, args=(stream,), daemon=True).start()
        return True

    @staticmethod
    def _echo(stream: _stream.Stream) -> None:
        try:
            kind, frames = stream.recv()
            stream.send(kind, frames)
        except (EOFError, OSError):
            pass

    def close(self) -> None:
        self.listener.close()


class _Relay:
    """A third process of the session between an opener and ``target``'s listener: it takes the
    opener's connection, opens its own to the target, and forwards what each side sends to the other.
    With ``tls``, it ends TLS on both legs as itself (``creds``, valid in the session), so it reads in
    the clear everything the two send through it (:attr:`seen`); without, it forwards the plain bytes."""

    def __init__(self, creds: identity.Credentials, target: str, tls: bool) -> None:
        self._creds, self._tls = creds, tls
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
        #: Both legs are up (TLS ended on both, as the relay).
        self.legs = threading.Event()
        #: The bytes the target sent towards the opener, and everything seen either way.
        self.to_opener = 0
        self.seen = bytearray()
        self._socks: List[Any] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        try:
            down, _ = self._server.accept()
        except OSError:
            return
        deadline = time.monotonic() + TIMEOUT
        down.settimeout(TIMEOUT)
        greeting = _stream._recv_exact(down, len(_stream._GREETING), deadline)
        up = socket.create_connection(self._target, timeout=TIMEOUT)
        up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        up.sendall(greeting)
        if self._tls:
            down = _stream._tls_handshake(down, self._creds, True, deadline)
            up = _stream._tls_handshake(up, self._creds, False, deadline)
        else:
            self.seen += greeting
        self._socks += [down, up]
        self.legs.set()
        threading.Thread(target=self._pump, args=(down, up, False), daemon=True).start()
        self._pump(up, down, True)

    def _pump(self, src: Any, dst: Any, to_opener: bool) -> None:
        if type(src) is socket.socket:
            src.settimeout(None)
        buf = bytearray(65536)
        try:
            while True:
                n = src.recv_into(buf)
                if not n:
                    break
                self.seen += buf[:n]
                if to_opener:
                    self.to_opener += n
                dst.sendall(bytes(buf[:n]))
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._server.close()
        for sock in self._socks:
            sock.close()


@pytest.fixture
def session() -> _Session:
    return _Session()


def _round_trip(stream: _stream.Stream, data: bytes) -> bytes:
    stream.send(b"D", [data])
    return stream.recv()[1][0]


# -- a relay with credentials of its own ------------------------------------------------------------

@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plain"])
def test_a_session_member_relaying_two_others_stream_is_refused_and_the_direct_stream_works(session, tls):
    opener, target, relay_creds = session.issue("a"), session.issue("b"), session.issue("relay")
    encrypt = "always" if tls else "auto"
    served = _Served(target, encrypt)
    relay = _Relay(relay_creds, served.address, tls)
    try:
        with pytest.raises(identity.IdentityError) as caught:
            _stream.connect(relay.address, opener, {"purpose": "test"}, TIMEOUT, encrypt=encrypt, expect=target.key)
        message = str(caught.value)
        assert relay.address in message
        if tls:
            assert "certificate other than the one its TLS connection was made with" in message
        else:
            assert "over this connection" in message
        # the relay was a working man in the middle: both legs up, and the target's proof reached the
        # opener through it; the opener sent nothing after (no proof of its own to relay), so no stream
        assert relay.legs.is_set() and relay.to_opener >= _CHALLENGE + len(target.cert_der)
        assert served.opened == []
        direct = _stream.connect(served.address, opener, {"purpose": "test"}, TIMEOUT, encrypt=encrypt,
                                 expect=target.key)
        assert direct.encrypted == tls and direct.peer.node_id == target.node_id
        assert _round_trip(direct, b"the honest path") == b"the honest path"
        direct.close()
        assert [p.node_id for p in served.opened] == [opener.node_id]
    finally:
        relay.close()
        served.close()


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plain"])
def test_without_the_binding_the_same_relay_would_read_the_stream(session, tls, monkeypatch):
    """The control of the test above: with the checks of the binding taken out, the relay's stream is
    taken by both sides, and the relay reads what they send (so the refusal above is the binding's)."""
    monkeypatch.setattr(_stream, "_check_channel", lambda link, cert, who: None)
    monkeypatch.setattr(_stream, "_binding", lambda sock, opener: b"")
    opener, target, relay_creds = session.issue("a"), session.issue("b"), session.issue("relay")
    encrypt = "always" if tls else "auto"
    served = _Served(target, encrypt)
    relay = _Relay(relay_creds, served.address, tls)
    try:
        stream = _stream.connect(relay.address, opener, {"purpose": "test"}, TIMEOUT, encrypt=encrypt,
                                 expect=target.key)
        assert stream.peer.node_id == target.node_id
        assert _round_trip(stream, b"meant for b alone") == b"meant for b alone"
        assert b"meant for b alone" in relay.seen
        stream.close()
    finally:
        relay.close()
        served.close()


# -- a proof whose certificate is not TLS's -------------------------------------------------------

def _open_tls(address: str, creds: identity.Credentials) -> _tls.TlsSocket:
    """A TLS connection to a stream listener, made as ``creds`` (the greeting and TLS's handshake)."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=TIMEOUT)
    sock.sendall(_stream._GREETING_TLS)
    return _stream._tls_handshake(sock, creds, False, time.monotonic() + TIMEOUT)


@pytest.mark.parametrize("tls_as", ["relay", "a"])
def test_a_listener_refuses_a_proof_whose_certificate_is_not_the_one_tls_verified(session, tls_as, caplog):
    """TLS made with the relay's certificate, then a's own proof (its certificate, its signature over
    this handshake): refused with the one-byte verdict, and the stream never opens. The control: the
    same steps with TLS made as a are taken."""
    a, target = session.issue("a"), session.issue("b")
    tls_creds = session.issue("relay") if tls_as == "relay" else a
    served = _Served(target, "always")
    before = served.listener.refusals.count
    link = _open_tls(served.address, tls_creds)
    try:
        deadline = time.monotonic() + TIMEOUT
        wire = _stream._Timed(link, deadline)
        handshake = auth.ClientHandshake(a, target.key)
        wire.sendall(handshake.hello)
        answer = _stream._recv_exact(wire, _CHALLENGE, deadline)
        (size,) = _stream._CERT_LENGTH.unpack(answer[-2:])
        proven = _stream._recv_exact(wire, size + identity.SIGNATURE_BYTES, deadline)
        proof, signature = handshake.answer(answer[:auth.NONCE_BYTES], answer[auth.NONCE_BYTES:-2],
                                            proven[:size], proven[size:], "b")
        body = b"{}"
        wire.sendall(proof + _stream._CERT_LENGTH.pack(len(a.cert_der)) + a.cert_der + signature
                     + _stream._LENGTH.pack(len(body)) + body)
        verdict = _stream._recv_exact(wire, 1, deadline)
    finally:
        link.close()
    if tls_as == "relay":
        assert verdict == _stream._DENIED
        # the verdict is sent before the refusal is counted
        assert wait_until(lambda: served.listener.refusals.count == before + 1, TIMEOUT)
        assert served.opened == []
        assert ("refused a connection from 127.0.0.1: the peer proved itself with a certificate other than "
                "the one its TLS connection was made with") in caplog.text
    else:
        assert verdict == b"\x01"
        assert [p.node_id for p in served.opened] == [a.node_id]
    served.close()


def test_an_opener_refuses_a_listener_whose_proof_names_another_certificate_than_tls(session):
    """A listener that makes TLS as one process (its own certificate) and shows another's proof (the
    target's, whose key it would need to relay from the target): the opener refuses it, naming it."""
    a, target, relay_creds = session.issue("a"), session.issue("b"), session.issue("relay")
    server = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{server.getsockname()[1]}"
    done = threading.Event()

    def listen() -> None:
        sock, _ = server.accept()
        deadline = time.monotonic() + TIMEOUT
        sock.settimeout(TIMEOUT)
        _stream._recv_exact(sock, len(_stream._GREETING_TLS), deadline)
        link = _stream._tls_handshake(sock, relay_creds, True, deadline)
        wire = _stream._Timed(link, deadline)
        handshake = auth.ServerHandshake(target, _stream._recv_exact(wire, auth.NONCE_BYTES, deadline))
        wire.sendall(handshake.nonce + handshake.proof + _stream._CERT_LENGTH.pack(len(target.cert_der))
                     + target.cert_der + handshake.signature)
        done.wait(TIMEOUT)
        link.close()

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    try:
        with pytest.raises(identity.IdentityError, match=f"at {address} proved itself with a certificate other"):
            _stream.connect(address, a, {"purpose": "test"}, TIMEOUT, encrypt="always", expect=target.key)
    finally:
        done.set()
        thread.join(TIMEOUT)
        server.close()


# -- plain text: the signatures name the connection ---------------------------------------------------

def _naive_open(address: str, creds: identity.Credentials, node_key: str) -> Optional[bytes]:
    """A plain-text opener that signs the addresses it sees, as a stream's must, but does not check the
    listener's proof (as a victim that is fooled would not): the listener's verdict byte, or None when
    it closed the connection without one."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=TIMEOUT)
    try:
        binding = _stream._binding(sock, opener=True)
        assert binding  # loopback both ends: the addresses are bound
        hello = auth.new_nonce()
        sock.sendall(_stream._GREETING + hello)
        deadline = time.monotonic() + TIMEOUT
        answer = _stream._recv_exact(sock, _CHALLENGE, deadline)
        (size,) = _stream._CERT_LENGTH.unpack(answer[-2:])
        _stream._recv_exact(sock, size + identity.SIGNATURE_BYTES, deadline)
        nonce = answer[:auth.NONCE_BYTES]
        body = b"{}"
        sock.sendall(auth.client_proof(creds.secret, hello, nonce) + _stream._CERT_LENGTH.pack(len(creds.cert_der))
                     + creds.cert_der + creds.prove(False, hello, nonce, node_key, binding)
                     + _stream._LENGTH.pack(len(body)) + body)
        try:
            return _stream._recv_exact(sock, 1, deadline)
        except _stream.StreamError:
            return None
    finally:
        sock.close()


@pytest.mark.parametrize("via_relay", [True, False], ids=["relayed", "direct"])
def test_a_plain_listener_refuses_a_proof_signed_over_another_connections_addresses(session, via_relay):
    """Through a relay that forwards the bytes untouched, the opener's signature names its own leg's
    addresses, not the listener's: refused. The control: the same opener straight to the listener is taken."""
    a, target = session.issue("a"), session.issue("b")
    served = _Served(target, "auto")
    relay = _Relay(session.issue("relay"), served.address, tls=False) if via_relay else None
    try:
        verdict = _naive_open(relay.address if relay else served.address, a, target.key)
        if via_relay:
            assert verdict == _stream._DENIED and served.opened == []
        else:
            assert verdict == b"\x01" and [p.node_id for p in served.opened] == [a.node_id]
    finally:
        if relay:
            relay.close()
        served.close()


def test_the_binding_is_what_both_sides_of_one_connection_see_and_differs_between_two(session):
    server = socket.create_server(("127.0.0.1", 0))
    try:
        one = socket.create_connection(server.getsockname())
        one_there, _ = server.accept()
        two = socket.create_connection(server.getsockname())
        two_there, _ = server.accept()
        assert _stream._binding(one, opener=True) == _stream._binding(one_there, opener=False)
        assert _stream._binding(one, opener=True) != _stream._binding(two, opener=True)
        for sock in (one, one_there, two, two_there):
            sock.close()
    finally:
        server.close()


def test_the_binding_is_the_same_when_an_ipv6_listener_sees_an_ipv4_opener():
    """A dual-stack listener sees its IPv4 opener as ::ffff:127.0.0.1; both sides still sign the same."""
    server = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    try:
        server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        server.bind(("::ffff:127.0.0.1", 0))
        server.listen()
        opener = socket.create_connection(("127.0.0.1", server.getsockname()[1]))
        there, seen = server.accept()
        assert seen[0] == "::ffff:127.0.0.1"
        assert _stream._binding(opener, opener=True) == _stream._binding(there, opener=False) != b""
        opener.close()
        there.close()
    finally:
        server.close()


# -- what a peer may send before it has proven itself -------------------------------------------------

def test_the_bytes_read_before_the_proof_add_up_to_16_kib():
    assert _stream.MAX_UNPROVEN == 16 * 1024
    assert (len(_stream._GREETING) + auth.NONCE_BYTES + auth.PROOF_BYTES + _stream._CERT_LENGTH.size
            + _stream._MAX_CERT + identity.SIGNATURE_BYTES) == _stream.MAX_UNPROVEN


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plain"])
@pytest.mark.parametrize("declared", ["one byte too many", "the most"])
def test_a_peer_that_would_send_more_than_16_kib_before_its_proof_is_cut_off_unread(session, tls, declared,
                                                                                   monkeypatch, caplog):
    """The peer declares a certificate one byte over what fits in 16 KiB with the rest of its handshake:
    the listener closes the connection at once, without waiting for those bytes (the handshake's
    deadline is a minute here) and without a verdict. The control: a certificate of the most that fits,
    sent whole (garbage), is read and then refused with the verdict."""
    monkeypatch.setattr(_stream, "HANDSHAKE_TIMEOUT", 60.0)
    a, target = session.issue("a"), session.issue("b")
    served = _Served(target, "always" if tls else "auto")
    size = _stream._MAX_CERT + (1 if declared == "one byte too many" else 0)
    host, _, port = served.address.rpartition(":")
    link: Any
    if tls:
        link = _open_tls(served.address, a)
    else:
        link = socket.create_connection((host, int(port)), timeout=TIMEOUT)
        link.sendall(_stream._GREETING)
    try:
        deadline = time.monotonic() + TIMEOUT
        wire = _stream._Timed(link, deadline)
        wire.sendall(auth.new_nonce())
        answer = _stream._recv_exact(wire, _CHALLENGE, deadline)
        (theirs,) = _stream._CERT_LENGTH.unpack(answer[-2:])
        _stream._recv_exact(wire, theirs + identity.SIGNATURE_BYTES, deadline)
        start = time.monotonic()
        wire.sendall(os.urandom(auth.PROOF_BYTES) + _stream._CERT_LENGTH.pack(size))
        if declared == "the most":
            wire.sendall(os.urandom(size + identity.SIGNATURE_BYTES))
        got: Optional[bytes]
        try:
            got = wire.recv(1)
        except (socket.timeout, _stream.StreamError):
            got = None  # nothing came, the connection still open: the listener waits for the bytes
        except OSError:  # reset, or TLS that ended without its closing alert
            got = b""
        assert time.monotonic() - start < 10, "the listener waited for the bytes"
        if declared == "the most":
            assert got == _stream._DENIED
        else:
            assert got == b""
            assert f"declared a certificate of {size} bytes" in caplog.text
        assert served.opened == []
    finally:
        link.close()
        served.close()


# -- ZeroMQ: CURVE binds already ---------------------------------------------------------------------

def test_a_session_member_cannot_end_curve_for_a_client_that_meant_another_node(session):
    """A relay's own node, at whose port a client arrives meaning the target (the target's key in the
    address): the client pins the target's key in CURVE's handshake, which the relay cannot finish (it
    has its own key, not the target's), so nothing reaches either; the same client reaches the target."""
    from roving.transport import endpoint as _endpoint
    from roving.transport import node as _node

    client = session.issue("a")
    target = _node.Node(session.issue("b"))
    relay = _node.Node(session.issue("relay"))
    box = target.mailboxes.new_box()
    try:
        posing = identity.bare(relay.address) + "#" + identity.node_key(target.address)
        ep = _endpoint.Endpoint(posing, client, None, connect_timeout=5)
        ep._streams = ""  # ZeroMQ only
        with pytest.raises(auth.AuthenticationError):
            ep.call(_node.PUT, box, 0, [b"meant for b"])
        direct = _endpoint.Endpoint(target.address, client, None, connect_timeout=TIMEOUT)
        direct._streams = ""
        assert direct.call(_node.PUT, box, 0, [b"meant for b"])[0] == _node.OK
    finally:
        relay.close()
        target.close()
