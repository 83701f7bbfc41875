"""A node's I/O loop (:class:`Loop`): the one thread that serves the node's sockets and streams.

The loop owns the thread, the poller every socket and stream of the node is watched by, the pipe other
threads wake it through, the calls deferred to it, and the timers it keeps. What a turn does with what
is ready is its owner's (:class:`roving.transport.node.Node`): :meth:`Loop.start` is handed the turn.

Guarantees:

* :meth:`Loop.wake` from any thread makes the thread go round its loop once more; no wake-up is lost,
  and while one is on its way further calls cost no system call.
* :meth:`Loop.defer` runs a function on the thread, outside every lock, after the turn's own work, in
  the order deferred; :meth:`Loop.later` is the same from the thread itself, without a wake-up.
* :meth:`Loop.at` runs a function on the thread once its time (``time.monotonic()``) has come; the poll
  never waits past the earliest one.
* Nothing that goes wrong in one turn stops the thread: every other process of the session depends on
  it, and a node that stops answering looks to them like a hang. An error is logged with its traceback
  and the loop goes on (after a pause, should the same error repeat at once).
"""
from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union

import zmq

log = logging.getLogger(__name__)

__all__ = ["Loop", "Ready", "Watched"]

#: What the poller watches: a ZeroMQ socket or a file descriptor.
Watched = Union[zmq.Socket, int]
#: What a turn is handed: each watched thing that is ready, with its events.
Ready = Dict[Watched, int]


class Loop:
    """The I/O thread of a node, its poller, its wake-up pipe, its deferred calls and its timers."""

    def __init__(self, name: str = "roving-node") -> None:
        #: Names the loop in the log (its owner sets it once it has an address).
        self.label = name
        self.poller = zmq.Poller()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._wake_pending = False
        self.poller.register(self._wake_r, zmq.POLLIN)
        self._deferred: List[Callable[[], None]] = []
        self._timers: List[Tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._turn: Callable[[Ready], None] = lambda ready: None
        self._hurry: Callable[[], bool] = lambda: False
        #: False once :meth:`stop` was called: the thread leaves at the end of its turn.
        self.running = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def watch(self, what: Watched) -> None:
        """Poll ``what`` (a ZeroMQ socket or a file descriptor) for input from now on."""
        self.poller.register(what, zmq.POLLIN)

    def start(self, turn: Callable[[Ready], None], hurry: Callable[[], bool]) -> None:
        """Start the thread: each turn waits for something watched to be ready (not past the next
        timer; not at all while ``hurry()``), then calls ``turn(ready)``, runs the timers whose time
        has come, then the deferred calls."""
        self._turn, self._hurry = turn, hurry
        self.running = True
        self.thread.start()

    def on_thread(self) -> bool:
        """Whether the caller is the loop's thread."""
        return threading.get_ident() == self.thread.ident

    def wake(self) -> None:
        """Make the thread go round its loop (any thread). A writer sets the flag before it writes and
        the thread clears it only after reading the pipe, so a set flag always has a byte on its way and
        no wake-up is lost; while the flag is set, further calls write nothing."""
        if not self._wake_pending:
            self._wake_pending = True
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:  # the pipe is full of wake-ups already
                pass

    def defer(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the thread, outside every lock (any thread)."""
        self._deferred.append(fn)
        self.wake()

    def later(self, fns: Iterable[Callable[[], None]]) -> None:
        """Run ``fns`` on the thread at the end of this turn (the thread only: no wake-up)."""
        self._deferred.extend(fns)

    def at(self, when: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the thread once ``time.monotonic()`` reaches ``when`` (the thread only)."""
        heapq.heappush(self._timers, (when, next(self._seq), fn))

    def stop(self) -> None:
        """Let the thread leave at the end of its turn (any thread); :meth:`join` waits for it."""
        self.running = False
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # full, or closed by an earlier stop
            pass

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the thread to end; whether it has."""
        if self.thread.ident is not None:
            self.thread.join(timeout)
        return not self.thread.is_alive()

    def close(self) -> None:
        """Let go of the wake-up pipe (after :meth:`join` returned True)."""
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        failures = 0
        while self.running:
            try:
                self._once()
                failures = 0
            except Exception:
                if not self.running:
                    return
                failures += 1
                log.exception("%s: an error in the I/O thread (serving goes on)", self.label)
                time.sleep(min(1.0, 0.001 * 2 ** min(failures, 10)))

    def _once(self) -> None:
        timeout_ms: Optional[int] = None
        if self._timers:  # (int() as pyzmq makes a float timeout)
            timeout_ms = int(max(0.0, (self._timers[0][0] - time.monotonic()) * 1000))
        if self._hurry():
            timeout_ms = 0
        try:
            ready = dict(self.poller.poll(timeout_ms))
        except zmq.ZMQError:
            if not self.running:
                return
            raise
        if self._wake_r in ready:
            # Read first, then clear the flag: cleared first, a wake-up written in between would be
            # read while the flag stayed set, and every later wake() would then skip its write.
            try:
                os.read(self._wake_r, 4096)  # a byte written after this read stays for the next poll
            except BlockingIOError:
                pass
            self._wake_pending = False
        self._turn(ready)
        if self._timers:
            self._expire()
        if self._deferred:
            self._run_deferred()

    def _expire(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            heapq.heappop(self._timers)[2]()

    def _run_deferred(self) -> None:
        while self._deferred:
            try:
                self._deferred.pop(0)()
            except Exception:
                log.exception("%s: a deferred call failed (taking back an undeliverable message?)", self.label)
