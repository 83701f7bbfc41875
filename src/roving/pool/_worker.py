"""The loop a pool worker runs: ask for work, run each item, send each item's result back.

A worker asks for the next unit of work while it runs the current one only once its units have proved
short (under ``SHORT_S``), and keeps several in hand only when they are very short (under ``TINY_S``), so
a long task never waits behind another at a busy worker. Results are sent as items finish, gathered for
at most ``FLUSH_S`` seconds so that short tasks share messages; a worker that dies loses only the items
whose results had not left.
"""
from __future__ import annotations

import collections
import logging
import os
import sys
import threading
import time
from multiprocessing.pool import ExceptionWithTraceback  # type: ignore[attr-defined]  # (not in typeshed's stub)
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

from .. import config as _config
from ..backends.memory import describe, sample
from ..transport import session as _session
from ._ending import Ending, lifetime_for, signals_named
from ..transport.channel import Channel
from ..transport.errors import ConnectionLost, NodeError
from ..transport.serialize import SerializationError
from . import _protocol as P
from . import _results
from ._memory import MemoryWatch

log = logging.getLogger(__name__)

FLUSH_S = 0.005
MAX_BATCH = 1024
SHORT_S = 0.05  # a unit that ran this fast makes the worker ask for the next one in advance
TINY_S = 0.002  # ... and this fast, for several
DEEP = 64
MAX_BLOCK = 1024  # items run between two looks at the clock, at most
BLOCK_S = 0.001  # a block that ran faster than this doubles; slower, halves


class _Results:
    """Results not yet sent, as runs of consecutive items of one chunk with the same outcome
    (:class:`roving.pool._protocol.RunWriter`)."""

    def __init__(self, chan: Channel, pool_id: int) -> None:
        self.chan, self.pool_id = chan, pool_id
        self.runs = P.RunWriter()
        self.values: List[Any] = []
        self.sent = time.monotonic()

    def _due(self) -> bool:
        """Time to send: ``FLUSH_S`` since the last send (so the result of a long task leaves at once,
        those of short ones together), or ``MAX_BATCH`` results kept."""
        return len(self.values) >= MAX_BATCH or time.monotonic() - self.sent >= FLUSH_S

    def add(self, cid: int, off: int, ok: bool, value: Any) -> bool:
        """Keep one result; True when it is time to send (see :meth:`_due`)."""
        self.runs.add(cid, off, 1, ok)
        self.values.append(value)
        return self._due()

    def add_run(self, cid: int, offs: Any, i: int, ok: bool, values: List[Any]) -> bool:
        """Keep the results of items ``offs[i:i + len(values)]``; as :meth:`add`."""
        if isinstance(offs, range):
            self.runs.add(cid, offs[i], len(values), ok)
        else:
            add = self.runs.add
            for k in range(len(values)):
                add(cid, offs[i + k], 1, ok)
        self.values.extend(values)
        return self._due()

    def flush(self, ask: int = 0, key: int = 0) -> None:
        """Send what is kept (asking for ``ask`` more units of ``key`` at once); nothing if empty."""
        if not self.values:
            return
        try:
            frames = P.list_frames(self.values)
        except SerializationError:
            frames = P.list_frames(self._picklable())
        self.chan.send(self.runs.results(self.pool_id, ask, key, frames))
        self.runs, self.values = P.RunWriter(), []
        self.sent = time.monotonic()

    def _picklable(self) -> List[Any]:
        """Replace each value that cannot be pickled by the error saying so (that item fails)."""
        out: List[Any] = []
        runs = P.RunWriter()
        values = iter(self.values)
        for run in self.runs.runs():
            for off in range(run.first, run.first + run.length):
                value, good = next(values), run.ok
                try:
                    P.list_frames([value])
                except SerializationError as exc:
                    value, good = _results.unencodable(exc.__cause__ or exc, value), False
                out.append(value)
                runs.add(run.chunk, off, 1, good)
        self.runs = runs
        return out


def serve(address: str, pool_id: int, worker_id: int, initializer: Optional[Callable[..., Any]],
          initargs: Tuple[Any, ...], maxtasks: Optional[int], connect_timeout: float,
          memory_limit: Optional[int] = None, beat_s: Optional[float] = None) -> None:
    """Target of every pool worker process. ``memory_limit``: it leaves after a task that left it larger
    (:class:`roving.pool._memory.MemoryWatch`); ``beat_s``: seconds between its heartbeats (default:
    ``heartbeat_interval``)."""
    if initializer is not None:
        initializer(*initargs)
    secret = _session.current().secret
    cfg = _config.current()

    def connect() -> Channel:
        return Channel(address, secret, connect_timeout, stream=True)

    stop = threading.Event()
    # told it will end (a time limit, a preemption, its lifetime): it leaves well (see roving.pool._ending)
    ending = Ending(cfg.worker_grace, signals_named(cfg.end_signals), lifetime_for(cfg), cfg.preemption_file,
                    preemption_url=cfg.preemption_url)
    wake = threading.Event()
    ending.on_set(lambda _: wake.set())
    interval = beat_s or cfg.heartbeat_interval
    beating = threading.Thread(target=_heartbeat, args=(connect, pool_id, worker_id, stop, ending, wake, interval),
                               name="roving-pool-heartbeat", daemon=True)
    loop = _Loop(connect(), pool_id, maxtasks, connect, ending, MemoryWatch(memory_limit), interval)
    beating.start()
    try:
        loop.run(worker_id)
    except NodeError as exc:  # the parent cannot be reached again: its work is run elsewhere
        sys.stderr.write(f"roving pool worker {worker_id} exits: {exc}\n")
        raise SystemExit(1) from None
    finally:
        loop.chan.close()
        stop.set()  # its channel closes too: the parent's node forgets both connections
        wake.set()
        beating.join(2.0)
        ending.close()


def _heartbeat(connect: Callable[[], Channel], pool_id: int, worker_id: int, stop: threading.Event,
               ending: Ending, wake: threading.Event, interval: float) -> None:
    """Tell the parent this worker lives, also while a long task runs (its own connection). Nothing is
    sent back on it but the node's word that it no longer knows the connection (after a network drop):
    then a new one is opened, so that a drop of this connection alone does not get the worker killed.

    Once the worker is told it will end, the parent hears it here at once (ENDING), whatever the worker's
    main thread runs; and at the deadline, if the worker is still running an item, it leaves anyway: its
    item is run again elsewhere, not counted as a retry."""
    told = False
    try:
        chan = connect()
    except (OSError, ConnectionError) as exc:
        log.warning("roving pool worker %d: cannot connect its heartbeats (%s)", worker_id, exc)
        return
    while not stop.is_set():
        try:
            chan.recv(0)
        except ConnectionLost:
            chan.close(0)
            try:
                chan = connect()
            except (OSError, ConnectionError) as exc:
                log.warning("roving pool worker %d: cannot reconnect its heartbeats (%s)", worker_id, exc)
                return
        try:
            if ending.event.is_set() and not told:
                chan.send(P.ending(pool_id, worker_id, max(0, int(ending.left())), ending.reason))
                told = True
                # not printed: the parent says it, once per pool, when the end is not the pool's own
                log.info("roving pool worker %d: will end within %.0f s (%s): it takes no more work",
                         worker_id, ending.left(), ending.reason)
            chan.send(P.heartbeat(pool_id, worker_id, sample()))
        except ConnectionLost:  # the stream ended: the next recv finds that and connects again
            pass
        if told and ending.left() <= 0:
            log.info("roving pool worker %d: its %g s of grace are over (%s); it leaves now: what it runs is "
                     "run again elsewhere", worker_id, ending.grace, ending.reason)
            chan.close(1.0)
            os._exit(0)
        wake.wait(min(interval, max(0.0, ending.left())) if told else interval)
        wake.clear()
    chan.close(1.0)


class _Loop:
    """The worker's side of the pool protocol over ``chan``. When the parent's node says it no longer
    knows the connection (ConnectionLost: a network drop, both processes alive), the loop opens a new
    one with ``reconnect()`` and says HELLO again: the parent then puts the units it had given this
    worker back in line (results that were lost with the old connection are computed again, by whoever
    gets them; results that arrive twice count once), and the worker drops them too."""

    def __init__(self, chan: Channel, pool_id: int, maxtasks: Optional[int],
                 reconnect: Callable[[], Channel], ending: Optional[Ending] = None,
                 memory: Optional[MemoryWatch] = None, idle_word_s: float = 1.0) -> None:
        self.chan, self.pool_id, self.maxtasks, self.reconnect = chan, pool_id, maxtasks, reconnect
        self.idle_word_s = idle_word_s  # seconds between its words on the work connection while idle
        self.ending = ending
        self.memory = memory or MemoryWatch(None)
        self.units: Deque[P.Unit] = collections.deque()
        self.funcs: Dict[int, Any] = {}  # function id -> (function, mode), or why it could not be loaded
        self.asked = 0
        self.done = 0
        self.leaving = False  # sent BYE
        self.acked = False
        self.depth = 1  # units to hold (running, waiting here, asked for), learnt per key of work
        self.key = 0
        self.results = _Results(chan, pool_id)

    def _send(self, kind: int, arg: int, key: int = 0) -> None:
        self.chan.send(P.to_parent(self.pool_id, kind, arg, key))

    def _want(self) -> int:
        """How many more units to ask for now (asks come in batches, when half the depth is used)."""
        if self.leaving:
            return 0
        held = len(self.units) + self.asked
        if held > self.depth // 2:
            return 0
        want = self.depth - held
        if self.maxtasks is not None:
            want = min(want, self.maxtasks - self.done - held)
        return max(0, want)

    def _ask(self) -> None:
        """Top up: with the results (flushing them) when there are any, else alone."""
        want = self._want()
        if want <= 0:
            return
        self.asked += want
        key = self.key if self.depth > 1 else 0
        if self.results.values:
            self.results.flush(want, key)
        else:
            self._send(P.READY, want, key)

    def _leave(self, why: int = 0, size: int = 0) -> None:
        if not self.leaving:
            self.leaving = True
            # Results first: the channel keeps order, so the parent's ACK then means it has them all,
            # and the worker's exit cannot be taken for a loss of work it already finished.
            self.results.flush()
            self._send(P.BYE, why, size)

    def _take(self, frames: List[Any]) -> None:
        head = P.read_control(frames)
        kind = head.kind
        if kind == P.ACK:
            self.acked = True
            return
        if kind == P.STOP:
            self._leave()
            return
        if kind == P.REVOKE:
            for unit in self.units:
                if unit.chunk == head.chunk:
                    self.units.remove(unit)
                    self._send(P.RETURNED, head.chunk)
                    break
            return
        for unit in P.read_units(frames, head):  # TASKS
            self.asked = max(0, self.asked - 1)
            for gone in unit.forget:
                self.funcs.pop(gone, None)
            if self.leaving and self.ending is not None and self.ending.event.is_set():
                self._send(P.RETURNED, unit.chunk)  # sent before the parent heard it ends: back at once
                continue
            self.units.append(unit)

    def run(self, worker_id: int) -> None:
        self._send(P.HELLO, worker_id)
        self._ask()
        while True:
            try:
                if self._turn(worker_id):
                    return
            except ConnectionLost as exc:
                log.warning("roving pool worker %d: %s; reconnecting", worker_id, exc)
                self._reconnected(worker_id)

    def _reconnected(self, worker_id: int) -> None:
        """A new connection, HELLO again, and start afresh: the parent has put this worker's units back
        in line. Results not yet sent go after the HELLO (the parent keeps whichever arrives first)."""
        self.chan.close(0)
        self.chan = self.results.chan = self.reconnect()
        self.units.clear()
        self.asked, self.depth = 0, 1
        self._send(P.HELLO, worker_id)
        if self.leaving:
            self.results.flush()
            self._send(P.BYE, 0)
        else:
            self._ask()

    def _end_well(self) -> None:
        """Told it will end: the units not started go back (RETURNED, unasked), then results and BYE."""
        while self.units:
            self._send(P.RETURNED, self.units.popleft().chunk)
        self.asked = 0
        self._leave()

    def _turn(self, worker_id: int) -> bool:
        """Run the next unit, or wait a moment for work; True once the worker may leave."""
        chan = self.chan
        self._poll()
        if self.ending is not None and self.ending.event.is_set() and not self.leaving:
            self._end_well()
        if not self.units:
            self.results.flush()
            if self.leaving and self.acked:
                return True
            frames = chan.recv(self.idle_word_s)
            if frames is not None:
                self._take(frames)
            else:
                # Idle: a word on this connection, so that one re-made under it (a network drop) is
                # found now rather than when work comes (the parent takes it as a heartbeat).
                self._send(P.HEARTBEAT, worker_id)
            return False
        unit = self.units.popleft()
        if unit.key != self.key:
            self.key, self.depth = unit.key, 1
        if self.depth > 1:
            self._ask()  # the next units arrive while this one runs
        started = time.monotonic()
        due = self._run_unit(unit)
        took = time.monotonic() - started
        self.depth = DEEP if took < TINY_S else 2 if took < SHORT_S else 1
        self.done += 1
        if self.maxtasks is not None and self.done >= self.maxtasks:
            self._leave()
        elif self.memory.limit is not None and not self.leaving:
            size = self.memory.over()
            if size is not None:
                log.info("roving pool worker %d: its resident set %s is above worker_memory_limit %s after a "
                         "task: it takes no more work and is replaced", worker_id, describe(size),
                         describe(self.memory.limit))
                self._leave(P.BYE_MEMORY_LIMIT, size)
        if not self.units and self.asked == 0:
            self._ask()  # the results due go with the ask: one message to the parent, not two
        if due and self.results.values:
            self._flush()
        return False

    def _poll(self) -> None:
        """Take whatever has arrived, without waiting."""
        while True:
            frames = self.chan.recv(0)
            if frames is None:
                return
            self._take(frames)

    def _flush(self) -> None:
        """Send the results kept; meanwhile answer messages (a REVOKE must not wait for this unit)."""
        self.results.flush()
        self._poll()

    def _function(self, fid: int, func_frames: Sequence[Any]) -> Tuple[Callable[..., Any], int]:
        """The unit's function: unpickled from its frames (and kept under ``fid`` unless 0), or the one
        kept. A function that could not be unpickled fails every unit that names it, not just the first."""
        if not func_frames:
            got = self.funcs[fid]
            if isinstance(got, BaseException):
                raise got
            return got
        try:
            got = P.read_function(func_frames)
        except BaseException as exc:
            if fid:
                self.funcs[fid] = exc
            raise
        if fid:
            self.funcs[fid] = got
        return got

    def _run_unit(self, unit: P.Unit) -> bool:
        """Run the unit's items, sending results as they fall due except the last ones: True when those
        are due (the caller sends them, with its ask for more work if it makes one)."""
        results = self.results
        cid, offsets = unit.chunk, unit.offsets
        try:
            func, mode = self._function(unit.func, unit.func_frames)
            items = P.read_list(unit.arg_frames)
        except BaseException as exc:  # the function or arguments could not be loaded here
            err = _results.unloaded(exc)
            for off in offsets:
                if results.add(cid, off, False, err):
                    self._flush()
            return False
        # Items run in blocks, without a call per item into the bookkeeping: a block grows (doubling) while
        # its items prove short and shrinks to one for long ones, so that the result of a long task still
        # leaves as soon as it is done (see _Results.add) and those of tiny ones cost almost nothing.
        offs = offsets if isinstance(offsets, range) else list(offsets)
        i, n, block = 0, len(offs), 1
        while i < n:
            end = min(n, i + block)
            values: List[Any] = []
            started = time.monotonic()
            failed: Optional[BaseException] = None
            try:
                if mode == P.MAP:
                    for off in offs[i:end]:
                        values.append(func(items[off]))
                elif mode == P.STAR:
                    for off in offs[i:end]:
                        values.append(func(*items[off]))
                else:
                    for off in offs[i:end]:
                        args, kwds = items[off]
                        values.append(func(*args, **kwds))
            except Exception as exc:
                failed = exc
            took = time.monotonic() - started
            due = results.add_run(cid, offs, i, True, values) if values else False
            i += len(values)
            if failed is not None:
                due = results.add(cid, offs[i], False, ExceptionWithTraceback(failed, failed.__traceback__))
                i += 1
            if self.ending is not None and self.ending.event.is_set() and i < n:
                return True  # the rest of the unit is left to others (the parent has it): results now
            if due and i < n:
                self._flush()
            elif due:
                return True
            block = min(MAX_BLOCK, block * 2) if took < BLOCK_S else max(1, block // 2)
        return False
