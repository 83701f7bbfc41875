"""A roving parent whose Pool(N) on Slurm is one job array: writes its pid and the tasks' ids once every
worker runs a long task, then sleeps (a test kills it with SIGKILL).

The workers would notice on their own that the parent is gone (their stream to it ends, its pings go
unanswered); a long ``parent_timeout`` and a task in every worker keep them from it, so that what ends
the tasks is the watcher that cancels a parent's jobs, which the test means to show.

usage: slurm_array_parent.py OUTFILE N
"""
import os
import sys
import time

import roving

if __name__ == "__main__":
    outfile, n = sys.argv[1], int(sys.argv[2])
    roving.init(backend="slurm", cpu=1, memory="100M", child_output="off", parent_timeout=600)
    pool = roving.Pool(n)
    pool.map_async(time.sleep, [300] * n, chunksize=1)
    deadline = time.monotonic() + 120
    while sum(1 for w in pool._workers.values() if w.ident is not None and w.units) < n \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(outfile + ".tmp", "w") as f:
        f.write("\n".join([str(os.getpid()), *(p.job.id for p in pool._pool)]) + "\n")
    os.replace(outfile + ".tmp", outfile)
    time.sleep(300)
