"""A program with roving Pools on a backend, ended by the program itself or, in part, from outside.

usage: pool_ends.py BACKEND MODE
MODE "own": a pool used in a ``with`` block (terminated at its end), one closed and joined, one left
running at the program's exit: the pools end their own workers.
MODE "outside": a pool of two workers both told from outside that they will end (SIGTERM to each, as
a time limit or a preemption sends; on Slurm ``scancel --signal=TERM --full``); it goes on with their
replacements, then is closed and joined.
Prints "the program's last line" last.
"""
import os
import signal
import subprocess
import sys
import time

import roving


def square(x):
    return x * x


def told(pool, worker):
    if roving.backends.get(roving.config.current().backend).name == "slurm":
        subprocess.run(["scancel", "--signal=TERM", "--full", str(worker.job.id)], check=True, timeout=30)
    else:
        os.kill(worker.pid, signal.SIGTERM)


if __name__ == "__main__":
    backend, mode = sys.argv[1], sys.argv[2]
    roving.init(backend=backend, child_output="prefix", worker_grace=5.0)
    if mode == "own":
        with roving.Pool(2) as pool:
            assert pool.map(square, range(10)) == [x * x for x in range(10)]
        closed = roving.Pool(2)
        assert closed.map(square, range(10)) == [x * x for x in range(10)]
        closed.close()
        closed.join()
        left = roving.Pool(2)
        assert left.map(square, range(10)) == [x * x for x in range(10)]
    else:
        pool = roving.Pool(2)
        assert pool.map(square, range(10)) == [x * x for x in range(10)]
        deadline = time.monotonic() + 120
        while sum(1 for w in pool._workers.values() if w.ident is not None) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)  # both connected (and so watching for the signal)
        workers = list(pool._pool)
        for worker in workers:
            told(pool, worker)
        deadline = time.monotonic() + 120
        while pool._disp.figures()["ended_early"] < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pool._disp.figures()["ended_early"] == 2, pool._disp.figures()
        assert pool.map(square, range(10)) == [x * x for x in range(10)]  # on their replacements
        pool.close()
        pool.join()
    print("the program's last line", flush=True)
