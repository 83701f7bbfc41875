"""A roving parent on a given backend: starts N children that sleep, writes their job ids, then sleeps.

usage: backend_parent.py OUTFILE BACKEND N OPTIONS_JSON
"""
import json
import os
import sys
import time

import roving


def child(q):
    q.put(os.getpid())
    time.sleep(300)


if __name__ == "__main__":
    outfile, backend, n, options = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    roving.init(backend=backend, child_output="off", **options)
    q = roving.Queue()
    procs = [roving.Process(target=child, args=(q,)) for _ in range(n)]
    for p in procs:
        p.start()
    for _ in procs:
        q.get(timeout=120)
    with open(outfile + ".tmp", "w") as f:
        f.write("\n".join([str(os.getpid()), *(p.job.id for p in procs)]) + "\n")
    os.replace(outfile + ".tmp", outfile)
    time.sleep(300)
