"""The pool's upkeep looks at a worker only when something happens to it (issue 22: idle connected workers
cost the parent nothing per second but their heartbeats): its job ended (the sentinel fired), its
heartbeat deadline came, or its process offers no sentinel. Counted, not timed: the upkeep's ``checks``
and the workers' ``is_alive()`` calls over many rounds."""
from __future__ import annotations

import os
import signal
import threading

import roving
from roving.pool import _upkeep
from helpers_core import TIMEOUT, wait_until

WORKERS = 6


def _pid(_: int) -> int:
    return os.getpid()


def _connected(pool: roving.Pool) -> bool:
    return sum(1 for w in pool._disp.workers_now() if w.ident is not None) == WORKERS


def _counting(monkeypatch):
    """Count the upkeep's rounds and every is_alive() of a roving.Process in this process."""
    rounds, asked = [0], [0]
    lock = threading.Lock()
    once, is_alive = _upkeep.Upkeep.once, roving.Process.is_alive

    def counted_once(self):
        with lock:
            rounds[0] += 1
        return once(self)

    def counted_is_alive(self):
        with lock:
            asked[0] += 1
        return is_alive(self)

    monkeypatch.setattr(_upkeep.Upkeep, "once", counted_once)
    monkeypatch.setattr(roving.Process, "is_alive", counted_is_alive)
    return rounds, asked


def test_idle_rounds_look_at_no_worker(monkeypatch):
    rounds, asked = _counting(monkeypatch)
    with roving.Pool(WORKERS) as pool:
        assert wait_until(lambda: _connected(pool), TIMEOUT)
        assert pool.map(abs, range(-40, 0), chunksize=1) == list(range(40, 0, -1))
        upkeep = pool._upkeep
        checks0, rounds0, asked0 = upkeep.checks, rounds[0], asked[0]
        # at least 15 rounds (one every 0.1 s) with every worker connected and idle
        assert wait_until(lambda: rounds[0] - rounds0 >= 15, TIMEOUT)
        assert upkeep.checks == checks0  # no worker looked at ...
        assert asked[0] == asked0  # ... nor its job asked whether it lives
        assert _connected(pool) and pool._disp.live() == WORKERS


def test_a_killed_worker_is_found_through_its_sentinel_and_replaced(monkeypatch):
    rounds, asked = _counting(monkeypatch)
    with roving.Pool(WORKERS) as pool:
        assert wait_until(lambda: _connected(pool), TIMEOUT)
        pids = set(pool.map(_pid, range(60), chunksize=1))
        upkeep = pool._upkeep
        victim = next(w for w in pool._disp.workers_now())
        checks0, rounds0 = upkeep.checks, rounds[0]
        os.kill(victim.proc.pid, signal.SIGKILL)
        assert wait_until(lambda: pool._disp.worker(victim.id) is None and _connected(pool), TIMEOUT)
        assert upkeep.lost == 1
        # the rounds meanwhile looked at the killed worker (until its end was known), not at every worker
        assert rounds[0] > rounds0
        assert 1 <= upkeep.checks - checks0 <= rounds[0] - rounds0 + 1
        assert victim.proc.pid in pids and victim.proc.pid not in set(pool.map(_pid, range(60), chunksize=1))
        assert sorted(pool.map(abs, range(-30, 0))) == list(range(1, 31))


def test_silent_worker_is_found_at_its_heartbeat_deadline(monkeypatch):
    """SIGSTOP keeps the job running (no sentinel fires): the heartbeat deadline finds it, and checks
    grow with deadlines (one per worker per timeout), not with rounds times workers."""
    # 4 heartbeats' time: a loaded machine delays some beats of healthy workers by more than one
    monkeypatch.setattr(roving.config, "_current",
                        roving.config.current().replace("test", pool_heartbeat_timeout=4.0))
    rounds, _ = _counting(monkeypatch)
    with roving.Pool(WORKERS) as pool:
        assert wait_until(lambda: _connected(pool), TIMEOUT)
        upkeep = pool._upkeep
        victim = next(w for w in pool._disp.workers_now())
        checks0, rounds0 = upkeep.checks, rounds[0]
        os.kill(victim.proc.pid, signal.SIGSTOP)
        try:
            assert wait_until(lambda: pool._disp.worker(victim.id) is None, TIMEOUT)
            assert wait_until(lambda: _connected(pool), TIMEOUT)
            assert upkeep.lost == 1
            spent = rounds[0] - rounds0
            assert spent >= 15  # 4 s of silence at least: many rounds
            # about one look per worker per second here (deadlines), where a scan makes one per round
            assert upkeep.checks - checks0 < 2 * spent < WORKERS * spent
        finally:
            try:
                os.kill(victim.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert pool.apply(abs, (-3,)) == 3


def test_live_counts_the_workers_not_retiring_without_a_scan():
    with roving.Pool(WORKERS) as pool:
        assert wait_until(lambda: _connected(pool), TIMEOUT)
        disp = pool._disp
        assert disp.live() == WORKERS
        pool.resize(2)  # retires 4 at once; they leave once idle
        assert disp.live() == 2 == sum(1 for w in disp.workers_now() if not w.retiring)
        assert wait_until(lambda: len(disp.workers_now()) == 2, TIMEOUT)
        assert disp.live() == 2
        pool.resize(3)  # and one more is started, not five
        assert wait_until(lambda: sum(1 for w in disp.workers_now() if w.ident is not None) == 3, TIMEOUT)
        assert disp.live() == 3 == len(disp.workers_now())
        assert pool.map(abs, range(-9, 0)) == list(range(9, 0, -1))
