"""Network emulation for pipeline experiments: each message a node sends is held back as if it had
crossed the link the network description gives between the two nodes.

The model is the simulator's (``simulate.py``), so a measured emulated iteration can be checked
against the prediction: a transfer of ``n`` bytes on a directed link takes its bytes at the link's
bandwidth, shared equally by the transfers on that link that overlap (processor sharing), then the
link's latency; different links do not contend. The emulator sits in the sender's path to the
transport: the real send (a put on the receiving node's queue, over roving's transport) happens when
the emulated transfer would have arrived, so the receiver sees the delay without knowing about it. On a
real deployment the emulator is simply not used.

Why here and not inside ``roving.transport``: the transport moves opaque frames between processes
and knows neither node names nor the network description; every pipeline message already goes through
one send call (``node.Peers.send``), so holding messages back at that point emulates every link
exactly with no change to the core transport.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from typing import Callable

from ..planning.network import Link

log = logging.getLogger(__name__)


class LinkEmulator:
    """Delays calls of ``deliver`` as transfers over per-destination links. Thread-safe; the
    deliveries run on the emulator's own thread, so ``send`` never blocks the caller."""

    def __init__(self, links: dict[str, Link]) -> None:
        self._links = dict(links)
        self._cond = threading.Condition()
        # per destination: transfer id -> [bytes left, deliver]
        self._active: dict[str, dict[int, list]] = {d: {} for d in links}
        self._settled: dict[str, float] = dict.fromkeys(links, time.monotonic())
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._ids = itertools.count()
        self._running = True
        self._pending = 0
        self._thread = threading.Thread(target=self._run, name="roving-link-emulator", daemon=True)
        self._thread.start()

    def has_link(self, dst: str) -> bool:
        return dst in self._links

    def add_link(self, dst: str, link: Link) -> None:
        """Emulate the link to a node that joined after the emulator started."""
        with self._cond:
            self._links[dst] = link
            self._active.setdefault(dst, {})
            self._settled.setdefault(dst, time.monotonic())

    def send(self, dst: str, nbytes: float, deliver: Callable[[], None]) -> None:
        """Start a transfer of ``nbytes`` to ``dst``; ``deliver()`` is called when it would arrive."""
        if dst not in self._links:
            raise KeyError(f"no emulated link to {dst!r}")
        with self._cond:
            now = time.monotonic()
            self._settle(dst, now)
            self._active[dst][next(self._ids)] = [float(nbytes), deliver]
            self._pending += 1
            self._cond.notify()

    def _settle(self, dst: str, now: float) -> None:
        active = self._active[dst]
        if active:
            share = (now - self._settled[dst]) * self._links[dst].bandwidth_bps / len(active)
            for v in active.values():
                v[0] -= share
        self._settled[dst] = now

    def _run(self) -> None:
        while True:
            ready: list[Callable[[], None]] = []
            with self._cond:
                if not self._running:
                    return
                now = time.monotonic()
                wake = None
                for dst, active in self._active.items():
                    if not active:
                        continue
                    self._settle(dst, now)
                    link = self._links[dst]
                    for tid in [t for t, v in active.items() if v[0] <= 1e-6]:
                        heapq.heappush(self._due, (now + link.latency_s, tid, active.pop(tid)[1]))
                    if active:
                        least = min(v[0] for v in active.values())
                        t = now + least * len(active) / link.bandwidth_bps
                        wake = t if wake is None else min(wake, t)
                while self._due and self._due[0][0] <= now:
                    ready.append(heapq.heappop(self._due)[2])
                if self._due:
                    wake = self._due[0][0] if wake is None else min(wake, self._due[0][0])
                if not ready:
                    self._cond.wait(None if wake is None else max(0.0, wake - now))
                    continue
            for deliver in ready:
                try:
                    deliver()
                except Exception:  # a failed send must not stop every other link
                    log.exception("emulated delivery failed")
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def drain(self, timeout: float = 60.0) -> bool:
        """Wait until every transfer started so far has been delivered."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        with self._cond:
            self._running = False
            self._cond.notify_all()
        self._thread.join(timeout=2)
