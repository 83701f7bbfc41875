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
import sys
import threading
import time
from array import array
from multiprocessing.pool import ExceptionWithTraceback
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from .. import config as _config
from ..transport import session as _session
from ..transport.channel import Channel, ConnectionLost, TransportError
from ..transport.serialize import SerializationError, dumps, loads
from . import _protocol as P
from . import _results

log = logging.getLogger(__name__)

FLUSH_S = 0.005
MAX_BATCH = 1024
SHORT_S = 0.05  # a unit that ran this fast makes the worker ask for the next one in advance
TINY_S = 0.002  # ... and this fast, for several
DEEP = 64
MAX_BLOCK = 1024  # items run between two looks at the clock, at most
BLOCK_S = 0.001  # a block that ran faster than this doubles; slower, halves


class _Results:
    """Results not yet sent, as runs of consecutive items of one chunk with the same outcome."""

    def __init__(self, chan: Channel, pool_id: int) -> None:
        self.chan, self.pool_id = chan, pool_id
        self.runs: List[List[int]] = []  # [chunk id, first offset, count, ok]
        self.values: List[Any] = []
        self.sent = time.monotonic()

    def add(self, cid: int, off: int, ok: bool, value: Any) -> bool:
        """Keep one result; True when it is time to send: ``FLUSH_S`` since the last send (so the result
        of a long task leaves at once, those of short ones together), or ``MAX_BATCH`` results."""
        run = self.runs[-1] if self.runs else None
        if run is not None and run[0] == cid and run[1] + run[2] == off and run[3] == ok:
            run[2] += 1
        else:
            self.runs.append([cid, off, 1, int(ok)])
        self.values.append(value)
        return len(self.values) >= MAX_BATCH or time.monotonic() - self.sent >= FLUSH_S

    def add_run(self, cid: int, offs: Any, i: int, ok: bool, values: List[Any]) -> bool:
        """Keep the results of items ``offs[i:i + len(values)]``; as :meth:`add`."""
        if isinstance(offs, range):
            first, count = offs[i], len(values)
            run = self.runs[-1] if self.runs else None
            if run is not None and run[0] == cid and run[1] + run[2] == first and run[3] == ok:
                run[2] += count
            else:
                self.runs.append([cid, first, count, int(ok)])
            self.values.extend(values)
            return len(self.values) >= MAX_BATCH or time.monotonic() - self.sent >= FLUSH_S
        due = False
        for k, value in enumerate(values):
            due = self.add(cid, offs[i + k], ok, value)
        return due

    def flush(self, ask: int = 0, key: int = 0) -> None:
        """Send what is kept (asking for ``ask`` more units of ``key`` at once); nothing if empty."""
        if not self.values:
            return
        try:
            frames = dumps(self.values)
        except SerializationError:
            frames = dumps(self._picklable())
        keys = array("q")
        for run in self.runs:
            keys.extend(run)
        header = P.TO_PARENT.pack(self.pool_id, P.RESULTS, ask, key)
        self.chan.send([P.OP, header, keys.tobytes(), *frames])
        self.runs, self.values = [], []
        self.sent = time.monotonic()

    def _picklable(self) -> List[Any]:
        """Replace each value that cannot be pickled by the error saying so (that item fails)."""
        out, runs, i = [], [], 0
        for cid, first, count, ok in self.runs:
            for off in range(first, first + count):
                value, good = self.values[i], ok
                i += 1
                try:
                    dumps(value)
                except SerializationError as exc:
                    value, good = _results.unencodable(exc.__cause__ or exc, value), 0
                out.append(value)
                if runs and runs[-1][0] == cid and runs[-1][1] + runs[-1][2] == off and runs[-1][3] == good:
                    runs[-1][2] += 1
                else:
                    runs.append([cid, off, 1, good])
        self.runs = runs
        return out


def serve(address: str, pool_id: int, worker_id: int, initializer: Optional[Callable[..., Any]],
          initargs: Tuple[Any, ...], maxtasks: Optional[int], connect_timeout: float) -> None:
    """Target of every pool worker process."""
    if initializer is not None:
        initializer(*initargs)
    secret = _session.current().secret

    def connect() -> Channel:
        return Channel(address, secret, connect_timeout, stream=True)

    stop = threading.Event()
    beating = threading.Thread(target=_heartbeat, args=(connect, pool_id, worker_id, stop),
                               name="roving-pool-heartbeat", daemon=True)
    loop = _Loop(connect(), pool_id, maxtasks, connect)
    beating.start()
    try:
        loop.run(worker_id)
    except TransportError as exc:  # the parent cannot be reached again: its work is run elsewhere
        sys.stderr.write(f"roving pool worker {worker_id} exits: {exc}\n")
        raise SystemExit(1) from None
    finally:
        loop.chan.close()
        stop.set()  # its channel closes too: the parent's node forgets both connections
        beating.join(2.0)


def _heartbeat(connect: Callable[[], Channel], pool_id: int, worker_id: int, stop: threading.Event) -> None:
    """Tell the parent this worker lives, also while a long task runs (its own connection). Nothing is
    sent back on it but the node's word that it no longer knows the connection (after a network drop):
    then a new one is opened, so that a drop of this connection alone does not get the worker killed."""
    interval = _config.current().heartbeat_interval
    header = P.TO_PARENT.pack(pool_id, P.HEARTBEAT, worker_id, 0)
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
            chan.send([P.OP, header])
        except ConnectionLost:  # the stream ended: the next recv finds that and connects again
            pass
        stop.wait(interval)
    chan.close(1.0)


class _Loop:
    """The worker's side of the pool protocol over ``chan``. When the parent's node says it no longer
    knows the connection (ConnectionLost: a network drop, both processes alive), the loop opens a new
    one with ``reconnect()`` and says HELLO again: the parent then puts the units it had given this
    worker back in line (results that were lost with the old connection are computed again, by whoever
    gets them; results that arrive twice count once), and the worker drops them too."""

    def __init__(self, chan: Channel, pool_id: int, maxtasks: Optional[int],
                 reconnect: Callable[[], Channel]) -> None:
        self.chan, self.pool_id, self.maxtasks, self.reconnect = chan, pool_id, maxtasks, reconnect
        self.units: Deque[Tuple[int, int, Any, Any, Any, int]] = collections.deque()
        self.funcs: Dict[int, Any] = {}  # function id -> (function, mode), or why it could not be loaded
        self.asked = 0
        self.done = 0
        self.leaving = False  # sent BYE
        self.acked = False
        self.depth = 1  # units to hold (running, waiting here, asked for), learnt per key of work
        self.key = 0
        self.results = _Results(chan, pool_id)

    def _send(self, kind: int, arg: int, key: int = 0) -> None:
        self.chan.send([P.OP, P.TO_PARENT.pack(self.pool_id, kind, arg, key)])

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

    def _leave(self) -> None:
        if not self.leaving:
            self.leaving = True
            # Results first: the channel keeps order, so the parent's ACK then means it has them all,
            # and the worker's exit cannot be taken for a loss of work it already finished.
            self.results.flush()
            self._send(P.BYE, 0)

    def _take(self, frames: List[Any]) -> None:
        kind, cid, fid, key, nfunc, nargs, count = P.TO_WORKER.unpack(frames[0])
        if kind == P.ACK:
            self.acked = True
            return
        if kind == P.STOP:
            self._leave()
            return
        if kind == P.REVOKE:
            for unit in self.units:
                if unit[0] == cid:
                    self.units.remove(unit)
                    self._send(P.RETURNED, cid)
                    break
            return
        # TASKS: one or more units back to back, each [header, forget, offsets, *function, *arguments]
        at = 0
        while True:
            self.asked = max(0, self.asked - 1)
            for gone in P.ints("q", frames[at + 1]):
                self.funcs.pop(gone, None)
            offsets = P.ints("I", frames[at + 2])
            func_frames = frames[at + 3:at + 3 + nfunc]
            arg_frames = frames[at + 3 + nfunc:at + 3 + nfunc + nargs]
            self.units.append((cid, fid, func_frames, arg_frames, offsets or range(count), key))
            at += 3 + nfunc + nargs
            if at >= len(frames):
                return
            kind, cid, fid, key, nfunc, nargs, count = P.TO_WORKER.unpack(frames[at])

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

    def _turn(self, worker_id: int) -> bool:
        """Run the next unit, or wait a moment for work; True once the worker may leave."""
        chan = self.chan
        self._poll()
        if not self.units:
            self.results.flush()
            if self.leaving and self.acked:
                return True
            frames = chan.recv(1.0)
            if frames is not None:
                self._take(frames)
            else:
                # Idle: a word on this connection, so that one re-made under it (a network drop) is
                # found now rather than when work comes (the parent takes it as a heartbeat).
                self._send(P.HEARTBEAT, worker_id)
            return False
        unit = self.units.popleft()
        if unit[5] != self.key:
            self.key, self.depth = unit[5], 1
        if self.depth > 1:
            self._ask()  # the next units arrive while this one runs
        started = time.monotonic()
        due = self._run_unit(*unit[:5])
        took = time.monotonic() - started
        self.depth = DEEP if took < TINY_S else 2 if took < SHORT_S else 1
        self.done += 1
        if self.maxtasks is not None and self.done >= self.maxtasks:
            self._leave()
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

    def _function(self, fid: int, func_frames: List[Any]) -> Tuple[Callable[..., Any], int]:
        """The unit's function: unpickled from its frames (and kept under ``fid`` unless 0), or the one
        kept. A function that could not be unpickled fails every unit that names it, not just the first."""
        if not func_frames:
            got = self.funcs[fid]
            if isinstance(got, BaseException):
                raise got
            return got
        try:
            got = loads(func_frames)
        except BaseException as exc:
            if fid:
                self.funcs[fid] = exc
            raise
        if fid:
            self.funcs[fid] = got
        return got

    def _run_unit(self, cid: int, fid: int, func_frames: List[Any], arg_frames: List[Any],
                  offsets: Any) -> bool:
        """Run the unit's items, sending results as they fall due except the last ones: True when those
        are due (the caller sends them, with its ask for more work if it makes one)."""
        results = self.results
        try:
            func, mode = self._function(fid, func_frames)
            items = loads(arg_frames)
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
            if due and i < n:
                self._flush()
            elif due:
                return True
            block = min(MAX_BLOCK, block * 2) if took < BLOCK_S else max(1, block // 2)
        return False
