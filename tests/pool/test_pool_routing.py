"""Workers' messages reach their own pool through the node's ``pool`` service (no module-global registry),
and the upkeep's view of the workers is the dispatcher's one registry."""
from __future__ import annotations

import roving
from roving.pool._router import SERVICE, Router
from roving.transport import session

import helpers_pool as h
from helpers_core import TIMEOUT


def test_two_pools_of_one_node_get_only_their_own_results_and_a_finished_pool_leaves_the_service():
    node = session.current().node()
    with roving.Pool(2) as a, roving.Pool(1) as b:
        router = node.service(SERVICE, Router)
        assert isinstance(router, Router)
        assert a._disp._router is router and b._disp._router is router  # one service per node
        # interleaved work on both: every result goes to the pool that asked for it
        ra = a.map_async(h.square, range(40), chunksize=3)
        rb = b.starmap_async(h.add, [(i, 1) for i in range(20)])
        assert ra.get(TIMEOUT) == [i * i for i in range(40)]
        assert rb.get(TIMEOUT) == [i + 1 for i in range(20)]
        a.close()
        a.join(TIMEOUT)
        # a's dispatcher left the node's service; b still gets its messages there
        assert b.apply(h.square, (7,)) == 49
        pools = router._pools
        assert a._disp.pool_id not in pools and pools.get(b._disp.pool_id) is b._disp


def test_the_pools_worker_list_is_the_dispatchers_registry():
    with roving.Pool(2) as p:
        assert p.map(h.square, range(8)) == [i * i for i in range(8)]
        registered = p._disp.workers_now()
        assert {w.id for w in registered} == set(p._workers)
        assert all(p._workers[w.id] is w for w in registered)  # the same objects, no second table
        assert [w.proc for w in sorted(registered, key=lambda w: w.id)] == p._pool
