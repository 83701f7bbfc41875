"""A roving parent for the cross-host tests: a Pool of N workers; the first N items are held at once
(a Barrier), so they run on N workers together; then a map. Prints, as JSON, the parent's hostname and
for each item the worker's hostname, its address (what its hostname resolves to) and the result.

usage: hosts_pool.py OPTIONS_JSON N   (OPTIONS_JSON: roving.init's keyword arguments)

A program of its own because a process's roving endpoint binds once, with the options of its first use:
a test process that has already used roving with other options cannot be the parent here.
"""
import json
import socket
import sys

import roving


def where(x):
    name = socket.gethostname()
    return name, socket.gethostbyname(name), x * x


def meet(barrier, x):
    barrier.wait(60)
    return where(x)


if __name__ == "__main__":
    options, n = json.loads(sys.argv[1]), int(sys.argv[2])
    roving.init(child_output="off", **options)
    with roving.Pool(n) as pool:
        barrier = roving.Barrier(n)
        met = pool.starmap_async(meet, [(barrier, x) for x in range(n)], chunksize=1).get(120)
        results = pool.map_async(where, range(4 * n)).get(120)
    print(json.dumps({"parent": socket.gethostname(), "met": met, "results": results}))
