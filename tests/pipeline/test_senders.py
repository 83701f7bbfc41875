"""Senders: forgetting a dead peer gives up what was sent to it, through the queue's public API."""

from __future__ import annotations

import queue

from roving.pipeline.senders import Senders


class _RecordingQueue(queue.Queue):
    def __init__(self) -> None:
        super().__init__()
        self.abandoned = 0

    def abandon(self) -> None:
        self.abandoned += 1


def test_forgetting_a_peer_abandons_its_queue_and_stops_sending_to_it():
    dead, live = _RecordingQueue(), _RecordingQueue()
    senders = Senders("me", {"dead": dead, "live": live}, None)
    try:
        senders.forget(["dead"])
        assert dead.abandoned == 1 and live.abandoned == 0
        senders.put("dead", "lost")  # nothing is sent to a forgotten peer
        senders.put("live", "kept")
        assert live.get(timeout=10) == "kept"
        assert dead.empty()
    finally:
        senders.close()


def test_forgetting_a_peer_whose_queue_cannot_be_abandoned_is_fine():
    plain = queue.Queue()  # the plain queues stage tests use have nothing to give up
    senders = Senders("me", {"peer": plain}, None)
    try:
        senders.forget(["peer", "never-known"])
        senders.put("peer", "lost")
        assert plain.empty()
    finally:
        senders.close()
