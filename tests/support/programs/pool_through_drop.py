"""A pool whose workers reach the parent through forwarders that cut every connection mid-map.

Pool workers ask the parent's node over ZeroMQ where its stream listener is, then talk over streams:
one forwarder stands before the node's ZeroMQ address, another before its stream listener (the node
names that one when asked), so that every connection of the workers started here passes a forwarder.

Run by tests/transport/test_transport_drops.py with ROVING_POOL_HEARTBEAT_TIMEOUT=600, so that the pool's last
resort (killing a worker that sent no heartbeat for that long) cannot be what finishes the map. Prints
one JSON line: the results, how many connections were cut, and the workers that ran.
"""
import json
import os
import sys
import tempfile
import time

import roving
from helpers_net import CuttingProxy, NodeVia
from helpers_pool import slow_square_counting


def main():
    log_dir = tempfile.mkdtemp()
    with roving.Pool(1) as pool:
        pool.map(abs, [1])  # worker 1 connected (its process knows the real listener): it stays direct
        node = pool._disp.node
        zproxy = CuttingProxy(node.address)
        listener = node.streams()
        proxy = CuttingProxy(listener.address)
        listener.address = proxy.address  # what the node answers when asked where its listener is
        pool._disp.node = NodeVia(node, zproxy.address)
        pool.resize(3)  # two more workers, both channels (work, heartbeats) through the forwarder
        items = list(range(120))
        result = pool.starmap_async(slow_square_counting, [(x, 0.05, log_dir) for x in items], chunksize=1)
        deadline = time.monotonic() + 60
        while proxy.open_connections() < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the workers behind the forwarder are running items now
        cut = proxy.cut() + zproxy.cut()
        values = result.get(timeout=120)
        # Idle now: no work will come to make the workers talk. They say a word on their connection
        # every second all the same, so a connection cut now is found and re-made without any work.
        via = {w.id: w.ident for w in pool._disp.workers.values() if w.id != 1}
        proxy.cut()
        zproxy.cut()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(
                pool._disp.workers[i].ident == ident for i, ident in via.items() if i in pool._disp.workers):
            time.sleep(0.05)
        idle_reconnected = all(pool._disp.workers[i].ident != ident for i, ident in via.items())
        ran = {}
        for name in os.listdir(log_dir):
            x = int(name.split(".")[0])
            ran[x] = ran.get(x, 0) + 1
    print(json.dumps({"values": values, "cut": cut, "idle_reconnected": idle_reconnected,
                      "missing": [x for x in items if x not in ran]}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
