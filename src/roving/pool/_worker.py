"""The loop a pool worker runs: ask for work, run each item, send each item's result back.

A worker holds at most the unit it runs plus one it asked for in advance, and asks in advance only once
its tasks have proved short, so a long task never waits behind another at a busy worker. Results are
sent as items finish, gathered for at most ``FLUSH_S`` seconds so that short tasks share messages; a
worker that dies loses only the items whose results had not left.
"""
from __future__ import annotations

import collections
import logging
import time
from array import array
from multiprocessing.pool import ExceptionWithTraceback, MaybeEncodingError
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from ..transport import session as _session
from ..transport.node import Channel
from ..transport.serialize import SerializationError, dumps, loads
from . import _protocol as P

log = logging.getLogger(__name__)

FLUSH_S = 0.005
MAX_BATCH = 1024
SHORT_S = 0.05  # a unit that ran this fast makes the worker ask for the next one in advance


class _Results:
    def __init__(self, chan: Channel, pool_id: int) -> None:
        self.chan, self.pool_id = chan, pool_id
        self.keys = array("q")
        self.values: List[Any] = []
        self.since = 0.0

    def add(self, cid: int, off: int, ok: bool, value: Any) -> None:
        if not self.values:
            self.since = time.monotonic()
        self.keys.extend((cid, off, int(ok)))
        self.values.append(value)
        if len(self.values) >= MAX_BATCH or time.monotonic() - self.since >= FLUSH_S:
            self.flush()

    def flush(self) -> None:
        if not self.values:
            return
        try:
            frames = dumps(self.values)
        except SerializationError:
            frames = dumps(self._picklable())
        header = P.TO_PARENT.pack(self.pool_id, P.RESULTS, len(self.values))
        self.chan.send([P.OP, header, self.keys.tobytes(), *frames])
        self.keys, self.values = array("q"), []

    def _picklable(self) -> List[Any]:
        """Replace each value that cannot be pickled by the error saying so (that item fails)."""
        out = []
        for i, value in enumerate(self.values):
            try:
                dumps(value)
            except SerializationError as exc:
                value = MaybeEncodingError(exc.__cause__ or exc, value)
                self.keys[3 * i + 2] = 0
            out.append(value)
        return out


def _call(func: Callable[..., Any], mode: int, item: Any) -> Any:
    if mode == P.MAP:
        return func(item)
    if mode == P.STAR:
        return func(*item)
    args, kwds = item
    return func(*args, **kwds)


def serve(address: str, pool_id: int, worker_id: int, initializer: Optional[Callable[..., Any]],
          initargs: Tuple[Any, ...], maxtasks: Optional[int], connect_timeout: float) -> None:
    """Target of every pool worker process."""
    if initializer is not None:
        initializer(*initargs)
    chan = Channel(address, _session.current().secret, connect_timeout)
    try:
        _Loop(chan, pool_id, maxtasks).run(worker_id)
    finally:
        chan.close()


class _Loop:
    def __init__(self, chan: Channel, pool_id: int, maxtasks: Optional[int]) -> None:
        self.chan, self.pool_id, self.maxtasks = chan, pool_id, maxtasks
        self.units: Deque[Tuple[int, int, Any, Any, Any]] = collections.deque()
        self.funcs: Dict[int, Tuple[Callable[..., Any], int]] = {}
        self.asked = 0
        self.done = 0
        self.leaving = False  # sent BYE
        self.acked = False
        self.short = False
        self.results = _Results(chan, pool_id)

    def _send(self, kind: int, arg: int) -> None:
        self.chan.send([P.OP, P.TO_PARENT.pack(self.pool_id, kind, arg)])

    def _ask(self) -> None:
        if self.leaving:
            return
        if self.maxtasks is not None and self.done + len(self.units) + self.asked >= self.maxtasks:
            return
        self.asked += 1
        self._send(P.READY, 1)

    def _leave(self) -> None:
        if not self.leaving:
            self.leaving = True
            self._send(P.BYE, 0)

    def _take(self, frames: List[Any]) -> None:
        kind, cid, job, nfunc, nargs, count = P.TO_WORKER.unpack(frames[0].bytes)
        if kind == P.ACK:
            self.acked = True
            return
        if kind == P.STOP:
            self._leave()
            return
        self.asked = max(0, self.asked - 1)
        for gone in array("q", frames[1].bytes):
            self.funcs.pop(gone, None)
        offsets = array("I", frames[2].bytes)
        func_frames = frames[3:3 + nfunc]
        arg_frames = frames[3 + nfunc:3 + nfunc + nargs]
        self.units.append((cid, job, func_frames, arg_frames, offsets or range(count)))

    def run(self, worker_id: int) -> None:
        self._send(P.HELLO, worker_id)
        self._ask()
        chan = self.chan
        while True:
            while True:  # take whatever has arrived, without waiting
                frames = chan.recv(0)
                if frames is None:
                    break
                self._take(frames)
            if not self.units:
                self.results.flush()
                if self.leaving and self.acked:
                    return
                frames = chan.recv(1.0)
                if frames is not None:
                    self._take(frames)
                continue
            unit = self.units.popleft()
            if self.short and not self.units and self.asked == 0:
                self._ask()  # the next unit arrives while this one runs
            started = time.monotonic()
            self._run_unit(*unit)
            self.short = time.monotonic() - started < SHORT_S
            self.done += 1
            if self.maxtasks is not None and self.done >= self.maxtasks:
                self._leave()
            if not self.units and self.asked == 0:
                self.results.flush()
                self._ask()

    def _run_unit(self, cid: int, job: int, func_frames: List[Any], arg_frames: List[Any],
                  offsets: Any) -> None:
        add = self.results.add
        try:
            if func_frames:
                func, mode = loads(func_frames)
                if mode != P.APPLY:
                    self.funcs[job] = (func, mode)
            else:
                func, mode = self.funcs[job]
            items = loads(arg_frames)
        except BaseException as exc:  # the function or arguments could not be loaded here
            err = ExceptionWithTraceback(exc, exc.__traceback__)
            for off in offsets:
                add(cid, off, False, err)
            return
        for off in offsets:
            try:
                value, ok = _call(func, mode, items[off]), True
            except Exception as exc:
                value, ok = ExceptionWithTraceback(exc, exc.__traceback__), False
            add(cid, off, ok, value)

