"""The dispatcher's reactions to what happens to its workers (the pool's upkeep thread reports them): a
worker added, asked to retire, reconnected after its connection broke, ended holding work (its unfinished
items go back in line and the item it ran is blamed), and the pool terminating.

:class:`WorkerEvents` is the part of :class:`roving.pool._dispatch.Dispatcher` that reacts; the
guarantees are the dispatcher's module docstring's. Every method takes the dispatcher's lock, or is
called with it held (said where so).
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Deque, Dict, List, Optional, Union, cast

from .. import observe
from ..backends.base import JobStatus
from . import _protocol as P
from ..transport.node import Node
from ._memory import Kills, death_words
from ._memory import out_of_memory as out_of_memory_error
from ._work import Chunk, Unit, WorkerState, unfinished
from .errors import WorkerLostError

log = logging.getLogger(__name__)


class WorkerEvents:
    """Workers added, retired, reconnected and lost; the pool terminating (a mixin of ``Dispatcher``, whose
    state it shares: declared here, set by ``Dispatcher.__init__``)."""

    pool_id: int
    max_task_retries: int
    max_memory_kills: int
    lock: threading.Lock
    node: Node  # the session's transport node
    chunks: Dict[int, Chunk]
    pending: Deque[Unit]
    suspects: Deque[Unit]
    workers: Dict[int, WorkerState]
    by_ident: Dict[bytes, WorkerState]
    ready: Dict[WorkerState, None]
    _retiring: int
    _deep: Dict[WorkerState, None]
    retried: int
    handed_back: int
    oom_kills: int
    _terminating: bool
    #: the dispatcher's own steps, called here with its lock held
    _dispatch: Callable[[], None]
    _note_failure: Callable[[Chunk, int, Any], None]
    _deliver_run: Callable[[Chunk, int, bool, List[Any]], None]

    def add_worker(self, w: WorkerState) -> None:
        with self.lock:
            self.workers[w.id] = w

    def retire(self, w: WorkerState) -> None:
        """Ask ``w`` to leave once it has run what it holds; it gets no more work."""
        with self.lock:
            if not w.retiring:
                self._retire(w)
                self._send(w, P.STOP)  # a worker not yet connected is told at HELLO

    def _reconnected(self, w: WorkerState) -> None:
        """``w`` says HELLO over a new connection: the old one broke (a network drop) with the worker
        alive. What was sent either way over it may be lost, so its units go back to the front of the
        line, none blamed (it did not die; items done meanwhile count once), and it starts afresh
        (functions sent again, no credit until it asks) (lock held)."""
        assert w.ident is not None, "called on a worker's second HELLO"
        self.by_ident.pop(w.ident, None)
        units, w.units = list(w.units.values()), {}
        again = [Unit(u.chunk, left) for u in units if (left := unfinished(u))]
        # A worker running a blamed item alone held only that one: it stays with the blamed ones.
        (self.suspects if w.alone else self.pending).extendleft(reversed(again))
        w.known, w.forget, w.credit, w.credit_key, w.alone, w.unreachable = set(), [], 0, 0, False, 0.0
        self.ready.pop(w, None)
        log.warning("roving pool: worker %s reconnected after its connection broke; %d unit(s) it held go "
                    "back in line", w.id, len(again))
        self._dispatch()

    def worker_lost(self, w: WorkerState, exitcode: Optional[int], end: Optional[JobStatus] = None) -> None:
        """``w`` ended: its unfinished items go back to the front of the line (see module docstring).
        ``end``: how its job ended, as its backend says (killed for memory, its peak memory)."""
        out_of_memory = end is not None and end.out_of_memory
        with self.lock:
            if end is not None:
                w.memory.ended(end.memory_peak)
            w.gone = True
            w.unreachable = 0.0  # its contact does not matter any more
            self._retire(w)
            if self.workers.pop(w.id, None) is not None:
                self._retiring -= 1
            self._deep.pop(w, None)
            if w.ident is not None and self.by_ident.get(w.ident) is w:
                del self.by_ident[w.ident]  # a worker that is gone is forgotten
            units, w.units = list(w.units.values()), {}
            if out_of_memory:
                self.oom_kills += 1
            again: List[Unit] = []
            blamed = w.ending  # a worker told it would end did not die of its work: nothing is blamed
            again_n = 0  # items sent again (observe.py)
            for unit in units:
                chunk = unit.chunk
                offsets = unfinished(unit)
                if not offsets:
                    continue
                if not blamed:  # the first unfinished item is the one it was running
                    blamed = True
                    first, offsets = offsets[0], offsets[1:]
                    lost = self._blame(w, chunk, first, exitcode, out_of_memory)
                    if lost is not None:
                        self._note_failure(chunk, first, lost)
                        self._deliver_run(chunk, first, False, [lost])
                    else:
                        self.suspects.append(Unit(chunk, [first]))
                        again_n += 1
                if offsets:
                    again.append(Unit(chunk, offsets))
            self.pending.extendleft(reversed(again))
            again_n += sum(len(cast(List[int], u.offsets)) for u in again)  # each made with its offsets
            how = death_words(out_of_memory, w.memory, exitcode)
            if units and w.ending:
                self.handed_back += again_n
                log.info("roving pool: worker %s ended as it said it would (exit code %s); %d unfinished item(s) "
                         "go to other workers, no retry counted", w.id, exitcode, again_n)
            elif units:
                self.retried += again_n
                observe.event("retry", f"pool {self.pool_id}", f"{again_n} item(s) of worker {w.id} ({how}) "
                              "sent again to other workers", pool=self.pool_id, items=again_n)
                log.warning("roving pool: worker %s ended (%s) holding work; its unfinished items go to other "
                            "workers", w.id, how)
            elif out_of_memory:
                log.warning("roving pool: worker %s ended (%s)", w.id, how)
            self._dispatch()

    def _blame(self, w: WorkerState, chunk: Chunk, first: int, exitcode: Optional[int],
               out_of_memory: bool) -> Optional[WorkerLostError]:
        """Count a death against item ``first`` of ``chunk``, which ``w`` was running: the error it fails
        with when it is not to be tried again (max_memory_kills, max_task_retries), else None."""
        deaths = chunk.deaths or {}
        chunk.deaths = deaths
        deaths[first] = deaths.get(first, 0) + 1
        kills = chunk.kills or {}
        chunk.kills = kills
        item = f"item {chunk.base + first} of {chunk.call.name}"
        call, peak = chunk.call, w.memory.peak
        if peak is not None and (call.peak is None or peak > call.peak):
            call.peak = peak  # what its job was seen to use when it died (its cluster's record, say)
        if out_of_memory:
            record = kills.setdefault(first, Kills())
            record.add(w.memory)
            if record.in_row >= self.max_memory_kills:
                return out_of_memory_error(item, record, self.max_memory_kills)
        else:
            kills.pop(first, None)  # a death of another kind ends a run of deaths for memory
        if deaths[first] >= self.max_task_retries:
            return WorkerLostError(
                f"{item} was running on {deaths[first]} pool worker(s) that died (last: "
                f"{death_words(out_of_memory, w.memory, exitcode)}); it is not tried again "
                f"(max_task_retries={self.max_task_retries})")
        return None

    def terminating(self) -> None:
        """The pool kills its workers now: a worker that then says it will end (the kill's own signal:
        Slurm's cancel sends SIGTERM before SIGKILL, Kubernetes deletes a pod the same way) is not one
        that ended early (and the upkeep, terminating, starts no replacement)."""
        with self.lock:
            self._terminating = True

    def fail_all(self, error: Union[str, BaseException]) -> None:
        """Terminate: every result not yet delivered fails with ``error`` (text: a RuntimeError)."""
        exc = RuntimeError(error) if isinstance(error, str) else error
        with self.lock:
            for chunk in list(self.chunks.values()):
                for off in range(chunk.n):
                    if not chunk.done[off]:
                        self._deliver_run(chunk, off, False, [exc])
            self.pending.clear()
            self.suspects.clear()

    def _send(self, w: WorkerState, kind: int) -> None:
        if w.ident is not None:
            self.node.send_to(w.ident, P.control(kind), w.undeliverable)

    def _retire(self, w: WorkerState) -> None:
        if not w.retiring and self.workers.get(w.id) is w:
            self._retiring += 1
        w.retiring = True
        w.credit = 0
        self.ready.pop(w, None)

