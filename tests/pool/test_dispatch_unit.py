"""The pool's dispatcher driven directly with protocol messages, in this thread, with a fake node and
fake workers (no processes, no sockets): credit, keys of work asked for in advance, stealing a unit a
busy worker has not started, blame for the item a dead worker was running, and each item's result
delivered exactly once. The fake workers read what the dispatcher sends and answer only through
``roving.pool._protocol``, as the real worker loop does, so the codec is exercised both ways."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest

from roving.pool import _protocol as P
from roving.pool._dispatch import Dispatcher, WorkerState
from roving.pool._results import WorkerLostError


def square(x: int) -> int:
    return x * x


class FakeNode:
    """Keeps every message the dispatcher sends, per connection, and which of them were undeliverable."""

    def __init__(self) -> None:
        self.sent: Dict[bytes, List[List[Any]]] = {}

    def send_to(self, ident: bytes, frames: List[Any], undeliverable: Any = None) -> None:
        self.sent.setdefault(ident, []).append([bytes(f) for f in frames])  # as they arrive off a stream


class Results:
    """A result object as the dispatcher writes it (through ``_results.deliver``): each item's outcomes."""

    def __init__(self) -> None:
        self.got: List[Tuple[int, bool, Any]] = []

    def _set_run(self, index: int, ok: bool, values: List[Any]) -> None:
        self.got.extend((index + i, ok, v) for i, v in enumerate(values))

    def _set_length(self, length: int) -> None:
        self.length = length

    def indices(self) -> List[int]:
        return sorted(i for i, _, _ in self.got)


class FakeWorker:
    """A worker that said HELLO: it reads its messages from the fake node and answers in the protocol."""

    def __init__(self, disp: Dispatcher, node: FakeNode, worker_id: int) -> None:
        self.disp, self.node = disp, node
        self.state = WorkerState(worker_id, None)
        self.ident = b"worker-%d" % worker_id
        self.read = 0  # messages of node.sent[ident] read so far
        self.held: List[P.Unit] = []
        self.controls: List[P.Control] = []
        self.funcs: Dict[int, Any] = {}
        disp.add_worker(self.state)
        self.say(P.HELLO, worker_id)

    def say(self, kind: int, arg: int = 0, key: int = 0) -> None:
        frames = P.to_parent(self.disp.pool_id, kind, arg, key)
        head = P.read_header(frames[1:])
        self.disp.on_message(self.ident, head.kind, head.arg, head.key, frames[1:])

    def ready(self, n: int, key: int = 0) -> None:
        self.say(P.READY, n, key)

    def receive(self) -> List[P.Unit]:
        """The units that arrived since the last look (REVOKE, STOP, ACK are kept in ``controls``)."""
        new: List[P.Unit] = []
        messages = self.node.sent.get(self.ident, [])
        for frames in messages[self.read:]:
            head = P.read_control(frames)
            if head.kind == P.TASKS:
                new.extend(P.read_units(frames, head))
            else:
                self.controls.append(head)
        self.read = len(messages)
        self.held.extend(new)
        return new

    def run(self, unit: P.Unit, only: Any = None, ask: int = 0, key: int = 0) -> None:
        """Run ``unit``'s items (``only``: those offsets of it) and send their results."""
        if unit.func_frames:  # sent the first time only: kept under its id
            self.funcs[unit.func] = P.read_function(unit.func_frames)
        func, mode = self.funcs[unit.func]
        assert mode == P.MAP
        items = P.read_list(unit.arg_frames)
        offsets = list(unit.offsets if only is None else only)
        self.send_results(unit.chunk, offsets, [func(items[o]) for o in offsets], ask=ask, key=key)

    def send_results(self, chunk: int, offsets: List[int], values: List[Any], ok: bool = True,
                     ask: int = 0, key: int = 0) -> None:
        runs = P.RunWriter()
        for off in offsets:
            runs.add(chunk, off, 1, ok)
        frames = runs.results(self.disp.pool_id, ask, key, P.list_frames(values))[1:]
        head = P.read_header(frames)
        self.disp.on_message(self.ident, head.kind, head.arg, head.key, frames)

    def returned(self, unit: P.Unit) -> None:
        self.held.remove(unit)
        self.say(P.RETURNED, unit.chunk)


@pytest.fixture
def pool():
    """A dispatcher (max_task_retries=2) whose node is a fake, and a way to add fake workers."""
    disp = Dispatcher(20_000, max_task_retries=2)
    node = FakeNode()
    disp.node = node
    ids = iter(range(1, 100))
    made: List[FakeWorker] = []

    def worker() -> FakeWorker:
        made.append(FakeWorker(disp, node, next(ids)))
        return made[-1]

    yield disp, node, worker
    # A WorkerState is in a reference cycle (its undeliverable callback is its own bound method); one
    # still holding units would leave their pickled arguments (views of a BytesIO) to the cyclic
    # collector, which CPython 3.12.1 crashes on ("deallocated BytesIO object has exported buffers").
    for w in made:
        w.state.units, w.state.undeliverable = {}, None


def test_work_goes_only_to_a_worker_that_asked_and_no_more_units_than_it_asked_for(pool):
    disp, node, worker = pool
    out = Results()
    disp.submit(out, square, P.MAP, list(range(4)), 1, inline=False)  # 4 units of 1 item
    w = worker()
    assert w.receive() == [] and len(disp.pending) == 4  # connected, but no credit: nothing sent
    w.ready(2)
    got = w.receive()
    assert [u.offsets for u in got] == [range(1), range(1)] and len(disp.pending) == 2
    assert len(node.sent[w.ident]) == 1  # both units in one TASKS message
    assert got[0].func_frames and not got[1].func_frames  # the function once, then its id only
    for unit in got:
        w.run(unit)
    assert w.receive() == []  # results alone are no ask for more
    w.ready(5)
    assert len(w.receive()) == 2 and not disp.pending
    assert w.state.credit == 3  # what it was not sent stays its credit


def test_idle_workers_are_served_first_and_a_busy_one_only_with_the_key_it_asked_for(pool):
    disp, node, worker = pool
    out = Results()
    disp.submit(out, square, P.MAP, list(range(3)), 1, inline=False)
    busy, idle = worker(), worker()
    busy.ready(1)
    (first,) = busy.receive()
    busy.ready(1, key=first.key + 1)  # in advance, but for another kind of work: not for this map
    assert busy.receive() == []
    idle.ready(1)  # both have credit now: the idle one gets the next unit
    assert len(idle.receive()) == 1 and busy.receive() == []
    busy.ready(1, key=first.key)  # in advance for this map's work: it gets the last unit while busy
    (ahead,) = busy.receive()
    assert ahead.key == first.key and not disp.pending


def test_an_idle_worker_takes_a_unit_a_busy_one_was_sent_in_advance_and_has_not_started(pool):
    disp, node, worker = pool
    out = Results()
    disp.submit(out, square, P.MAP, list(range(2)), 1, inline=False)
    busy = worker()
    busy.ready(2)
    running, waiting = busy.receive()
    thief = worker()
    thief.ready(1)  # nothing waits: the busy worker is asked for its newest unit
    assert busy.receive() == [] and [(c.kind, c.chunk) for c in busy.controls] == [(P.REVOKE, waiting.chunk)]
    assert thief.receive() == []  # not yet: the unit is the busy worker's until it gives it back
    busy.returned(waiting)
    (stolen,) = thief.receive()
    assert stolen.chunk == waiting.chunk and waiting.chunk not in busy.state.units
    busy.run(running)
    thief.run(stolen)
    assert sorted(out.got) == [(0, True, 0), (1, True, 1)]
    assert not disp.calls and not disp.chunks


def test_a_revoke_that_comes_too_late_loses_nothing_and_the_idle_worker_is_asked_again_later(pool):
    disp, node, worker = pool
    out = Results()
    disp.submit(out, square, P.MAP, list(range(2)), 1, inline=False)
    busy = worker()
    busy.ready(2)
    running, waiting = busy.receive()
    thief = worker()
    thief.ready(1)
    assert busy.receive() == [] and [c.kind for c in busy.controls] == [P.REVOKE]
    busy.run(running)
    busy.run(waiting)  # it had started the unit already: it runs it and sends no RETURNED
    assert sorted(out.got) == [(0, True, 0), (1, True, 1)]
    assert thief.receive() == [] and thief.state in disp.ready  # its credit is kept for the next work
    disp.submit(out, square, P.MAP, [5], 1, inline=False)
    (later,) = thief.receive()
    assert P.read_list(later.arg_frames) == [5]


def test_a_dead_workers_running_item_is_blamed_and_retried_alone_then_fails_naming_it(pool):
    disp, node, worker = pool
    out = Results()
    disp.submit(out, square, P.MAP, list(range(3)), 3, inline=False)  # one unit of 3 items
    first = worker()
    first.ready(1)
    (unit,) = first.receive()
    first.run(unit, only=[0])  # item 0 done; it dies running item 1
    disp.worker_lost(first.state, -9)
    assert [u.offsets for u in disp.suspects] == [[1]] and [u.offsets for u in disp.pending] == [[2]]
    second, third = worker(), worker()
    second.ready(2)
    (alone,) = second.receive()  # the blamed item, alone ...
    assert list(alone.offsets) == [1] and second.state.alone
    third.ready(1)
    (rest,) = third.receive()  # ... and the rest to another worker, not beside it
    assert list(rest.offsets) == [2] and second.receive() == []
    third.run(rest)
    disp.worker_lost(second.state, -9)  # the blamed item's second death: max_task_retries=2
    assert sorted(i for i, _, _ in out.got) == [0, 1, 2]
    (failed,) = [(ok, v) for i, ok, v in out.got if i == 1]
    assert failed[0] is False and isinstance(failed[1], WorkerLostError)
    assert "item 1 of square" in str(failed[1]) and "max_task_retries=2" in str(failed[1])
    assert not disp.calls and not disp.chunks and not disp.suspects


def test_each_items_result_is_delivered_once_when_a_dead_workers_late_results_and_a_rerun_both_arrive(pool):
    disp, node, worker = pool
    out = Results()
    disp.submit(out, square, P.MAP, list(range(4)), 4, inline=False)
    first = worker()
    first.ready(1)
    (unit,) = first.receive()
    disp.worker_lost(first.state, -9)  # dies; its results for items 0..2 are still on their way
    second = worker()
    second.ready(1)
    (alone,) = second.receive()
    second.run(alone)  # the blamed item 0
    first.run(unit, only=[0, 1, 2])  # the late results: 0 again, 1 and 2 for the first time
    third = worker()
    third.ready(1)
    (rest,) = third.receive()
    assert list(rest.offsets) == [3]  # what the late results delivered is not sent again
    third.run(rest)
    assert out.indices() == [0, 1, 2, 3]  # each item exactly once
    assert sorted(out.got) == [(i, True, i * i) for i in range(4)]
    assert disp.done == 4 and not disp.calls and not disp.chunks


def test_results_that_cannot_be_unpickled_in_the_parent_fail_their_items_with_a_clear_error(pool):
    disp, node, worker = pool
    out = Results()
    disp.submit(out, square, P.MAP, list(range(2)), 2, inline=False)
    w = worker()
    w.ready(1)
    (unit,) = w.receive()
    runs = P.RunWriter()
    runs.add(unit.chunk, 0, 2, True)
    frames = runs.results(disp.pool_id, 0, 0, [b"not a pickle"])[1:]
    disp.on_message(w.ident, P.RESULTS, 0, 0, frames)
    assert out.indices() == [0, 1]
    assert all(not ok and "could not be unpickled in the parent" in str(v) for _, ok, v in out.got)
    assert disp.failed == 2 and not disp.chunks and not w.state.units


def test_a_worker_that_says_bye_gets_no_more_work_and_is_acknowledged(pool):
    disp, node, worker = pool
    out = Results()
    leaving, other = worker(), worker()
    leaving.ready(3)
    leaving.say(P.BYE)
    assert leaving.receive() == [] and [c.kind for c in leaving.controls] == [P.ACK]
    disp.submit(out, square, P.MAP, list(range(2)), 1, inline=False)
    assert leaving.receive() == []  # its credit went with its BYE
    other.ready(2)
    assert len(other.receive()) == 2


def test_runs_merge_consecutive_items_of_one_chunk_and_outcome_and_read_back_as_written():
    runs = P.RunWriter()
    for chunk, first, count, ok in [(7, 0, 1, True), (7, 1, 3, True), (7, 4, 1, False), (7, 6, 1, False),
                                    (8, 7, 2, False), (8, 9, 1, False)]:
        runs.add(chunk, first, count, ok)
    expected = [P.Run(7, 0, 4, True), P.Run(7, 4, 1, False), P.Run(7, 6, 1, False), P.Run(8, 7, 3, False)]
    assert runs.runs() == expected
    values = list(range(10))
    frames = runs.results(3, 2, 9, P.list_frames(values))
    assert frames[0] == P.OP and P.read_header(frames[1:]) == P.Header(3, P.RESULTS, 2, 9)
    assert P.read_results(frames[1:]) == P.Results(expected, values)


def test_units_of_one_tasks_message_read_back_as_they_were_written():
    args = P.list_frames([10, 20, 30])
    func = P.function_frames(square, P.MAP)
    frames = [*P.unit_frames(5, 11, 4, 3, func, args, [2, 3], None),
              *P.unit_frames(6, 11, 4, 3, [], args, [], [0, 2])]
    head = P.read_control(frames)
    assert head.kind == P.TASKS and head.chunk == 5
    first, second = P.read_units(frames, head)
    assert (first.chunk, first.func, first.key, first.offsets, list(first.forget)) == (5, 11, 4, range(3), [2, 3])
    assert P.read_function(first.func_frames) == (square, P.MAP) and P.read_list(first.arg_frames) == [10, 20, 30]
    assert (second.chunk, second.func_frames, list(second.offsets), list(second.forget)) == (6, [], [0, 2], [])
    assert P.read_list(second.arg_frames) == [10, 20, 30]
    assert P.read_control(P.control(P.REVOKE, 6)) == P.Control(P.REVOKE, 6, 0, 0, 0, 0, 0)
    assert P.read_control(P.control(P.STOP)).kind == P.STOP


def _end(oom: bool, peak=None):
    from roving.backends.base import JobState, JobStatus

    return JobStatus(JobState.EXITED, -9, out_of_memory=oom, memory_peak=peak)


def test_an_item_fails_out_of_memory_after_max_memory_kills_in_a_row_and_another_death_ends_the_run(pool):
    from roving.backends.memory import MemorySample
    from roving.pool.errors import OutOfMemoryError

    disp, node, worker = pool
    disp.max_task_retries = 10  # only the kills for memory end it here
    out = Results()
    disp.submit(out, square, P.MAP, [7], 1, inline=False)
    ends = [_end(True), _end(False), _end(True, 90 * 2**20), _end(True, 120 * 2**20)]
    for n, end in enumerate(ends):
        w = worker()
        w.ready(1)
        (unit,) = w.receive()
        w.state.memory.asked = 128 * 2**20
        frames = P.heartbeat(disp.pool_id, w.state.id, MemorySample(rss=50 * 2**20, rss_peak=60 * 2**20))
        disp.on_message(w.ident, P.HEARTBEAT, w.state.id, 0, frames[1:])
        assert w.state.memory.peak == 60 * 2**20
        disp.worker_lost(w.state, -9, end)
        if n < len(ends) - 1:
            assert out.got == [], f"failed after death {n + 1}: kills in a row so far are fewer than 2"
    ((index, ok, err),) = out.got
    assert index == 0 and not ok and isinstance(err, OutOfMemoryError)
    assert "ran out of memory" in str(err) and "the 2 pool worker(s)" in str(err)
    assert "peak memory seen 120 MiB" in str(err) and "limit 128 MiB" in str(err)
    assert (err.peak, err.limit) == (120 * 2**20, 128 * 2**20)
    assert disp.oom_kills == 3 and disp.figures()["calls"][-1]["peak_memory"] == 120 * 2**20
