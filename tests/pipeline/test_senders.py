"""Senders: forgetting a dead peer gives up what was sent to it, through the queue's public API, and
frees a sender thread blocked on it; waiting for delivery returns at once for a peer whose connection
broke."""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time

import helpers_targets as h
import roving
from helpers_core import TIMEOUT, wait_until
from roving.pipeline.runtime.senders import Senders


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


class _BrokenQueue(queue.Queue):
    """A peer's queue whose connection broke: asking it anything raises, as a roving queue does."""

    def qsize(self) -> int:
        raise ConnectionError("the connection to the peer broke")


def test_waiting_for_delivery_names_a_peer_whose_connection_broke_at_once_not_at_the_timeout():
    """A node killed while the coordinator confirmed its peers' delivery held the coordinator for the
    whole wait (its ping raised and never answered): the run showed nothing for minutes."""
    senders = Senders("me", {"dead": _BrokenQueue(), "live": queue.Queue()}, None)
    try:
        t0 = time.monotonic()
        late = senders.delivered(["dead", "live"], timeout=60)
        assert late == ["dead"]
        assert time.monotonic() - t0 < 30, "the wait went on to its timeout for a peer already known broken"
    finally:
        senders.close()


def _writing_a_stream(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside a stream's send (roving.transport.stream.Stream.send)."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "send" and frame.f_code.co_filename.endswith("stream.py"):
            return True
        frame = frame.f_back
    return False


def test_forgetting_a_peer_that_stopped_reading_frees_the_sender_thread_blocked_writing_to_it():
    """A peer that stops reading (its host cut off; SIGSTOP here) leaves its sender thread blocked in a
    write once the kernel's buffers are full. Forgetting the peer wakes that thread, so that none is
    left inside the transport when the process exits (one was, in a CI run whose coordinator then
    aborted at exit after training around a cut-off host)."""
    back, release = roving.Queue(), roving.Event()
    p = roving.Process(target=h.home_a_queue_until, args=(back, release))
    p.start()
    senders = None
    try:
        peer = back.get(timeout=TIMEOUT)
        senders = Senders("me", {"peer": peer}, None)
        senders.put("peer", "hello")  # the sender thread's own connection, made while the peer reads
        assert back.get(timeout=TIMEOUT) == ("got", "hello")
        os.kill(p.pid, signal.SIGSTOP)
        thread = senders.senders["peer"].thread
        senders.put("peer", b"x" * (64 << 20))  # more than the kernel's buffers hold: the write blocks
        assert wait_until(lambda: _writing_a_stream(thread), TIMEOUT), "the sender never wrote to the stream"
        senders.forget(["peer"])
        thread.join(TIMEOUT)
        assert not thread.is_alive(), "the sender thread is still blocked writing to a forgotten peer"
    finally:
        os.kill(p.pid, signal.SIGCONT)
        release.set()
        p.join(TIMEOUT)
        if senders is not None:
            senders.close()
