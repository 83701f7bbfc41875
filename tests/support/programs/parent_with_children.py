"""A roving parent that starts children which report their pids and sleep; used by test_lifetimes.

usage: parent_with_children.py PIDFILE N_CHILDREN MODE [DAEMON] [HEARTBEAT PARENT_TIMEOUT]

MODE "sleep": after writing PIDFILE the parent sleeps (the test kills or stops it).
MODE "exit": after writing PIDFILE the parent returns normally.
MODE "busy": after writing PIDFILE the parent computes in C code holding its interpreter's lock for
seconds, then writes how long to PIDFILE.busy and sleeps.
PIDFILE gets the parent's pid on line 1, then one child pid a line, then "ready".
"""
import math
import os
import sys
import time

import roving


def child(q):
    q.put(os.getpid())
    time.sleep(120)


if __name__ == "__main__":
    pidfile, n, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    daemon = len(sys.argv) > 4 and sys.argv[4] == "daemon"
    options = {"child_output": "off"}
    if len(sys.argv) > 6:
        options.update(heartbeat_interval=float(sys.argv[5]), parent_timeout=float(sys.argv[6]))
    roving.init(**options)
    q = roving.Queue()
    procs = [roving.Process(target=child, args=(q,), daemon=daemon) for _ in range(n)]
    for p in procs:
        p.start()
    pids = sorted(q.get(timeout=60) for _ in procs)
    assert pids == sorted(p.pid for p in procs)
    with open(pidfile + ".tmp", "w") as f:
        f.write("\n".join(map(str, [os.getpid(), *pids, "ready"])) + "\n")
    os.replace(pidfile + ".tmp", pidfile)
    if mode == "sleep":
        time.sleep(120)
    elif mode == "busy":  # holds the interpreter's lock in C code for seconds: no thread answers meanwhile
        start = time.monotonic()
        math.factorial(700_000)
        with open(pidfile + ".busy.tmp", "w") as f:
            f.write(f"{time.monotonic() - start:.2f}\n")
        os.replace(pidfile + ".busy.tmp", pidfile + ".busy")
        time.sleep(120)
