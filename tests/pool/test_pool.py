"""roving.Pool: the multiprocessing.Pool API, pull dispatch, exactly-once results across worker deaths,
bounded retries, resize, and worker recycling."""
from __future__ import annotations

import collections
import multiprocessing
import os
import signal
import threading
import time

import pytest

import roving
import helpers_pool as h
from helpers_core import pid_running, wait_until

T = 60  # bound on every wait in these tests


def _wait_for(predicate, timeout=T):
    return wait_until(predicate, timeout)


def _live_workers(pool):
    return [w for w in pool._workers.values() if not w.retiring and w.ident is not None]


def _busy_worker_pid(pool):
    for w in list(pool._workers.values()):
        try:
            if w.units and w.proc.is_alive():
                return w.proc.pid
        except ValueError:  # closed by the pool's upkeep after it ended, in the meantime
            continue
    return None


@pytest.fixture
def pool():
    p = roving.Pool(2)
    yield p
    p.terminate()
    p.join(T)


def test_map_imap_starmap_apply_give_correct_results_in_order(pool):
    assert pool.map(h.square, range(100)) == [x * x for x in range(100)]
    assert pool.map(h.square, range(100), chunksize=7) == [x * x for x in range(100)]
    assert pool.map(h.square, []) == []
    assert list(pool.imap(h.square, range(50), chunksize=3)) == [x * x for x in range(50)]
    assert sorted(pool.imap_unordered(h.square, range(50))) == [x * x for x in range(50)]
    assert pool.starmap(h.add, [(i, i) for i in range(20)]) == [2 * i for i in range(20)]
    assert pool.starmap_async(h.add, [(1, 2)]).get(T) == [3]
    assert pool.apply(h.add, (2, 3)) == 5
    assert pool.apply_async(h.add, (2,), {"b": 5}).get(T) == 7
    assert pool.map_async(h.square, (1, 2, 3)).get(T) == [1, 4, 9]


def test_callback_and_error_callback_run_before_get_returns(pool):
    got, errors = [], []
    assert pool.apply_async(h.square, (4,), callback=got.append).get(T) == 16
    assert got == [16]
    r = pool.apply_async(h.raise_value_error, ("nope",), error_callback=errors.append)
    with pytest.raises(ValueError):
        r.get(T)
    assert len(errors) == 1 and isinstance(errors[0], ValueError)
    pool.map_async(h.square, range(5), callback=got.append).get(T)
    assert got[-1] == [0, 1, 4, 9, 16]
    r = pool.map_async(h.fail_on, range(5), error_callback=errors.append)
    r.wait(T)
    assert r.ready() and not r.successful() and isinstance(errors[-1], TypeError)  # fail_on needs 2 args


def test_task_exception_has_remote_traceback_and_same_worker_serves_next_task():
    with roving.Pool(1) as p:
        pid = p.apply(h.getpid)
        r = p.apply_async(h.raise_value_error, ("boom 42",))
        with pytest.raises(ValueError, match="boom 42") as info:
            r.get(T)
        assert r.ready() and not r.successful()
        cause = info.value.__cause__
        assert isinstance(cause, multiprocessing.pool.RemoteTraceback)
        assert "raise_value_error" in str(cause) and "boom 42" in str(cause)
        assert p.apply(h.getpid) == pid  # the worker lived on


def test_failed_imap_item_does_not_stop_the_items_after_it():
    with roving.Pool(2) as p:
        out = []
        it = p.imap(h.square, [1, "x", 3])
        out.append(it.next(T))
        with pytest.raises(TypeError):
            it.next(T)
        out.append(it.next(T))
        assert out == [1, 9]
        with pytest.raises(StopIteration):
            it.next(T)


def test_three_worker_kills_during_10000_task_map_lose_and_duplicate_nothing(tmp_path):
    n = 10_000
    with roving.Pool(4) as p:
        _wait_for(lambda: len(_live_workers(p)) == 4)
        # Chunks of 500: a pool that redid whole chunks would rerun about 250 items per kill.
        it = p.imap_unordered(_Counting(str(tmp_path)), range(n), chunksize=500)
        killed = []
        results = []
        deadline = time.monotonic() + 0.3
        while len(results) < n:
            results.append(it.next(T))
            if len(killed) < 3 and time.monotonic() > deadline:
                pid = _busy_worker_pid(p)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                    deadline = time.monotonic() + 0.3
        with pytest.raises(StopIteration):
            it.next(1)
        assert len(killed) == 3
        assert sorted(results) == [x * x for x in range(n)]  # every result once, none twice
        runs = collections.Counter(name.split(".")[0] for name in os.listdir(tmp_path))
        assert set(runs) == {str(x) for x in range(n)}
        rerun = [x for x, c in runs.items() if c > 1]
        # Only items the killed workers had not reported run twice: a few per kill, not whole chunks.
        assert len(rerun) <= 150, len(rerun)
        assert _wait_for(lambda: len(_live_workers(p)) == 4)  # replacements started
        assert not {w.proc.pid for w in _live_workers(p)} & set(killed)


class _Counting:
    """A picklable callable (by reference to helpers_pool) that counts executions in files."""

    def __init__(self, log_dir):
        self.log_dir = log_dir

    def __call__(self, x):
        return h.slow_square_counting(x, 0.001, self.log_dir)


def test_map_order_is_kept_when_a_worker_is_killed_mid_map():
    with roving.Pool(3) as p:
        _wait_for(lambda: len(_live_workers(p)) == 3)
        r = p.starmap_async(h.sleep_square, [(x, 0.002) for x in range(1500)], chunksize=40)
        assert _wait_for(lambda: _busy_worker_pid(p) is not None)  # the map is under way
        pid = _busy_worker_pid(p)
        assert pid is not None and not r.ready()
        os.kill(pid, signal.SIGKILL)
        assert r.get(T) == [x * x for x in range(1500)]


def test_task_that_kills_its_worker_fails_with_worker_lost_error_and_others_succeed():
    with roving.Pool(2, max_task_retries=2) as p:
        doomed = p.apply_async(h.kill_self, (1,))
        others = [p.apply_async(h.square, (i,)) for i in range(30)]
        with pytest.raises(roving.WorkerLostError, match="kill_self") as info:
            doomed.get(T)
        assert "max_task_retries=2" in str(info.value)
        assert [r.get(T) for r in others] == [i * i for i in range(30)]
        # In the middle of a chunk: only that item fails, its chunk-mates are delivered.
        it = p.imap(_KillAt(7), range(20), chunksize=5)
        got = []
        for i in range(20):
            if i == 7:
                with pytest.raises(roving.WorkerLostError):
                    it.next(T)
            else:
                got.append(it.next(T))
        assert got == [x for x in range(20) if x != 7]
        assert p.apply(h.square, (5,)) == 25  # the pool still works


class _KillAt:
    def __init__(self, bad):
        self.bad = bad

    def __call__(self, x):
        return h.kill_if(x, self.bad)


def test_resize_up_and_down_under_load_keeps_every_result():
    with roving.Pool(1) as p:
        r = p.starmap_async(h.sleep_square, [(x, 0.01) for x in range(300)], chunksize=2)
        assert _wait_for(lambda: _busy_worker_pid(p) is not None)  # under load
        p.resize(4)
        assert _wait_for(lambda: len({w.proc.pid for w in p._workers.values() if w.units}) >= 3, 20)
        p.resize(1)
        assert r.get(T) == [x * x for x in range(300)]
        assert _wait_for(lambda: len(p._workers) == 1)
        assert p.map(h.square, range(10)) == [x * x for x in range(10)]


def test_eight_one_second_tasks_on_four_workers_take_under_four_seconds():
    with roving.Pool(4) as p:
        assert _wait_for(lambda: len(_live_workers(p)) == 4)
        p.map(h.square, range(8))
        start = time.monotonic()
        pids = p.map(h.pid_after, [1.0] * 8)
        took = time.monotonic() - start
        assert took < 4.0, took
        assert len(set(pids)) == 4


def test_maxtasksperchild_recycles_workers():
    with roving.Pool(2, maxtasksperchild=1) as p:
        pids = [p.apply_async(h.getpid).get(T) for _ in range(4)]
        assert len(set(pids)) == 4
        assert p.map(h.square, range(10), chunksize=1) == [x * x for x in range(10)]


def test_initializer_runs_in_every_worker():
    with roving.Pool(2, initializer=h.init_value, initargs=("ready",)) as p:
        assert set(p.map(h.initialized, range(8), chunksize=1)) == {"ready"}


def test_unpicklable_result_fails_only_that_task(pool):
    results = [pool.apply_async(h.unpicklable_if, (i, 3)) for i in range(6)]
    for i, r in enumerate(results):
        if i == 3:
            with pytest.raises(multiprocessing.pool.MaybeEncodingError):
                r.get(T)
        else:
            assert r.get(T) == i
    it = pool.imap(_Unpicklable(2), range(5), chunksize=5)
    assert [it.next(T), it.next(T)] == [0, 1]
    with pytest.raises(multiprocessing.pool.MaybeEncodingError):
        it.next(T)
    assert [it.next(T), it.next(T)] == [3, 4]


class _Unpicklable:
    def __init__(self, bad):
        self.bad = bad

    def __call__(self, x):
        return h.unpicklable_if(x, self.bad)


def test_unpicklable_argument_fails_the_result_not_the_pool(pool):
    import threading

    r = pool.apply_async(h.square, (threading.Lock(),))
    with pytest.raises(TypeError):
        r.get(T)
    assert pool.apply(h.square, (3,)) == 9


def test_get_timeout_raises_timeout_error(pool):
    r = pool.apply_async(h.pid_after, (2.0,))
    with pytest.raises(multiprocessing.TimeoutError):
        r.get(0.2)
    assert not r.ready()
    with pytest.raises(ValueError):
        r.successful()
    assert isinstance(r.get(T), int)
    it = pool.imap(h.pid_after, [2.0])
    with pytest.raises(multiprocessing.TimeoutError):
        it.next(0.2)


def test_close_then_join_finishes_work_and_workers_exit():
    p = roving.Pool(2)
    r = p.map_async(h.sleep_square, [])  # empty works
    r2 = p.starmap_async(h.sleep_square, [(x, 0.05) for x in range(10)])
    pids = [w.proc.pid for w in p._workers.values()]
    assert pids and all(pids)
    with pytest.raises(ValueError):
        p.join()
    p.close()
    with pytest.raises(ValueError):
        p.apply_async(h.square, (1,))
    p.join(T)
    assert r.get(0) == [] and r2.get(0) == [x * x for x in range(10)]
    assert not any(pid_running(pid) for pid in pids)


def test_terminate_stops_workers_and_fails_pending_results():
    p = roving.Pool(2)
    r = p.apply_async(h.pid_after, (30.0,))
    assert _wait_for(lambda: _busy_worker_pid(p) is not None)
    procs = [w.proc for w in p._workers.values()]
    start = time.monotonic()
    p.terminate()
    p.join(T)
    assert time.monotonic() - start < 10
    with pytest.raises(RuntimeError, match="terminated"):
        r.get(1)
    assert all(not proc.is_alive() for proc in procs)


def test_context_manager_terminates_on_exit():
    with roving.Pool(2) as p:
        assert p.apply(h.square, (7,)) == 49
        procs = [w.proc for w in p._workers.values()]
    p.join(T)
    assert all(not proc.is_alive() for proc in procs)
    with pytest.raises(ValueError):
        p.apply(h.square, (1,))


def test_late_results_of_a_dead_worker_are_delivered_once_and_the_rerun_skips_them():
    """Deterministic: a worker dies after sending results that arrive after its work was requeued."""
    from array import array

    from roving.pool import _protocol as P
    from roving.pool._dispatch import Dispatcher, WorkerState
    from roving.transport.serialize import dumps

    class Recorder:
        def __init__(self):
            self.got = []

        def _set_run(self, index, ok, values):
            self.got.extend((index + i, ok, v) for i, v in enumerate(values))

    disp = Dispatcher(10_000, max_task_retries=3)
    sent = []
    disp.node = type("FakeNode", (), {
        "send_to": lambda self, ident, frames, undeliverable=None: sent.append((ident, frames))})()
    rec = Recorder()
    disp.submit(rec, h.square, P.MAP, list(range(6)), 6, inline=False)
    w1, w2 = WorkerState(1, None), WorkerState(2, None)
    for w in (w1, w2):
        disp.add_worker(w)
        disp.on_message(b"w%d" % w.id, P.HELLO, w.id, 0, [])
    disp.on_message(b"w1", P.READY, 1, 0, [])
    assert [ident for ident, _ in sent] == [b"w1"]
    cid = next(iter(disp.chunks))

    def results(ident, first, values):
        runs = array("q", [cid, first, len(values), 1]).tobytes()
        disp.on_message(ident, P.RESULTS, 0, 0, [None, runs, *dumps(values)])

    results(b"w1", 0, [0])  # item 0 arrives; then w1 dies holding items 1..5
    disp.worker_lost(w1, -9)
    results(b"w1", 1, [1, 4])  # its last results, still in flight, arrive after the death
    disp.on_message(b"w2", P.READY, 2, 0, [])
    # Items 1 and 2 are done now: w2 is sent only 3..5, in one message.
    assert [(ident, array("I", frames[2]).tolist()) for ident, frames in sent[1:]] == [(b"w2", [3, 4, 5])]
    results(b"w2", 2, [4, 9, 16, 25])  # a worker that redid 2 anyway: that duplicate is dropped
    assert sorted(i for i, _, _ in rec.got) == list(range(6))  # each item exactly once
    assert sorted(rec.got) == [(i, True, i * i) for i in range(6)]
    assert not disp.calls and not disp.chunks


def test_worker_that_stops_heartbeating_is_replaced_and_its_work_redone(monkeypatch):
    """SIGSTOP: the job still runs (no sentinel fires) but the worker is silent; heartbeats catch it."""
    monkeypatch.setattr(roving.config, "_current",
                        roving.config.current().replace("test", pool_heartbeat_timeout=3.0))
    with roving.Pool(2) as p:
        assert _wait_for(lambda: len(_live_workers(p)) == 2)
        r = p.starmap_async(h.sleep_square, [(x, 0.05) for x in range(60)], chunksize=1)
        assert _wait_for(lambda: _busy_worker_pid(p) is not None)
        pid = _busy_worker_pid(p)
        os.kill(pid, signal.SIGSTOP)
        try:
            assert r.get(T) == [x * x for x in range(60)]
            assert _wait_for(lambda: pid not in {w.proc.pid for w in p._workers.values()}, 10)
        finally:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_imap_reads_a_generator_lazily_and_returns_at_once(pool):
    first_result_seen = threading.Event()

    def slow_items():
        for i in range(20):
            if i == 10:  # the iterable goes on only once the caller has a result
                assert first_result_seen.wait(T), "no result came before the iterable ended"
            yield i

    assert _wait_for(lambda: len(_live_workers(pool)) == 2)  # the clock below is for imap, not start-up
    start = time.monotonic()
    it = pool.imap(h.square, slow_items(), chunksize=3)
    assert time.monotonic() - start < 0.5
    assert it.next(T) == 0 and time.monotonic() - start < 1.0
    first_result_seen.set()
    assert [0] + list(it) == [x * x for x in range(20)]
    assert sorted(pool.imap_unordered(h.square, (x for x in range(25)), chunksize=4)) == \
        [x * x for x in range(25)]
    assert list(pool.imap(h.square, iter([]))) == []


def test_function_workers_cannot_load_fails_every_call_of_it_not_the_pool(pool, tmp_path):
    """Functions are sent once and kept by id: one a worker could not unpickle keeps failing there."""
    import sys

    (tmp_path / "parent_only_mod.py").write_text("def ident(x):\n    return x\n")
    sys.path.insert(0, str(tmp_path))  # after the workers started: they cannot import it
    try:
        import parent_only_mod

        for _ in range(3):
            with pytest.raises(ModuleNotFoundError, match="parent_only_mod"):
                pool.apply(parent_only_mod.ident, (1,))
        with pytest.raises(ModuleNotFoundError):
            pool.map(parent_only_mod.ident, range(4))
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("parent_only_mod", None)
    assert pool.apply(h.square, (3,)) == 9


def test_repeated_calls_send_a_plain_function_once_per_worker():
    from roving.pool import _protocol as P

    with roving.Pool(1) as p:
        sent = []
        real = p._disp.node.send_to
        p._disp.node = type("Spy", (), {"send_to": lambda self, ident, frames, undeliverable=None: (sent.append(frames),
                                                                                 real(ident, frames))})()
        assert [p.apply_async(h.square, (i,)).get(T) for i in range(5)] == [i * i for i in range(5)]
        p.map(h.square, range(10), chunksize=2)
        with_function = [f for frames in sent if P.TO_WORKER.unpack(bytes(frames[0]))[0] == P.TASKS
                         for f in [frames] if P.TO_WORKER.unpack(bytes(frames[0]))[4] > 0]
        assert len(with_function) == 2  # square for apply, square for map: once each, then ids only
