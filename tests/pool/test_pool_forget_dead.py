"""A pool's parent forgets workers killed before their goodbye (issue 22): its dispatcher's tables stay
bounded by the live workers while workers are killed and replaced. (The node's own table of
authenticated peers does not forget them yet: a first version that did, from ZeroMQ's DISCONNECTED
events, was taken out because the security fuzz test then hung; see the session note.)"""
from __future__ import annotations

import os
import signal

import roving
from helpers_core import TIMEOUT, wait_until

KILLS = 12


def _pid(_: int) -> int:
    return os.getpid()


def test_killed_workers_are_forgotten_by_the_dispatcher():
    with roving.Pool(2) as pool:
        assert pool.map(_pid, range(4))
        disp = pool._disp
        assert wait_until(lambda: disp.remembered() == (2, 2), TIMEOUT), disp.remembered()
        seen = set()
        for _ in range(KILLS):
            pid = pool.apply(_pid, (0,))
            seen.add(pid)
            os.kill(pid, signal.SIGKILL)
            # replaced, and the killed one forgotten: as many workers and identities as before
            assert wait_until(lambda: pid not in pool.map(_pid, range(8)) and disp.remembered() == (2, 2),
                              TIMEOUT), disp.remembered()
        assert len(seen) == KILLS  # each kill hit a new worker
        assert sorted(pool.map(abs, range(-50, 0))) == list(range(1, 51))  # and the pool still works
