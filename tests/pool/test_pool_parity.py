"""Pool behaviours checked the way CPython's own multiprocessing tests check them, on the local backend
and on the real single-node Slurm."""
from __future__ import annotations

import gc
import time
import warnings

import pytest

import roving
from roving.pool import RUN
from helpers_backends import require
from helpers_core import TIMEOUT
from helpers_pool import square


@pytest.fixture(params=["local", "slurm"])
def backend(request):
    require(request.param)
    roving.init(backend=request.param)
    return request.param


def test_pool_list_holds_the_running_workers_and_after_close_join_none_is_alive(backend):
    pool = roving.Pool(2)
    try:
        assert pool.map(square, range(8)) == [x * x for x in range(8)]
        workers = pool._pool
        assert len(workers) == 2
        assert all(isinstance(w, roving.Process) and w.is_alive() for w in workers)
        pool.close()
        pool.join(TIMEOUT)
        assert len(pool._pool) == 2
        assert [w.is_alive() for w in pool._pool] == [False, False]
    finally:
        pool.terminate()


def test_pool_list_after_terminate_join_has_no_live_worker(backend):
    pool = roving.Pool(2)
    pool.map(square, range(4))
    pool.terminate()
    pool.join(TIMEOUT)
    assert len(pool._pool) == 2
    assert not any(w.is_alive() for w in pool._pool)


def test_pool_list_replaces_recycled_workers_with_maxtasksperchild(backend):
    # multiprocessing's test_pool_worker_lifetime: the workers after the work are new ones, as many
    pool = roving.Pool(2, maxtasksperchild=1)
    try:
        first = {id(w) for w in pool._pool}
        assert len(first) == 2
        assert pool.map(square, range(6), chunksize=1) == [x * x for x in range(6)]
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            now = pool._pool
            if len(now) == 2 and not first & {id(w) for w in now} and all(w.is_alive() for w in now):
                break
            time.sleep(0.1)
        now = pool._pool
        assert len(now) == 2 and not first & {id(w) for w in now}
    finally:
        pool.terminate()
        pool.join(TIMEOUT)


def test_running_pool_collected_unclosed_gives_resource_warning_and_its_workers_end(backend):
    pool = roving.Pool(2)
    assert pool.map(square, [3]) == [9]
    workers = pool._pool
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del pool
        gc.collect()
    assert any(issubclass(w.category, ResourceWarning)
               and "unclosed running multiprocessing pool" in str(w.message) for w in caught), caught
    del caught  # a recorded warning holds its source, the pool: let it go
    gc.collect()
    for w in workers:
        w.join(TIMEOUT)
        assert w.exitcode is not None, f"{w} still runs after its pool was collected"


def test_resource_warning_as_multiprocessings_test_forces_it(backend):
    # multiprocessing's test_resource_warning: terminated and joined, then the state forced back to RUN
    pool = roving.Pool(1)
    pool.terminate()
    pool.join(TIMEOUT)
    pool._state = RUN
    with pytest.warns(ResourceWarning, match="unclosed running multiprocessing pool"):
        pool = None
        gc.collect()


def test_closed_pool_dropped_before_its_work_is_done_still_delivers(backend):
    pool = roving.Pool(2)
    result = pool.map_async(square, range(20))
    pool.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)  # closed: no warning
        del pool
        gc.collect()
    assert result.get(TIMEOUT) == [x * x for x in range(20)]


@pytest.mark.filterwarnings("ignore:unclosed running multiprocessing pool:ResourceWarning")
def test_a_pending_result_keeps_an_otherwise_unreferenced_pool_working(backend):
    # as multiprocessing's results hold their pool: Pool(...).map_async(...) without a name for the pool
    result = roving.Pool(2).map_async(square, range(10))
    gc.collect()
    assert result.get(TIMEOUT) == [x * x for x in range(10)]
    it = roving.Pool(2).imap(square, iter(range(5)))
    gc.collect()
    assert list(it) == [x * x for x in range(5)]
    single = roving.Pool(1).apply_async(square, (7,))
    gc.collect()
    assert single.get(TIMEOUT) == 49
