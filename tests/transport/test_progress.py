"""A long transfer's progress in the log (roving.transport.progress): said only once it has taken
seconds, then at intervals with the share done and the rate, and once at its end; a 200 MiB queue item
from a child shows it on the receiving side."""
from __future__ import annotations

import logging

import numpy as np

import roving
from roving.transport import progress

T = 120
MiB = 2**20


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "roving.transport.progress"]


def test_a_transfer_is_told_only_after_it_took_seconds_then_at_intervals_and_at_its_end(caplog):
    caplog.set_level(logging.INFO, logger="roving.transport.progress")
    clock = Clock()
    told = progress.Progress("receiving a frame from 10.0.0.2:5000", 1000 * MiB, clock)
    clock.now += progress.AFTER_S / 2
    told.advance(100 * MiB)
    assert _lines(caplog) == []  # not yet seconds
    clock.now += progress.AFTER_S
    told.advance(300 * MiB)
    clock.now += progress.EVERY_S / 2
    told.advance(400 * MiB)  # within the interval: not said
    clock.now += progress.EVERY_S
    told.advance(900 * MiB)
    told.finish()
    lines = _lines(caplog)
    assert len(lines) == 3, lines
    assert "receiving a frame from 10.0.0.2:5000 of 1000 MiB: 300 MiB done (30%)" in lines[0]
    assert "900 MiB done (90%)" in lines[1] and "/s" in lines[1]
    assert "done (100%)" in lines[2]


def test_a_transfer_that_ends_quickly_says_nothing(caplog):
    caplog.set_level(logging.INFO, logger="roving.transport.progress")
    clock = Clock()
    told = progress.Progress("sending a message to a peer", 100 * MiB, clock)
    told.advance(100 * MiB)
    told.finish()
    assert _lines(caplog) == []


def put_array(q, nbytes):
    q.put(np.ones(nbytes, dtype=np.uint8))


def test_a_large_queue_item_from_a_child_is_told_as_it_arrives(caplog, monkeypatch):
    monkeypatch.setattr(progress, "AFTER_S", 0.0)  # every step told: this machine may move it in a second
    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    caplog.set_level(logging.INFO, logger="roving.transport.progress")
    q = roving.Queue()
    p = roving.Process(target=put_array, args=(q, 200 * MiB))
    p.start()
    got = q.get(timeout=T)
    p.join(T)
    assert got.nbytes == 200 * MiB and int(got[::4096].sum()) == 200 * MiB // 4096
    lines = [line for line in _lines(caplog) if line.startswith("roving: receiving a frame from")]
    assert len(lines) >= 2, lines
    shares = [int(line.split("(")[1].split("%")[0]) for line in lines]
    assert shares == sorted(shares) and shares[-1] == 100 and " of 200 MiB: " in lines[0]


def test_the_peer_of_a_plain_and_of_a_tls_streams_socket_is_named():
    import socket

    from roving.transport import tls

    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    try:
        where = f"127.0.0.1:{server.getsockname()[1]}"
        assert progress.peer_of(client) == where
        wrapped = tls.TlsSocket.__new__(tls.TlsSocket)  # a TLS stream's socket as the stream holds it
        wrapped.ssock = client
        assert progress.peer_of(wrapped) == where
        assert progress.peer_of(object()) == "a peer"
    finally:
        for s in (client, conn, server):
            s.close()
