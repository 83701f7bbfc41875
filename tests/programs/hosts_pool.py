"""A roving parent on the multi-node Slurm of the test hosts: a Pool of N workers, first N items held at
once (a Barrier: so they run on N workers together, one per node), then a map; prints what ran where, as JSON.

usage: hosts_pool.py HOST N   (HOST: the address this parent listens on; SLURM_CONF set by the caller)
"""
import json
import socket
import sys

import roving


def meet(barrier, x):
    barrier.wait(60)
    return socket.gethostname(), x * x


def where(x):
    return socket.gethostname(), x * x


if __name__ == "__main__":
    address, n = sys.argv[1], int(sys.argv[2])
    # one worker per host: a worker has a node to itself
    roving.init(backend="slurm", host=address, child_output="off", slurm_options="--exclusive")
    with roving.Pool(n) as pool:
        barrier = roving.Barrier(n)
        met = pool.starmap(meet, [(barrier, x) for x in range(n)], chunksize=1)
        results = pool.map(where, range(4 * n))
    print(json.dumps({"parent": socket.gethostname(), "met": met, "results": results}))
