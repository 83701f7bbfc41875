"""A roving parent that starts children which report their pids and sleep; used by test_lifetimes.

usage: parent_with_children.py PIDFILE N_CHILDREN MODE [DAEMON] [HEARTBEAT PARENT_TIMEOUT]

MODE "sleep": after writing PIDFILE the parent sleeps (the test kills or stops it).
MODE "exit": after writing PIDFILE the parent returns normally.
PIDFILE gets the parent's pid on line 1, then one child pid a line, then "ready".
"""
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
