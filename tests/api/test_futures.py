"""roving.futures.Executor against concurrent.futures.ProcessPoolExecutor: each documented behaviour is
checked by the same assertions on the standard library's executor, on roving's with the local backend and
on roving's with the real single-node Slurm; then what only roving does (workers that die)."""
from __future__ import annotations

import collections
import concurrent.futures as cf
import multiprocessing
import os
import signal
import sys
import threading
import time
import weakref
from concurrent.futures.process import BrokenProcessPool

import pytest

import helpers_futures as fx
import roving
from helpers_backends import require
from helpers_core import TIMEOUT, wait_until
from roving.futures import Executor

KINDS = ["stdlib", "roving-local", "roving-slurm"]
#: The bound of a wait that includes starting workers (Slurm jobs, on a machine other sessions load too).
START = 2 * TIMEOUT


@pytest.fixture(params=KINDS)
def make(request):
    """A factory of executors of one kind; every executor it made is shut down after the test."""
    kind = request.param
    if kind == "stdlib":
        spawn = multiprocessing.get_context("spawn")  # the test process runs threads: no fork

        def factory(*args, **kwargs):
            kwargs.setdefault("mp_context", spawn)
            return cf.ProcessPoolExecutor(*args, **kwargs)
    else:
        backend = kind.split("-")[1]
        require(backend)
        roving.init(backend=backend)
        factory = Executor
    made = []

    def new(*args, **kwargs):
        ex = factory(*args, **kwargs)
        made.append(ex)
        return ex

    new.kind = kind
    yield new
    for ex in made:
        ex.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(params=["local", "slurm"])
def backend(request):
    require(request.param)
    roving.init(backend=request.param)
    return request.param


def _warm(ex, n=2):
    """Every worker started (so that timings in a test do not include worker start-up)."""
    assert list(ex.map(fx.square, range(4 * n), timeout=START)) == [x * x for x in range(4 * n)]


# -- the standard library's documented behaviours, side by side ---------------------------------------
def test_submit_returns_a_future_with_the_result(make):
    ex = make(2)
    f = ex.submit(fx.add, 2, b=3)
    assert isinstance(f, cf.Future)
    assert f.result(START) == 5 and f.done() and not f.cancelled() and f.exception() is None


def test_map_yields_results_in_input_order_even_when_later_items_finish_first(make):
    ex = make(2)
    delays = [0.4, 0.3, 0.2, 0.1, 0.0, 0.0]
    assert list(ex.map(fx.sleep_then_return, delays, range(6), timeout=TIMEOUT)) == list(range(6))


def test_map_with_an_infinite_timeout_waits_as_long_as_it_takes():
    # (the standard library's map does `timeout + time.monotonic()` and then waits on that: not compared)
    roving.init(backend="local")
    with Executor(2) as ex:
        assert list(ex.map(fx.square, range(5), timeout=float("inf"))) == [0, 1, 4, 9, 16]
        assert list(ex.map(fx.square, [], timeout=float("inf"))) == []


def test_map_zips_several_iterables_and_stops_at_the_shortest(make):
    ex = make(2)
    assert list(ex.map(fx.add, range(10), range(100, 105))) == [100, 102, 104, 106, 108]
    assert list(ex.map(fx.square, [])) == []


def test_map_with_chunksize_keeps_order_and_runs_each_chunk_in_one_worker(make):
    ex = make(2)
    assert list(ex.map(fx.square, range(103), chunksize=7)) == [x * x for x in range(103)]
    pids = list(ex.map(fx.getpid, range(20), chunksize=5))
    for start in range(0, 20, 5):
        assert len(set(pids[start:start + 5])) == 1, pids
    with pytest.raises(ValueError, match="chunksize must be >= 1"):
        ex.map(fx.square, range(3), chunksize=0)


def test_map_timeout_counts_from_the_call_to_map_and_cancels_what_is_left(make, tmp_path):
    ex = make(1)
    _warm(ex, 1)
    gate = tmp_path / "gate"
    items = [None, str(gate)] + [None] * 30
    it = ex.map(fx.wait_for, items, timeout=1.0)
    time.sleep(1.5)  # past the deadline before the first result is asked for
    assert next(it) == "done"  # a result that is there is still delivered after the deadline
    started = time.monotonic()
    with pytest.raises(cf.TimeoutError):  # (the builtin TimeoutError from 3.11 on; its own class on 3.10)
        next(it)
    assert time.monotonic() - started < 0.9  # no fresh second of waiting: the clock started at map()
    with pytest.raises(StopIteration):
        next(it)
    gate.touch()


def test_map_raises_the_first_failing_items_exception_at_its_place(make):
    ex = make(2)
    it = ex.map(fx.fail_on_bad, ["ok", "ok", "bad", "ok", "bad"])
    assert next(it) == "ok" and next(it) == "ok"
    with pytest.raises(ValueError, match="bad item"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_an_exception_in_a_call_reaches_its_future_with_the_remote_traceback(make):
    ex = make(2)
    f = ex.submit(fx.raise_value_error, "broken on purpose")
    with pytest.raises(ValueError, match="broken on purpose"):
        f.result(TIMEOUT)
    exc = f.exception()
    assert isinstance(exc, ValueError)
    remote = str(exc.__cause__)
    assert "Traceback (most recent call last)" in remote
    assert "raise_value_error" in remote and 'raise ValueError(message)' in remote
    assert ex.submit(fx.square, 4).result(TIMEOUT) == 16  # the worker (and the executor) go on


def test_wait_as_completed_and_done_callbacks_work_on_its_futures(make, tmp_path):
    ex = make(2)
    seen = []
    all_seen = threading.Event()

    def note(f):
        seen.append(f.result())
        if len(seen) == 9:
            all_seen.set()

    futures = [ex.submit(fx.sleep_then_return, 0.05 * (i % 3), i) for i in range(9)]
    for f in futures:
        f.add_done_callback(note)
    done, not_done = cf.wait(futures, timeout=TIMEOUT)
    assert len(done) == 9 and not not_done
    assert sorted(f.result() for f in cf.as_completed(futures, timeout=TIMEOUT)) == list(range(9))
    assert all_seen.wait(TIMEOUT) and sorted(seen) == list(range(9))
    late = []
    futures[0].add_done_callback(late.append)  # on a done future: called at once, in this thread
    assert late == [futures[0]]
    # The quick call first: whichever worker runs it (an idle one, or the same one, before the other
    # call), it is done first, and wait returns while the other one waits for its gate.
    gate = tmp_path / "gate"
    quick, held = ex.submit(fx.square, 3), ex.submit(fx.wait_for, str(gate))
    first, rest = cf.wait([held, quick], timeout=TIMEOUT, return_when=cf.FIRST_COMPLETED)
    assert first == {quick} and rest == {held} and quick.result() == 9
    gate.touch()
    assert held.result(TIMEOUT) == "done"


def test_cancel_takes_back_a_pending_call_but_not_a_running_one(make, tmp_path):
    ex = make(1)
    _warm(ex, 1)
    gate = tmp_path / "gate"
    blocker = ex.submit(fx.wait_for, str(gate))
    rest = [ex.submit(fx.square, i) for i in range(60)]
    deadline = time.monotonic() + TIMEOUT
    while not blocker.running() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert blocker.running() and not blocker.cancel()
    last = rest[-1]
    assert last.cancel() and last.cancelled() and last.done()
    gate.touch()
    assert blocker.result(TIMEOUT) == "done"
    with pytest.raises(cf.CancelledError):
        last.result(TIMEOUT)
    assert [f.result(TIMEOUT) for f in rest[:-1]] == [i * i for i in range(59)]


def test_shutdown_cancel_futures_cancels_the_pending_and_runs_the_started(make, tmp_path):
    ex = make(1)
    _warm(ex, 1)
    gate = tmp_path / "gate"
    blocker = ex.submit(fx.wait_for, str(gate))
    rest = [ex.submit(fx.square, i) for i in range(60)]
    deadline = time.monotonic() + TIMEOUT
    while not blocker.running() and time.monotonic() < deadline:
        time.sleep(0.01)
    ex.shutdown(wait=False, cancel_futures=True)
    with pytest.raises(RuntimeError, match="cannot schedule new futures after shutdown"):
        ex.submit(fx.square, 1)
    time.sleep(0.5)  # the standard library cancels on its manager thread
    gate.touch()
    assert blocker.result(TIMEOUT) == "done"
    assert all(f.cancelled() for f in rest[-30:])
    # (the standard library does not notify waiters of the futures it cancels here; roving does)
    done, not_done = cf.wait([f for f in rest if not f.cancelled()], timeout=TIMEOUT)
    assert not not_done
    for i, f in enumerate(rest):
        assert f.cancelled() or f.result() == i * i


def test_shutdown_wait_returns_once_everything_submitted_is_done(make):
    ex = make(2)
    futures = [ex.submit(fx.sleep_then_return, 0.2, i) for i in range(6)]
    ex.shutdown(wait=True)
    assert all(f.done() for f in futures) and [f.result() for f in futures] == list(range(6))
    ex.shutdown()  # a second time: nothing happens
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(fx.square, 1)


def test_shutdown_without_wait_returns_at_once_and_the_work_still_finishes(make):
    ex = make(2)
    _warm(ex)
    futures = [ex.submit(fx.sleep_then_return, 1.0, i) for i in range(2)]
    started = time.monotonic()
    ex.shutdown(wait=False)
    assert time.monotonic() - started < 0.9
    assert [f.result(TIMEOUT) for f in futures] == [0, 1]


def test_context_manager_shuts_down_on_exit(make):
    with make(2) as ex:
        futures = [ex.submit(fx.sleep_then_return, 0.1, i) for i in range(4)]
    assert all(f.done() for f in futures)
    with pytest.raises(RuntimeError):
        ex.submit(fx.square, 2)


def _without_max_tasks_per_child(make) -> bool:
    """The standard library's executor has max_tasks_per_child from 3.11 on: before, it refuses it."""
    if make.kind == "stdlib" and sys.version_info < (3, 11):
        with pytest.raises(TypeError):
            make(1, max_tasks_per_child=1)
        return True
    return False


def test_max_tasks_per_child_gives_each_call_a_fresh_worker(make):
    if _without_max_tasks_per_child(make):
        return
    ex = make(1, max_tasks_per_child=1)
    pids = [ex.submit(fx.getpid).result(TIMEOUT) for _ in range(3)]
    assert len(set(pids)) == 3, pids


def test_max_tasks_per_child_defaults_to_the_spawn_context_and_refuses_a_fork_one_as_the_standard_librarys():
    executors = [Executor] + ([cf.ProcessPoolExecutor] if sys.version_info >= (3, 11) else [])
    for make_executor in executors:  # the standard library's has max_tasks_per_child from 3.11 on
        ex = make_executor(1, max_tasks_per_child=2)
        try:
            assert ex._mp_context.get_start_method() == "spawn", make_executor
        finally:
            ex.shutdown()
        for fork in (multiprocessing.get_context("fork"), roving.get_context("fork")):
            with pytest.raises(ValueError, match="max_tasks_per_child is incompatible with the 'fork'"):
                make_executor(1, max_tasks_per_child=2, mp_context=fork)
    ex = Executor(1)
    try:
        assert ex._mp_context.get_start_method() == roving.get_context().get_start_method()
    finally:
        ex.shutdown()


def test_an_argument_is_let_go_once_its_call_is_done_while_its_future_is_kept(make):
    """The standard library's executor drops a finished call's work item: its future, kept, does not
    hold the arguments."""
    ex = make(1)
    assert ex.submit(fx.square, 2).result(START) == 4
    for how in ("args", "kwargs"):
        argument = fx.Argument(an_argument=list(range(10)))
        ref = weakref.ref(argument)
        future = (ex.submit(fx.identity, argument) if how == "args" else ex.submit(fx.identity, value=argument))
        del argument
        assert future.result(TIMEOUT) == {"an_argument": list(range(10))}
        # the pool's thread may let go of it just after the result is set: a little time, not for ever
        assert wait_until(lambda: ref() is None, 5), f"a finished call keeps its argument ({how}) alive"


def test_initializer_runs_in_each_worker_before_the_calls(make):
    ex = make(2, initializer=fx.set_global, initargs=("from the initializer",))
    assert set(ex.map(fx.get_global, range(6))) == {"from the initializer"}


def test_an_initializer_that_fails_breaks_the_executor(make):
    ex = make(1, initializer=fx.fail_init, initargs=("init failed on purpose",))
    f = ex.submit(fx.square, 3)
    with pytest.raises(BrokenProcessPool):
        f.result(TIMEOUT)
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:  # the standard library marks itself broken on its own thread
        try:
            ex.submit(fx.square, 3).result(TIMEOUT)
        except BrokenProcessPool:
            break
    with pytest.raises(BrokenProcessPool):
        ex.submit(fx.square, 3)
    if make.kind != "stdlib":  # roving's says why
        cause = f.exception().__cause__
        assert isinstance(cause, ValueError) and "init failed on purpose" in str(cause)
        assert "fail_init" in str(cause.__cause__)


def test_bad_arguments_are_the_standard_librarys_errors(make):
    with pytest.raises(ValueError):
        make(0)
    with pytest.raises(TypeError):
        make(1, initializer=42)
    if _without_max_tasks_per_child(make):
        return
    with pytest.raises(ValueError):
        make(1, max_tasks_per_child=0)
    with pytest.raises(TypeError):
        make(1, max_tasks_per_child="3")


# -- roving's own ------------------------------------------------------------------------------------
def test_mp_context_may_be_a_multiprocessing_or_roving_context_and_nothing_else():
    for ctx in (multiprocessing.get_context("spawn"), multiprocessing.get_context("fork"),
                roving.get_context("spawn")):
        with Executor(1, mp_context=ctx) as ex:
            assert ex.submit(fx.square, 5).result(TIMEOUT) == 25
    with pytest.raises(TypeError, match="mp_context"):
        Executor(1, mp_context="spawn")
    with pytest.raises(ValueError, match="max_task_retries"):
        Executor(1, max_task_retries=0)


def test_kill_9_of_a_worker_during_a_map_of_5000_calls_loses_and_repeats_nothing(backend, tmp_path):
    log = tmp_path / "calls.log"
    n = 5000
    with Executor(2) as ex:
        _warm(ex)
        results, killed = [], None
        for value, pid in ex.map(fx.logged_square, [str(log)] * n, range(n), [0.001] * n):
            results.append(value)
            if len(results) == 1000:
                killed = pid
                os.kill(pid, signal.SIGKILL)
        assert results == [i * i for i in range(n)]
        # the executor still accepts work, on a worker that replaced the dead one
        pids = set(ex.map(fx.getpid, range(50)))
        assert killed not in pids and len(pids) >= 1
        assert ex.submit(fx.square, 12).result(TIMEOUT) == 144
    runs = collections.defaultdict(list)
    for line in log.read_text().split("\n"):
        if line:
            i, pid = line.split()
            runs[int(i)].append(int(pid))
    assert sorted(runs) == list(range(n))  # every call ran
    first_workers = {pid for i in range(1000) for pid in runs[i]}
    assert killed in first_workers and any(set(runs[i]) - first_workers for i in range(1000, n))  # a replacement
    repeated = {i: pids for i, pids in runs.items() if len(pids) > 1}
    # a call ran twice only when its first run was on the killed worker (its result never left it)
    for i, pids in repeated.items():
        assert len(pids) == 2 and pids[0] == killed and pids[1] != killed, (i, pids)
    # at most what the dead worker could hold: what the executor hands the pool at a time (2 workers)
    assert len(repeated) <= 2 + roving.futures.EXTRA_QUEUED_CALLS


def test_a_call_that_kills_its_worker_every_time_fails_with_worker_lost_error_alone(backend):
    with Executor(2, max_task_retries=2) as ex:
        _warm(ex)
        good = [ex.submit(fx.sleep_then_return, 0.05, i) for i in range(10)]
        bad = ex.submit(fx.kill_self)
        more = [ex.submit(fx.square, i) for i in range(10)]
        with pytest.raises(roving.WorkerLostError):
            bad.result(TIMEOUT * 2)
        assert [f.result(TIMEOUT) for f in good] == list(range(10))
        assert [f.result(TIMEOUT) for f in more] == [i * i for i in range(10)]
        assert ex.submit(fx.square, 7).result(TIMEOUT) == 49
        assert list(ex.map(fx.square, range(5))) == [0, 1, 4, 9, 16]


def test_workers_that_cannot_start_break_the_executor_with_the_pools_reason():
    require("slurm")
    roving.init(backend="slurm", pool_start_failures=2)
    ex = Executor(1, resources={"memory": "10T"})  # more than the node has: sbatch refuses every worker
    f = ex.submit(fx.square, 3)
    with pytest.raises(BrokenProcessPool, match="cannot start"):
        f.result(TIMEOUT)
    assert isinstance(f.exception().__cause__, roving.PoolStartError)
    assert "Memory specification can not be satisfied" in str(f.exception().__cause__)
    with pytest.raises(BrokenProcessPool):
        ex.submit(fx.square, 3)
    ex.shutdown()


def test_map_progress_draws_a_bar_that_ends_with_the_total(capsys):
    with Executor(2) as ex:
        assert list(ex.map(fx.square, range(50), progress=True)) == [x * x for x in range(50)]
        assert list(ex.map(fx.square, range(40), chunksize=8, progress=True)) == [x * x for x in range(40)]
    err, deadline = "", time.monotonic() + TIMEOUT
    while not ("square: 50/50 100%" in err and "square: 40/40 100%" in err) and time.monotonic() < deadline:
        time.sleep(0.05)
        err += capsys.readouterr().err
    assert "square: 50/50 100%" in err and "square: 40/40 100%" in err, err


def test_resources_reach_the_workers_and_bad_ones_are_an_error_naming_them():
    with Executor(1, resources={"cpu": 1}) as ex:
        assert ex.submit(fx.square, 3).result(TIMEOUT) == 9
    ex = Executor(1, resources={"disk": 3})
    with pytest.raises(ValueError, match="disk"):
        ex.submit(fx.square, 3)
    ex.shutdown()


def test_import_roving_loads_neither_joblib_nor_the_executor_until_asked():
    import subprocess
    import sys

    code = ("import sys, roving; assert 'joblib' not in sys.modules and 'roving.futures' not in sys.modules; "
            "assert roving.futures.Executor.__name__ == 'Executor'; assert 'joblib' not in sys.modules; "
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_an_executor_dropped_without_shutdown_lets_its_pool_go_without_a_warning():
    import gc
    import warnings

    import weakref

    ex = Executor(1)
    assert ex.submit(fx.square, 6).result(TIMEOUT) == 36
    gone = weakref.ref(ex)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del ex
        gc.collect()
    assert gone() is None  # nothing the pool keeps holds the executor
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], caught


def test_thousands_of_cancelled_calls_drain_without_trouble(tmp_path):
    gate = tmp_path / "gate"
    with Executor(1) as ex:
        blocker = ex.submit(fx.wait_for, str(gate))
        rest = [ex.submit(fx.square, i) for i in range(3000)]
        assert all(f.cancel() for f in rest[100:])  # beyond what was handed to the pool
        gate.touch()
        assert blocker.result(TIMEOUT) == "done"
        assert [f.result(TIMEOUT) for f in rest[:16]] == [i * i for i in range(16)]
    assert all(f.done() for f in rest)
    assert all(f.cancelled() or f.result() == i * i for i, f in enumerate(rest))
