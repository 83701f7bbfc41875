"""A roving program run inside a Slurm allocation (sbatch) by tests/backends/test_slurm_step.py: its Pool on
the slurm backend starts as srun job steps. Writes what it saw as JSON to OUTFILE.

usage: slurm_step_program.py OUTFILE map|kill|killremote|resize|toobig|hold|process N [RUNS_DIR]

killremote: as kill, but the tasks count as on another host, so that they are signalled through srun
(as a task on another node of the allocation is). hold: writes the step ids once its pool is up, then sleeps.
"""
import json
import os
import signal
import subprocess
import sys
import time

import helpers_pool as hp
import roving
from roving.backends.slurm import step as slurm_step
from roving.pool import PoolStartError

T = 120


def step_task(x):
    """x squared, with the step and task this worker runs as; prints a line (prefixed by its process)."""
    print(f"item {x} on task {os.environ.get('SLURM_PROCID')}")
    time.sleep(0.05)
    return x * x, os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_STEP_ID"), os.environ.get("SLURM_PROCID")


def say_and_exit(code):
    print("said by the lone process")
    sys.exit(code)


def steps() -> list:
    """squeue's steps of this allocation: [step id, name, tasks]."""
    out = subprocess.run(["squeue", "-h", "-s", "-j", os.environ["SLURM_JOB_ID"],
                          "-O", "StepId:|,StepName:|,NumTasks:|"],
                         capture_output=True, text=True, timeout=30).stdout
    rows = [[p.strip() for p in line.split("|")][:3] for line in out.splitlines()]
    return [r for r in rows if len(r) == 3 and not r[0].endswith((".batch", ".extern"))]


def live(pool) -> list:
    return [w for w in pool._workers.values() if not w.retiring and w.ident is not None]


def wait_for(cond, timeout=T) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def main() -> None:
    outfile, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    roving.init(backend="slurm", cpu=1, memory="100M", pool_start_failures=1 if mode == "toobig" else 5)
    got = {"job": os.environ["SLURM_JOB_ID"]}
    if mode == "toobig":
        got["error"] = None
        try:
            with roving.Pool(n) as p:
                p.map(hp.square, range(4), chunksize=1)
        except PoolStartError as exc:
            got["error"] = str(exc)
    elif mode == "map":
        got["cpu_count"] = roving.cpu_count()
        with roving.Pool(n) as p:
            got["connected"] = wait_for(lambda: len(live(p)) == n)
            got["steps"] = steps()
            got["ids"] = [proc.job.id for proc in p._pool]
            got["results"] = p.map(step_task, range(4 * n), chunksize=1)
    elif mode in ("kill", "killremote"):
        runs = sys.argv[4]
        if mode == "killremote":
            slurm_step.this_host = lambda: "not-the-tasks-host"
        with roving.Pool(n) as p:
            got["connected"] = wait_for(lambda: len(live(p)) == n)
            got["steps_before"] = steps()
            r = p.starmap_async(hp.slow_square_counting, [(x, 0.3, runs) for x in range(10 * n)], chunksize=1)
            found = []  # a worker holding work, as seen once
            wait_for(lambda: found.append(next((w for w in live(p) if w.units), None)) or found[-1] is not None)
            victim = found[-1]
            got["victim"] = victim.proc.job.id
            if mode == "kill":
                os.kill(victim.proc.pid, signal.SIGKILL)  # the task's process, on this node
            else:
                assert victim.proc.pid is None  # not a process of this machine
                victim.proc.kill()
            got["results"] = r.get(T)
            got["replaced"] = wait_for(lambda: len(live(p)) == n)
            got["exitcode"] = victim.proc.exitcode
            got["steps_after"] = steps()
            got["ids_after"] = [proc.job.id for proc in p._pool]
        got["steps_gone"] = wait_for(lambda: not steps(), 60)  # the pool's end stopped all of them
    elif mode == "resize":
        with roving.Pool(2) as p:
            wait_for(lambda: len(live(p)) == 2)
            p.resize(n)
            got["connected"] = wait_for(lambda: len(live(p)) == n)
            got["steps"] = steps()
            got["results"] = p.map(hp.square, range(30))
    elif mode == "process":
        p = roving.Process(target=say_and_exit, args=(n,), name="lone")
        p.start()
        p.join(T)
        got["exitcode"] = p.exitcode
        roving.init(child_output="files", log_dir="logs")
        p = roving.Process(target=say_and_exit, args=(0,), name="logged")
        p.start()
        p.join(T)
        got["logged_exitcode"] = p.exitcode
        got["logged"] = open(os.path.join("logs", "logged.log")).read()
        roving.init(slurm_options="--no-such-srun-option")
        try:
            roving.Process(target=say_and_exit, args=(0,), name="refused").start()
            got["refused"] = None
        except OSError as exc:
            got["refused"] = f"{type(exc).__name__}: {exc}"
    elif mode == "hold":
        p = roving.Pool(n)
        got["connected"] = wait_for(lambda: len(live(p)) == n)
        got["steps"] = steps()
        with open(outfile + ".tmp", "w") as f:
            json.dump(got, f)
        os.replace(outfile + ".tmp", outfile)
        time.sleep(300)
    with open(outfile + ".tmp", "w") as f:
        json.dump(got, f)
    os.replace(outfile + ".tmp", outfile)


if __name__ == "__main__":
    main()
