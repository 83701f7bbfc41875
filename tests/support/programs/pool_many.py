"""A pool of N real local workers started at once (a start storm on this machine's few cores), then a
map over them; prints one JSON line: how many connected, by name, and the map's results.

usage: pool_many.py N
"""
import json
import os
import sys
import time

import roving
import roving.observe


def where(i):
    time.sleep(0.01)
    return i, roving.current_process().name


def workers():
    return [w for p in roving.observe.snapshot()["pools"] for w in p.get("workers", [])]


if __name__ == "__main__":
    n = int(sys.argv[1])
    roving.init(backend="local")
    with roving.Pool(n) as pool:
        deadline = time.monotonic() + 200  # (within the test's own timeout: what it printed is shown)
        while sum(w["state"] != "starting" for w in workers()) < n and time.monotonic() < deadline:
            time.sleep(0.2)
        connected = sorted(w["name"] for w in workers() if w["state"] != "starting")
        results = pool.map(where, range(5 * n), chunksize=1)
    print(json.dumps({"connected": connected, "results": results, "pid": os.getpid()}))
