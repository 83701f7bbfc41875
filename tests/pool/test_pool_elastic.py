"""roving.Pool's additions to multiprocessing's: autoscaling between (min, max), workers that fail to start,
resources for the worker jobs (Pool(resources=...) and @roving.meta), progress bars, and the
pool_heartbeat_timeout option."""
from __future__ import annotations

import io
import time

import pytest

import roving
import roving.pool
from roving import backends
from roving.pool._progress import Progress
import helpers_pool as h
from helpers_core import wait_until

T = 60


def _wait_for(predicate, timeout=T):
    return wait_until(predicate, timeout)


def _live(pool):
    return [w for w in list(pool._workers.values()) if not w.retiring]


def test_autoscaling_pool_grows_under_backlog_and_shrinks_to_min_when_idle():
    with roving.Pool((0, 3), idle_timeout=1.0) as p:
        assert p.processes == 0 and not p._workers  # min 0: no worker until there is work
        r = p.starmap_async(h.sleep_square, [(x, 0.3) for x in range(24)], chunksize=1)
        assert _wait_for(lambda: len(_live(p)) == 3, 30), len(_live(p))  # grew to max, not beyond
        assert r.get(T) == [x * x for x in range(24)]
        assert p.processes <= 3
        assert _wait_for(lambda: not p._workers, 20)  # idle 1 s: every worker left (min 0)
        assert p.processes == 0
        assert p.apply(h.square, (6,)) == 36  # and it grows again for new work


def test_worker_that_fails_to_start_is_retried_with_backoff_and_reported(monkeypatch):
    failures = []

    class Flaky(roving.Process):
        def start(self):
            if len(failures) < 2:
                failures.append(time.monotonic())
                raise OSError("the cluster said no")
            super().start()

    monkeypatch.setattr(roving.pool._upkeep, "Process", Flaky)  # the upkeep starts the workers
    start = time.monotonic()
    with roving.Pool(1) as p:
        assert p.apply(h.square, (3,), ) == 9
        assert len(failures) == 2
        assert [why for _, why in p.start_failures] == ["could not start a worker: the cluster said no"] * 2
        assert failures[1] - failures[0] >= 0.15  # a backoff between the tries
    assert time.monotonic() - start < 30


def _pool_specs(specs):
    return [s for s in specs if s.name.startswith("PoolWorker-")]


def test_pool_resources_become_the_worker_jobs_resource_request(specs):
    with roving.Pool(2, resources={"cpu": 2, "memory": "1G"}) as p:
        assert p.apply(h.square, (4,)) == 16
    assert [s.resources for s in _pool_specs(specs)] == [backends.Resources(cpu=2, memory=1 << 30, gpu=0)] * 2


def test_meta_on_the_task_function_reshapes_a_pool_without_resources(specs):
    with roving.Pool(1) as p:
        assert p.apply(h.square, (4,)) == 16
        assert p.map(h.square_needing_three_cpus, range(5)) == [x * x for x in range(5)]
        assert _wait_for(lambda: all(w.proc.job is not None for w in _live(p)))
    first, *later = _pool_specs(specs)
    cfg = roving.config.current()
    assert first.resources.cpu == cfg.cpu
    assert later and all(s.resources == backends.Resources(cpu=3, memory=256 << 20, gpu=cfg.gpu) for s in later)


def test_meta_that_a_pool_with_resources_cannot_cover_is_an_error():
    with roving.Pool(1, resources={"cpu": 2}) as p:
        with pytest.raises(ValueError, match="square_needing_three_cpus asks for"):
            p.apply_async(h.square_needing_three_cpus, (1,))
        with pytest.raises(ValueError, match="unknown resources"):
            roving.Pool(1, resources={"cpus": 2})
        with pytest.raises(ValueError, match="bad resources"):
            roving.meta(memory="lots")


def test_meta_takes_memory_with_its_unit_and_refuses_a_bare_number_naming_the_unit_to_write(specs):
    with roving.Pool(1) as p:
        assert p.apply(h.square_needing_one_and_a_half_gib, (3,)) == 9
    assert any(s.resources.memory == int(1.5 * 2**30) and s.resources.cpu == 1 for s in _pool_specs(specs))
    assert roving.meta(memory="512M", cpu=2, gpu=1)(lambda: None).__roving_meta__ == {
        "memory": "512M", "cpu": 2, "gpu": 1}  # cpu and gpu are still plain numbers
    for bare in (1000, 1.5, "1000", " 1000 "):
        with pytest.raises(ValueError, match=r"has no unit: write it with one, memory=\"1000M\"|memory=\"1.5M\""):
            roving.meta(memory=bare)


def test_process_resources_keyword_reaches_the_job_spec(specs):
    p = roving.Process(target=h.noop, resources={"cpu": 2.5})
    p.start()
    p.join(T)
    assert p.exitcode == 0
    (spec,) = [s for s in specs if s.name == p.name]
    assert spec.resources.cpu == 2.5


def test_map_progress_bar_shows_items_done_and_total(capsys):
    with roving.Pool(2) as p:
        assert p.map(h.square, range(50), progress=True) == [x * x for x in range(50)]
        err = capsys.readouterr().err
        assert "square: 50/50 100%" in err.splitlines()[-1] and "items/s" in err
        it = p.imap_unordered(h.sleep_square_1, (x for x in range(6)), progress=True)
        first = next(it)
        assert 1 <= it._progress.done < 6  # counts results as they arrive, not at the end
        assert sorted([first, *it]) == [x * x for x in range(6)]
        it._progress.join(5)
        lines = capsys.readouterr().err.splitlines()
        assert lines[-1].startswith("sleep_square_1: 6/6 100%")


def test_progress_line_has_rate_and_time_left():
    out = io.StringIO()
    bar = Progress(10, "f", stream=out, interval=0.01)
    bar.update(3)
    line = bar.line()
    assert line.startswith("f: 3/10  30%") and "items/s" in line and "left" in line
    bar.update(7)
    bar.join(5)
    assert out.getvalue().splitlines()[-1].startswith("f: 10/10 100%")
    unknown = Progress(None, "g", stream=io.StringIO())
    unknown.update(4)
    assert unknown.line().startswith("g: 4 |")
    unknown.set_total(4)
    unknown.join(5)


def test_pool_heartbeat_timeout_option_from_environment_and_init():
    cfg = roving.config.load(environ={"ROVING_POOL_HEARTBEAT_TIMEOUT": "2.5"})
    assert cfg.pool_heartbeat_timeout == 2.5
    with pytest.raises(roving.ConfigError, match="pool_heartbeat_timeout"):
        roving.config.load(environ={"ROVING_POOL_HEARTBEAT_TIMEOUT": "0"})
    assert roving.config.load(environ={}).pool_heartbeat_timeout == 30.0


def test_meta_covered_by_the_workers_does_not_reshape_the_pool():
    with roving.Pool(1, resources={"cpu": 4, "memory": "1G"}) as p:
        assert p.apply(h.square_needing_three_cpus, (5,)) == 25  # 3 CPUs, 256M: covered
    with roving.Pool(1) as p:
        before = set(p._workers)
        covered = roving.meta(cpu=roving.config.current().cpu)(h.noop)
        try:
            assert p.apply(covered, (1,)) == 1
            assert set(p._workers) == before  # nothing was replaced
        finally:
            del h.noop.__roving_meta__
