"""A pool's parent forgets workers killed before their goodbye (issue 22): its dispatcher's tables and
its node's authenticated peers stay bounded by the live workers while workers are killed and replaced.
Workers talk over streams where the node has a listener (their ZeroMQ connection only asks where it is),
so the node's peers are counted both ways. (The node alone, over 200 kills:
tests/transport/test_forget_dead.py for ZeroMQ peers, tests/transport/test_channel.py for streams.)"""
from __future__ import annotations

import os
import signal

import roving
from helpers_core import TIMEOUT, wait_until
from roving.transport import session as _session

KILLS = 12


def _pid(_: int) -> int:
    return os.getpid()


def _known(node) -> int:
    return node.known_peers() + node.known_channels()


def test_killed_workers_are_forgotten_by_dispatcher_and_node():
    node = _session.current().node()
    before = _known(node)  # whatever else talks to this process
    with roving.Pool(2) as pool:
        assert pool.map(_pid, range(4))
        disp = pool._disp
        assert wait_until(lambda: disp.remembered() == (2, 2), TIMEOUT), disp.remembered()
        base = before + 2 * 2  # each worker: its work connection and its heartbeat connection
        assert wait_until(lambda: _known(node) == base, TIMEOUT), (_known(node), base)
        seen = set()
        for _ in range(KILLS):
            pid = pool.apply(_pid, (0,))
            seen.add(pid)
            os.kill(pid, signal.SIGKILL)
            # replaced, and the killed one forgotten: as many workers and identities as before
            assert wait_until(lambda: pid not in pool.map(_pid, range(8)) and disp.remembered() == (2, 2)
                              and _known(node) <= base, TIMEOUT), (disp.remembered(), _known(node), base)
        assert len(seen) == KILLS  # each kill hit a new worker
        assert sorted(pool.map(abs, range(-50, 0))) == list(range(1, 51))  # and the pool still works
