"""Sending to other processes' inboxes: one sender thread per destination, so that a peer that died
while a message to it was in flight holds up only its own thread, never the sender's loop or its sends
to live peers. With an emulated network, sends wait for their link (``emulate.LinkEmulator``)."""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable

import torch

from ...transport.postbox import PostboxAddress
from .mail import Outbox
from ..planning.network import Link

log = logging.getLogger(__name__)


class _Sender:
    """One destination's outgoing messages, sent in order from a thread of their own."""

    def __init__(self, dst: str, q: Any) -> None:
        self.dst, self.q = dst, q
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self.thread = threading.Thread(target=self._run, name=f"roving-send-{dst}", daemon=True)
        self.thread.start()

    def push(self, fn: Callable[[Any], None]) -> None:
        with self._cond:
            if not self._closed:
                self._items.append(fn)
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                if not self._items:
                    return
                fn = self._items.popleft()
            try:
                fn(self.q)
            except Exception:  # a dead peer: the coordinator finds out by its heartbeats
                if self._closed:  # forgotten as dead (Senders.forget), or closing: expected
                    log.debug("send to %s given up", self.dst, exc_info=True)
                    return
                log.warning("send to %s failed", self.dst, exc_info=True)

    def confirm(self, timeout: float) -> bool:
        """True when everything pushed so far has reached the destination (a round trip from this
        sender's own connection, after the messages before it), within ``timeout`` seconds."""
        done = threading.Event()

        def ping(q: Any) -> None:
            q.qsize()
            done.set()

        self.push(ping)
        return done.wait(timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._items.clear()
            self._cond.notify()


class Senders:
    """Sends to other processes' inboxes (by name), each through its own sender thread: directly, or
    held back by the link emulator. Used by stage processes and by the coordinator."""

    def __init__(self, me: str, inboxes: dict[str, Any], emulate: dict[str, Link] | None) -> None:
        self.me = me
        self.senders: dict[str, _Sender] = {}
        self.emulator = None
        if emulate:
            from .emulate import LinkEmulator

            self.emulator = LinkEmulator(emulate)
        for name, q in inboxes.items():
            self.add(name, q)

    def add(self, name: str, q: Any, link: Link | None = None) -> None:
        """Send to ``name`` through ``q``: an inbox's ``PostboxAddress`` (or anything with ``put``, as
        a test's plain queue), held back by ``link`` when the network is emulated."""
        if name == self.me:
            return
        if self.emulator is not None and link is not None:
            self.emulator.add_link(name, link)
        old = self.senders.pop(name, None)
        if old is not None:
            old.close()
        self.senders[name] = _Sender(name, Outbox(q) if isinstance(q, PostboxAddress) else q)

    def forget(self, names: list[str]) -> None:
        """Stop sending to ``names`` (declared dead); exit will not wait for them to answer (a roving
        ``Queue`` is abandoned, ``Queue.abandon``; a plain queue of a test has nothing to give up)."""
        for name in names:
            sender = self.senders.pop(name, None)
            if sender is not None:
                sender.close()
                abandon = getattr(sender.q, "abandon", None)
                if abandon is not None:
                    abandon()

    def put(self, dst: str, msg: Any) -> None:
        """Send ``msg`` to ``dst`` at once (no emulated link); nothing when ``dst`` was forgotten."""
        sender = self.senders.get(dst)
        if sender is not None:
            sender.push(lambda q: q.put(msg))

    def send(self, dst: str, msg: Any, payload: torch.Tensor, finish: Callable[[Any], Any] | None = None) -> None:
        """Send ``msg``, which carries ``payload``, to ``dst`` (held back by its emulated link, if any);
        ``finish``: made into what is sent by ``dst``'s sender thread, just before it goes out (a receipt
        put on it: ``evidence.Evidence.sealer``). Nothing when ``dst`` was forgotten."""
        sender = self.senders.get(dst)
        if sender is None:  # a peer declared dead: the round is being aborted
            return

        def put(q: Any) -> None:
            q.put(msg if finish is None else finish(msg))

        if self.emulator is None or not self.emulator.has_link(dst):
            sender.push(put)
        else:
            self.emulator.send(dst, payload.numel() * payload.element_size(), lambda: sender.push(put))

    def delivered(self, names: list[str], timeout: float = 20.0) -> list[str]:
        """Wait (``timeout`` seconds in all) until everything sent so far to ``names`` has arrived; the
        names whose sends were not confirmed (a dead or cut-off process, found at once where its
        connection broke, else at ``timeout``: its heartbeats tell the rest). The senders go on."""
        def ping(done: threading.Event, broke: list[str], name: str) -> Callable[[Any], None]:
            def reached(q: Any) -> None:
                try:
                    q.qsize()
                except Exception:
                    broke.append(name)
                    raise
                finally:
                    done.set()
            return reached

        waiting: dict[str, threading.Event] = {}
        broke: list[str] = []
        for name in names:
            sender = self.senders.get(name)
            if sender is not None:
                waiting[name] = threading.Event()
                sender.push(ping(waiting[name], broke, name))
        deadline = time.monotonic() + timeout
        late = [name for name, done in waiting.items() if not done.wait(max(0.0, deadline - time.monotonic()))]
        return late + [name for name in waiting if name in broke and name not in late]

    def confirm(self, live: list[str], timeout: float = 20.0) -> None:
        """Make sure everything sent to the live peers has arrived (the transport confirms per
        connection, and each sender thread has its own)."""
        if self.emulator is not None:
            self.emulator.drain(timeout)
            self.emulator.close()
        for name in live:
            sender = self.senders.get(name)
            if sender is not None and not sender.confirm(timeout):
                log.warning("%s: sends to %s not confirmed within %g s", self.me, name, timeout)
        self.close()

    def close(self, timeout: float = 2.0) -> None:
        """Stop the sender threads and wait for them (bounded: one stuck on a dead peer is left),
        so that none is inside the transport when the process exits."""
        senders, self.senders = list(self.senders.values()), {}
        for sender in senders:
            sender.close()
        deadline = time.monotonic() + timeout
        for sender in senders:
            sender.thread.join(max(0.0, deadline - time.monotonic()))
