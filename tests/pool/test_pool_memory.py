"""Memory in a Pool on the local backend: heartbeats carry each worker's memory, worker_memory_limit
(max_memory_per_child) replaces a worker between tasks, and a task killed for memory in its worker's
cgroup fails with OutOfMemoryError after max_memory_kills workers, killing no more."""
from __future__ import annotations

import concurrent.futures
import os

import pytest

import helpers_memory as hm
import roving
from helpers_core import wait_until
from roving.futures import Executor

T = 60


def test_a_worker_above_worker_memory_limit_after_a_task_is_replaced_before_its_next_task():
    with roving.Pool(1, worker_memory_limit="100M") as pool:
        pids = [pool.apply(hm.grow_and_keep, (150,)) for _ in range(3)]
        # the last worker's BYE follows its result
        assert wait_until(lambda: pool._disp.figures()["memory_restarts"] == 3, T)
        figures = pool._disp.figures()
    assert len(set(pids)) == 3, "each task ran on a fresh worker: the one before was above the limit"
    assert figures["retried"] == 0 and figures["failed"] == 0


def test_a_worker_below_its_limit_is_kept_and_max_memory_per_child_is_the_same_option():
    with roving.Pool(1, max_memory_per_child="1G") as pool:
        pids = [pool.apply(hm.grow_and_keep, (20,)) for _ in range(3)]
        assert pool._disp.figures()["memory_restarts"] == 0
    assert len(set(pids)) == 1


@pytest.mark.parametrize("options, words", [
    ({"worker_memory_limit": "lots"}, "worker_memory_limit='lots' is not a memory size"),
    ({"max_memory_per_child": "3X"}, "max_memory_per_child='3X' is not a memory size"),
    ({"worker_memory_limit": "1G", "max_memory_per_child": "1G"}, "not both"),
    ({"max_memory_kills": 0}, "max_memory_kills must be an int of at least 1"),
])
def test_a_bad_memory_option_is_refused_naming_it(options, words):
    with pytest.raises(ValueError, match=words):
        roving.Pool(1, **options)


def test_heartbeats_carry_memory_and_the_figures_keep_each_workers_and_each_calls_peak():
    roving.init(heartbeat_interval=0.1)
    with roving.Pool(1) as pool:
        pool.apply(hm.use_for_a_while, (120, 1.0))
        figures = pool._disp.figures()
        worker = figures["workers"][0]
        assert worker["memory"] is not None and worker["memory"] > 0
        assert worker["peak_memory"] >= 120 * hm.MiB
        calls = [c for c in figures["calls"] if c["name"] == "use_for_a_while"]
        assert len(calls) == 1 and calls[0]["peak_memory"] >= 120 * hm.MiB


def _attempts(path):
    return len(os.listdir(path))


def test_a_task_killed_for_memory_twice_in_a_row_fails_saying_out_of_memory_with_its_limit(tmp_path):
    roving.init(memory="96M")
    with roving.Pool(2, max_task_retries=5) as pool:
        with pytest.raises(roving.OutOfMemoryError) as caught:
            pool.apply(hm.hog, (400, str(tmp_path)))
        err = caught.value
        assert "out of memory" in str(err) and "limit 96 MiB" in str(err) and "max_memory_kills=2" in str(err)
        assert err.limit == 96 * hm.MiB and err.peak is not None and err.peak >= 80 * hm.MiB
        assert isinstance(err, roving.WorkerLostError)
        assert _attempts(tmp_path) == 2, "no third worker was given the task"
        assert pool._disp.figures()["oom_kills"] == 2
        assert len(pool.map(hm.pid, range(4))) == 4  # the pool goes on, with new workers
        assert _attempts(tmp_path) == 2


def test_how_many_kills_in_a_row_is_configurable(tmp_path):
    roving.init(memory="96M")
    with roving.Pool(1, max_memory_kills=3, max_task_retries=10) as pool:
        with pytest.raises(roving.OutOfMemoryError, match="the 3 pool worker"):
            pool.apply(hm.hog, (400, str(tmp_path)))
    assert _attempts(tmp_path) == 3


def test_an_executors_call_that_runs_out_of_memory_is_the_one_error_and_a_broken_process_pool(tmp_path):
    roving.init(memory="96M")
    with Executor(1, max_memory_kills=1) as ex:
        future = ex.submit(hm.hog, 400, str(tmp_path))
        with pytest.raises(roving.OutOfMemoryError) as caught:
            future.result(T)
        assert isinstance(caught.value, concurrent.futures.process.BrokenProcessPool)
        assert caught.value.limit == 96 * hm.MiB
        assert ex.submit(hm.pid).result(T) > 0
    assert _attempts(tmp_path) == 1
