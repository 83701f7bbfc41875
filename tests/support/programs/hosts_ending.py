"""A roving parent for the cross-host time-limit test: a Pool of 1 worker on the multi-node Slurm runs one
long item; once it has started, the worker's job is sent SIGTERM with `scancel --signal=TERM --full` (as a
preemption would), and the item must finish on the replacement with max_task_retries=1 (only its first
run is long: the replacement's returns at once). Prints, as JSON, the hosts the item started on and the
pool's figures.

usage: hosts_ending.py MARKER_DIR
"""
import json
import os
import socket
import subprocess
import sys
import time

import roving
from helpers_core import wait_or_exit  # tests/support is on the program's PYTHONPATH


def long_item(marker_dir):
    """15 s on its first start (well past worker_grace: the worker sent SIGTERM cannot finish it in its
    grace, so hands it back); the replacement's run, which is left to complete, returns at once."""
    open(os.path.join(marker_dir, f"started-{socket.gethostname()}-{os.getpid()}"), "w").close()
    if len(os.listdir(marker_dir)) == 1:  # the hosts share one filesystem: every start's marker is here
        time.sleep(15)
    return socket.gethostname()




if __name__ == "__main__":
    marker_dir = sys.argv[1]
    roving.init(backend="slurm", worker_grace=2.0, child_output="off")
    with roving.Pool(1, max_task_retries=1) as pool:
        item = pool.apply_async(long_item, (marker_dir,))
        wait_or_exit(lambda: os.listdir(marker_dir), 120)
        (victim,) = [w for w in pool._pool if w.is_alive()]
        subprocess.run(["scancel", "--signal=TERM", "--full", str(victim.job.id)], check=True, timeout=30)
        finished_on = item.get(180)
        figures = pool._disp.figures()
    print(json.dumps({"started": sorted(os.listdir(marker_dir)), "finished_on": finished_on,
                      "retried": figures["retried"], "ended_early": figures["ended_early"],
                      "handed_back": figures["handed_back"]}))
