"""The transport refuses whoever lacks the session secret, unpickles nothing they send, and survives junk."""
from __future__ import annotations

import os
import pickle
import queue
import socket
import struct
import sys
import threading
import time

import pytest
import zmq

import helpers_targets as h
import roving
from helpers_core import TIMEOUT
from roving.transport import crypto, identity
from roving.transport import auth
from roving.transport import endpoint as _endpoint
from roving.transport import node as _node
from roving.transport import served as _served
from roving.transport import session as _session
from roving.transport import stream as _stream
from roving.transport.serialize import dumps

HEADER = struct.Struct("<QQd")  # (box id, request id, timeout): the request header of the wire protocol


def evil_frames(marker):
    """A request that, were it stored and read, would create ``marker`` when unpickled."""
    return [pickle.dumps(h.Evil(str(marker)), protocol=5)]


def raw_dealer(address):
    """A bare DEALER that passes ZeroMQ's CURVE handshake with the session's keys (as a session process
    would) and does nothing more: the tests below try roving's own handshake with it."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    crypto.curve_client(sock, _session.current().secret, identity.node_key(address))
    sock.connect(identity.bare(address))
    return sock


def recv_or_none(sock, timeout_s):
    if sock.poll(timeout_s * 1000):
        return sock.recv_multipart()
    return None


def assert_queue_still_serves(q):
    """The node answers an authenticated remote client, and a child, after what it was sent."""
    conn = _endpoint._ZmqConnection(q._address, _session.current().secret, TIMEOUT)
    try:
        conn.send(_node.PUT_NOREPLY, q._box, 0, dumps("from a good client"))
        assert q.get(timeout=TIMEOUT) == "from a good client"
    finally:
        conn.sock.close(0)
    p = roving.Process(target=h.put_value, args=(q, "from a child"))
    p.start()
    assert q.get(timeout=TIMEOUT) == "from a child"
    p.join(TIMEOUT)
    assert p.exitcode == 0


def test_raw_frames_of_an_authenticated_client_do_reach_the_queue():
    """Positive control for the tests below: the same frames, after the handshake, are accepted."""
    q = roving.Queue()
    conn = _endpoint._ZmqConnection(q._address, _session.current().secret, TIMEOUT)
    try:
        conn.sock.send_multipart([_node.PUT_NOREPLY, HEADER.pack(q._box, 1, 0.0), pickle.dumps("accepted")])
        assert q.get(timeout=TIMEOUT) == "accepted"
    finally:
        conn.sock.close(0)


def test_client_without_the_secret_is_ignored_and_its_pickle_is_never_unpickled(tmp_path):
    q = roving.Queue()
    marker = tmp_path / "unpickled-marker"
    sock = raw_dealer(q._address)
    try:
        # straight to a request, no handshake at all
        for op in (_node.PUT_NOREPLY, _node.PUT, _node.PUT_FRONT):
            sock.send_multipart([op, HEADER.pack(q._box, 1, 0.0), *evil_frames(marker)])
        sock.send_multipart([_node.GET, HEADER.pack(q._box, 2, 0.0)])
        sock.send_multipart([_node.PING, HEADER.pack(0, 3, 0.0)])
        # no answer to anything: only, once, the node's fixed word that this connection has not
        # authenticated (what a client whose connection was re-made after a network drop needs to hear)
        assert recv_or_none(sock, TIMEOUT) == [auth.REAUTH]
        assert recv_or_none(sock, 1.0) is None
    finally:
        sock.close(0)
    with pytest.raises(queue.Empty):
        q.get(timeout=0.5)
    assert q.qsize() == 0
    assert not marker.exists()
    assert_queue_still_serves(q)
    assert not marker.exists()


def test_client_with_a_wrong_secret_is_denied_and_what_it_sends_after_is_dropped(tmp_path):
    q = roving.Queue()
    marker = tmp_path / "unpickled-marker"
    wrong = os.urandom(32)
    sock = raw_dealer(q._address)
    try:
        client_nonce = auth.new_nonce()
        sock.send_multipart([b"hello", client_nonce])
        reply = recv_or_none(sock, TIMEOUT)
        assert reply is not None and reply[0] == b"challenge"
        server_nonce = reply[1]
        # a client that ignores the server's proof and answers with a proof made from the wrong secret
        sock.send_multipart([b"proof", auth.client_proof(wrong, client_nonce, server_nonce)])
        assert recv_or_none(sock, TIMEOUT) == [b"denied"]
        sock.send_multipart([_node.PUT_NOREPLY, HEADER.pack(q._box, 1, 0.0), *evil_frames(marker)])
        sock.send_multipart([_node.PING, HEADER.pack(0, 2, 0.0)])
        assert recv_or_none(sock, TIMEOUT) == [auth.REAUTH]  # the fixed word only, as above
        assert recv_or_none(sock, 1.0) is None
    finally:
        sock.close(0)
    with pytest.raises(queue.Empty):
        q.get(timeout=0.5)
    assert not marker.exists()
    assert_queue_still_serves(q)


def test_replayed_proof_of_another_connection_is_denied():
    q = roving.Queue()
    secret = _session.current().secret
    first = raw_dealer(q._address)
    second = raw_dealer(q._address)
    try:
        nonce = auth.new_nonce()
        first.send_multipart([b"hello", nonce])
        challenge = recv_or_none(first, TIMEOUT)
        creds = identity.credentials(secret)
        good_proof = [auth.client_proof(secret, nonce, challenge[1]), creds.cert_der,
                      creds.prove(False, nonce, challenge[1], identity.node_key(q._address))]
        # the second connection replays the first one's exchange: its server nonce differs, so it fails
        second.send_multipart([b"hello", nonce])
        assert recv_or_none(second, TIMEOUT)[0] == b"challenge"
        second.send_multipart([b"proof", *good_proof])
        assert recv_or_none(second, TIMEOUT) == [b"denied"]
        first.send_multipart([b"proof", *good_proof])
        assert recv_or_none(first, TIMEOUT) == [b"welcome"]
    finally:
        first.close(0)
        second.close(0)


def test_connecting_with_a_wrong_secret_raises_the_public_roving_authentication_error():
    """roving.AuthenticationError (multiprocessing's, exported by roving) is what a program catches."""
    q = roving.Queue()
    with pytest.raises(roving.AuthenticationError):
        _endpoint._ZmqConnection(q._address, os.urandom(32), TIMEOUT)


def test_connecting_with_a_wrong_secret_raises_the_transports_authentication_error():
    q = roving.Queue()
    with pytest.raises(auth.AuthenticationError):
        _endpoint._ZmqConnection(q._address, os.urandom(32), TIMEOUT)


def test_garbage_bytes_over_plain_tcp_do_not_stop_the_node():
    q = roving.Queue()
    host, port = identity.bare(q._address)[len("tcp://"):].rsplit(":", 1)
    payloads = [os.urandom(4096), b"\xff" + b"\x00" * 8 + b"\x7f" + os.urandom(64),  # ZMTP-ish greeting
                b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x00" * 100000]
    for payload in payloads:
        with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
            try:
                s.sendall(payload)
                s.settimeout(0.3)
                s.recv(1024)
            except OSError:  # the node may hang up on us: that is fine
                pass
    # a half-open connection left lying around while the node serves others
    lingering = socket.create_connection((host, int(port)), timeout=TIMEOUT)
    try:
        lingering.sendall(os.urandom(100))
        assert_queue_still_serves(q)
    finally:
        lingering.close()
    assert_queue_still_serves(q)


def test_malformed_requests_from_an_authenticated_peer_do_not_stop_the_node():
    q = roving.Queue()
    conn = _endpoint._ZmqConnection(q._address, _session.current().secret, TIMEOUT)
    try:
        conn.sock.send_multipart([_node.PUT_NOREPLY])  # no header
        conn.sock.send_multipart([_node.PUT_NOREPLY, b"short"])  # bad header
        conn.sock.send_multipart([b"?", HEADER.pack(q._box, 1, 0.0)])  # unknown operation
        conn.sock.send_multipart([_node.GET, HEADER.pack(987654, 2, 0.0)])  # no such box
        reply = recv_or_none(conn.sock, TIMEOUT)
        assert reply is not None  # answered, with an error status
    finally:
        conn.sock.close(0)
    assert_queue_still_serves(q)


# -- the same over streams (requests from other processes go over a stream when the node has one) ---

def stream_address(q):
    """The stream listener of the node that owns ``q`` (as a remote process finds it)."""
    conn = _endpoint._ZmqConnection(q._address, _session.current().secret, TIMEOUT)
    try:
        status, frames = conn.call(_node.STREAMS, 0, 0, [], TIMEOUT)
        assert status == _node.OK
        return bytes(frames[0]).decode()
    finally:
        conn.close()


def stream_request_frames(op, box, req, payload):
    """A request as it travels on a stream: kind, frame count and lengths, then the frames."""
    frames = [op, HEADER.pack(box, req, 0.0), *payload]
    head = struct.pack("<cI", b"Q", len(frames)) + struct.pack(f"<{len(frames)}Q", *(len(f) << 1 for f in frames))
    return head + b"".join(frames)


def test_requests_of_other_processes_go_over_a_stream():
    q = roving.Queue()
    p = roving.Process(target=h.put_value, args=(q, "over a stream"))
    p.start()
    assert q.get(timeout=TIMEOUT) == "over a stream"
    p.join(TIMEOUT)
    conn = _endpoint._StreamConnection(q._address, stream_address(q), _session.current().secret, TIMEOUT)
    try:
        conn.send(_node.PUT_NOREPLY, q._box, 0, dumps("from a stream client"))
        assert q.get(timeout=TIMEOUT) == "from a stream client"
        status, frames = conn.call(_node.SIZE, q._box, 0, [], TIMEOUT)
        assert status == _node.OK and struct.unpack("<QQ", frames[0])[0] == 0
    finally:
        conn.close()


def test_a_stream_client_without_the_secret_is_dropped_and_its_pickle_never_unpickled(tmp_path):
    q = roving.Queue()
    marker = tmp_path / "unpickled-marker"
    host, port = stream_address(q).rsplit(":", 1)
    evil = stream_request_frames(_node.PUT_NOREPLY, q._box, 1, evil_frames(marker))
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:  # no handshake at all
        s.sendall(evil)
        s.settimeout(TIMEOUT)
        try:
            assert s.recv(1) == b""
        except ConnectionResetError:
            pass
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:  # a wrong proof, then a request
        s.settimeout(TIMEOUT)
        nonce = auth.new_nonce()
        s.sendall(b"roving-stream/1\n" + nonce)
        answer = b""
        while len(answer) < 66 or len(answer) < 66 + struct.unpack("<H", answer[64:66])[0] + 64:
            answer += s.recv(4096)  # nonce, proof, the node's certificate and signature
        request = b'{"purpose": "node"}'
        s.sendall(auth.client_proof(os.urandom(32), nonce, answer[:32]) + struct.pack("<H", 0) + bytes(64)
                  + struct.pack("<Q", len(request)) + request + evil)
        try:
            assert s.recv(1) == b"\x02"  # told it is refused, and nothing more
            assert s.recv(1) == b""
        except ConnectionResetError:
            pass
    with pytest.raises(auth.AuthenticationError):
        _endpoint._StreamConnection(q._address, f"{host}:{port}", os.urandom(32), TIMEOUT)
    with pytest.raises(queue.Empty):
        q.get(timeout=0.5)
    assert not marker.exists()
    assert_queue_still_serves(q)
    assert not marker.exists()


def test_malformed_messages_from_an_authenticated_stream_peer_do_not_stop_the_node():
    q = roving.Queue()
    conn = _endpoint._StreamConnection(q._address, stream_address(q), _session.current().secret, TIMEOUT)
    try:
        conn.stream.send(b"Z", [b"what"])  # not a request
        conn.stream.send(b"Q", [_node.PUT_NOREPLY])  # no header
        conn.stream.send(b"Q", [_node.PUT_NOREPLY, b"short"])  # bad header
        conn.stream.send(b"Q", [b"?", HEADER.pack(q._box, 999, 0.0)])  # unknown operation
        status, frames = conn.call(_node.GET, 987654, 0, [], TIMEOUT)  # no such box
        assert status == _node.ERROR and b"no such" in bytes(frames[0])
        conn.stream.sock.sendall(struct.pack("<cI", b"Q", 3) + b"\x00" * 5)  # cut short, then gone
    finally:
        conn.close()
    assert_queue_still_serves(q)


# -- the I/O thread and the stream listener go on through errors of their own -----------------------

def test_an_unexpected_error_in_the_io_thread_is_logged_and_the_node_goes_on_serving(caplog):
    node = _node.Node(os.urandom(32))
    conn = None
    try:
        box = node.mailboxes.new_box()
        real_expire, calls = node.loop._expire, []

        def expire_failing_once():
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("injected fault")
            real_expire()

        node.loop._expire = expire_failing_once
        conn = _endpoint._ZmqConnection(node.address, node.secret, TIMEOUT)
        status, _ = conn.call(_node.GET, box, 0.2, [], TIMEOUT)  # its deadline runs into the fault
        assert status == _node.EMPTY and len(calls) >= 2
        assert node.loop.thread.is_alive()
        assert any("injected fault" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)
        conn.send(_node.PUT_NOREPLY, box, 0, [b"after the fault"])
        status, frames = conn.call(_node.GET, box, TIMEOUT, [], TIMEOUT)
        assert status == _node.OK and bytes(frames[0]) == b"after the fault"
    finally:
        if conn is not None:
            conn.close()
        node.close()


def test_a_stream_that_cannot_be_served_is_dropped_and_the_others_are_served(monkeypatch, caplog):
    node = _node.Node(os.urandom(32))
    good = bad = None
    try:
        box = node.mailboxes.new_box()
        listener = node.streams().address
        good = _endpoint._StreamConnection(node.address, listener, node.secret, TIMEOUT)
        assert good.ping(TIMEOUT)
        served_before = set(node.hub.peers)
        bad = _endpoint._StreamConnection(node.address, listener, node.secret, TIMEOUT)
        assert bad.ping(TIMEOUT)
        (bad_fd,) = set(node.hub.peers) - served_before  # the stream the node took on for ``bad``
        real_pump = _served.ServedStream.pump

        def pump(self):
            if self.fd == bad_fd:
                raise RuntimeError("injected fault")
            return real_pump(self)

        monkeypatch.setattr(_served.ServedStream, "pump", pump)
        with pytest.raises(_endpoint.TransportError):
            bad.call(_node.SIZE, box, 0, [], TIMEOUT)  # the node drops it: this side sees the end
        assert bad_fd not in node.hub.peers and node.loop.thread.is_alive()
        assert any("could not be served" in r.getMessage() for r in caplog.records)
        status, frames = good.call(_node.SIZE, box, 0, [], TIMEOUT)
        assert status == _node.OK and struct.unpack("<QQ", frames[0]) == (0, 0)
    finally:
        for conn in (good, bad):
            if conn is not None:
                conn.close()
        node.close()


def test_the_stream_listener_drops_a_connection_it_has_no_thread_for_and_goes_on(monkeypatch, caplog):
    node = _node.Node(os.urandom(32))
    conn = None
    try:
        listener = node.streams()
        real_thread, refused = threading.Thread, []

        class NoAdmitThread(real_thread):
            def start(self):
                if self.name == "roving-stream-admit" and not refused:
                    refused.append(self)
                    raise RuntimeError("can't start new thread")
                super().start()

        monkeypatch.setattr(threading, "Thread", NoAdmitThread)
        with pytest.raises((_stream.StreamError, OSError)):
            _stream.connect(listener.address, node.secret, {"purpose": "node"}, 5)
        monkeypatch.setattr(threading, "Thread", real_thread)
        assert refused and listener._thread.is_alive()
        assert any("refused a connection" in r.getMessage() for r in caplog.records)
        conn = _endpoint._StreamConnection(node.address, listener.address, node.secret, TIMEOUT)
        assert conn.ping(TIMEOUT)
    finally:
        if conn is not None:
            conn.close()
        node.close()


def test_a_stream_listener_that_does_not_take_the_stream_soon_is_left_for_zeromq(monkeypatch):
    """A connection does not wait the whole connect timeout on a listener that never answers."""
    node = _node.Node(os.urandom(32))
    silent = socket.socket()
    try:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes connections; nobody ever accepts them
        monkeypatch.setattr(_endpoint, "STREAM_OPEN_TIMEOUT", 1.0)
        endpoint = _endpoint.Endpoint(node.address, node.secret, None, TIMEOUT)
        endpoint._streams = "127.0.0.1:%d" % silent.getsockname()[1]
        started = time.monotonic()
        assert endpoint.ping(TIMEOUT)
        assert time.monotonic() - started < TIMEOUT / 3  # 1 s for the stream, then ZeroMQ
        assert isinstance(endpoint._threads.conn, _endpoint._ZmqConnection)
        assert endpoint._streams == ""  # later connections go straight to ZeroMQ
    finally:
        silent.close()
        node.close()


def test_no_wake_up_of_the_io_thread_is_lost_when_many_threads_wake_it_at_once():
    """Threads hand the I/O thread work (answers, streams to serve) and wake it through a pipe. Before
    the fix a wake-up written while the I/O thread was between clearing its flag and draining the pipe
    was lost for good: every later one was skipped, and work waited for unrelated traffic (the test
    process's node stopped serving its children's new streams, failing a CI run from mid-suite on)."""
    node = _node.Node(os.urandom(32))
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: the old race showed within a round
    try:
        for _ in range(40):
            stop = time.monotonic() + 0.05

            def wake_until_stop():
                while time.monotonic() < stop:
                    node.loop.wake()

            threads = [threading.Thread(target=wake_until_stop) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            served = threading.Event()
            node.loop.defer(served.set)  # work for the I/O thread, handed over with one more wake-up
            assert served.wait(TIMEOUT / 3), "the I/O thread never woke for the work it was handed"
    finally:
        sys.setswitchinterval(interval)
        node.close()
