"""The pool's upkeep reads the workers' state only under the dispatcher's lock: the node's I/O thread
changes a worker's units (and its connection, its last heartbeat) under that lock at any moment, so a
read outside it sees a table half changed. Each worker's ``units`` here is a table that notes every use
made without the lock; the upkeep's rounds, its autoscaling and a resize must make none."""
from __future__ import annotations

import threading
from typing import Any, List

from roving.pool import _protocol as P
from roving.pool._dispatch import Dispatcher, WorkerState
from roving.pool._upkeep import Upkeep


def square(x: int) -> int:
    return x * x


class Units(dict):
    """A worker's table of units that records each use made while ``lock`` is not held."""

    def __init__(self, lock: Any, unlocked: List[str]) -> None:
        super().__init__()
        self._lock, self._unlocked = lock, unlocked

    def _check(self, what: str) -> None:
        if not self._lock.locked():
            self._unlocked.append(what)


for _name in ("__len__", "__iter__", "__contains__", "__getitem__", "__setitem__", "__delitem__", "get", "pop",
              "values", "items", "keys"):
    def _guarded(self, *args, _name=_name, **kwargs):
        self._check(_name)
        return getattr(dict, _name)(self, *args, **kwargs)
    setattr(Units, _name, _guarded)


class FakeNode:
    def __init__(self) -> None:
        self.sent: List[Any] = []

    def send_to(self, ident: bytes, frames: List[Any], undeliverable: Any = None) -> None:
        self.sent.append((ident, P.read_control(frames)))


class NoCallbacks:
    def stop(self, timeout: float) -> None:
        pass


class Proc:
    name = "fake"

    def is_alive(self) -> bool:
        return True


def test_upkeep_rounds_autoscaling_and_resize_read_the_workers_units_only_under_the_dispatchers_lock():
    unlocked: List[str] = []
    disp = Dispatcher(30_000, max_task_retries=3)
    disp.node = FakeNode()
    workers = [WorkerState(i, Proc()) for i in (1, 2, 3)]
    for w in workers:
        w.units = Units(disp.lock, unlocked)
        disp.add_worker(w)
        disp.on_message(b"w%d" % w.id, P.HELLO, w.id, 0, [])
    disp.submit(object(), square, P.MAP, [1, 2], 2, inline=False)  # one unit, to worker 2
    disp.on_message(b"w2", P.READY, 1, 0, [])
    assert len(workers[1].units) == 1 and unlocked == ["__len__"]  # (the check itself, outside the lock)
    unlocked.clear()
    # Autoscaling between 1 and 3 workers (idle ones retired at once): it looks at who is busy.
    upkeep = Upkeep(disp, NoCallbacks(), 3, 1, 3, idle_timeout=1e-9, shape={}, initializer=None, initargs=(),
                    maxtasks=None)
    assert upkeep.once() and upkeep.once()  # the first finds the idle ones, the second retires them
    assert unlocked == []
    retired = {w.id for w in workers if w.retiring}
    assert retired == {1, 3}  # the two idle ones; the busy one stays
    # A resize down to none retires the rest, idle ones first: it looks at who is busy too.
    upkeep.resize(0)
    assert unlocked == []
    assert all(w.retiring for w in workers)
    assert {ident for ident, control in disp.node.sent if control.kind == P.STOP} == {b"w1", b"w2", b"w3"}
    for w in workers:  # no cycle left holding pickled arguments (see test_dispatch_unit's fixture)
        w.units, w.undeliverable = {}, None


def test_units_tables_note_a_use_made_without_the_lock():
    """The check above can fail: a read outside the lock is noted (and one inside is not)."""
    unlocked: List[str] = []
    lock = threading.Lock()
    units = Units(lock, unlocked)
    with lock:
        units[1] = "unit"
        assert bool(units) and list(units.values()) == ["unit"]
    assert unlocked == []
    assert units and len(units) == 1
    assert unlocked == ["__len__", "__len__"]
