"""A roving program whose children run on the test hosts' multi-node Slurm (tests/hosts/test_many_hosts.py).

``across_hosts.py SCENARIO``: run on one test host (the login host) with SLURM_CONF of that cluster; it
sets nothing about addresses (``host``/``advertise`` stay ``auto``) and prints one JSON line of what it
saw. Every function a child runs reports the host name it ran on.
"""
import json
import os
import socket
import sys
import threading
import time

import numpy as np

import roving

PARTITION = os.environ.get("ACROSS_PARTITION", "hosts")
COMPUTE = os.environ.get("ACROSS_COMPUTE", "rv-h1,rv-h2,rv-h3").split(",")


def on(host):
    """Children started from now on run on ``host`` (one of the compute hosts)."""
    roving.init(slurm_options=f"--nodelist={host}")


def anywhere():
    roving.init(slurm_options="")


# -- what children run ------------------------------------------------------------------------------

def where(x):
    time.sleep(0.02)
    return x * x, socket.gethostname()


def where2(a, b):
    return a + b, socket.gethostname()


def fail_on(x):
    if x == 3:
        raise ValueError(f"three on {socket.gethostname()}")
    return x


def report(q, code):
    from roving.transport import session

    q.put({"host": socket.gethostname(), "address": session.current().node().address,
           "parent": roving.parent_process().name})
    print(f"line from {socket.gethostname()}", flush=True)
    sys.exit(code)


def own_queue(back, joinable, n):
    q = roving.JoinableQueue() if joinable else roving.Queue()
    back.put((q, socket.gethostname()))
    got = []
    for _ in range(n):
        got.append(q.get(timeout=60))
        if joinable:
            q.task_done()
    back.put(sorted(map(tuple, got)))
    time.sleep(1.0 if not joinable else 0)


def put_to(q, i, joinable):
    q.put((i, socket.gethostname()))
    if joinable:
        q.join(timeout=60)


def pipe_end(conn, first, out):
    big = np.arange(1 << 20, dtype=np.float32)  # 4 MiB
    if first:
        conn.send(("hello from", socket.gethostname()))
        conn.send(big)
        out.put(("first got", conn.recv()))
    else:
        hello = conn.recv()
        arr = conn.recv()
        conn.send((hello, float(arr.sum()), socket.gethostname()))


def use_manager(d, lst, i):
    d[socket.gethostname()] = i
    lst.append(socket.gethostname())


def sync_worker(lock, event, barrier, value, out):
    event.wait(60)
    for _ in range(50):
        with lock:
            value.value += 1
    barrier.wait(60)
    out.put(socket.gethostname())


_kept = []


def read_shared(handle):
    """The data's sum, with where this worker read it from: the shared-memory files it has mapped (name
    and inode, from /proc/self/maps) and the device of its /dev/shm (one tmpfs per test host)."""
    arr = handle.get()
    _kept.append(arr)  # a worker keeps using the data (as the ES demo keeps its noise table)
    maps = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].startswith("/dev/shm/rv-"):
                maps.add((parts[5], int(parts[4])))
    time.sleep(0.05)
    return float(arr.sum()), socket.gethostname(), sorted(maps), os.stat("/dev/shm").st_dev, os.getpid()


# -- scenarios ----------------------------------------------------------------------------------------

def pool_scenario():
    out = {}
    items = list(range(40))
    want = [x * x for x in items]
    with roving.Pool(3) as pool:
        res = pool.map(where, items, chunksize=1)
        out["map"] = [r for r, _ in res] == want
        out["hosts"] = sorted({h for _, h in res})
        out["imap"] = [r for r, _ in pool.imap(where, items)] == want
        out["imap_unordered"] = sorted(r for r, _ in pool.imap_unordered(where, items, chunksize=2)) == want
        out["starmap"] = [r for r, _ in pool.starmap(where2, [(i, i) for i in items])] == [2 * i for i in items]
        called, errors = [], []
        done = threading.Event()
        pool.map_async(where, items, callback=lambda rs: (called.append(len(rs)), done.set()))
        done.wait(60)
        out["map_async_callback"] = called == [len(items)]
        r = pool.apply_async(fail_on, (3,), error_callback=errors.append)
        try:
            r.get(60)
        except ValueError as exc:
            out["remote_error"] = str(exc)
        out["error_callback"] = [type(e).__name__ for e in errors]
        pool.resize(5)
        res = pool.map(where, items, chunksize=1)
        out["after_grow"] = [r for r, _ in res] == want
        pool.resize(2)
        out["after_shrink"] = [r for r, _ in pool.map(where, items)] == want
    with roving.Pool(processes=(1, 3), idle_timeout=2) as pool:
        res = pool.map(where, range(60), chunksize=1)
        out["autoscale"] = [r for r, _ in res] == [x * x for x in range(60)]
        out["autoscale_hosts"] = sorted({h for _, h in res})
    return out


def process_scenario():
    q = roving.Queue()
    out = {"children": []}
    procs = []
    for i, host in enumerate(COMPUTE):
        on(host)
        p = roving.Process(target=report, args=(q, i))
        p.start()
        procs.append(p)
    for _ in procs:
        out["children"].append(q.get(timeout=60))
    for p in procs:
        p.join(60)
    out["exitcodes"] = [p.exitcode for p in procs]
    on(COMPUTE[0])
    p = roving.Process(target=time.sleep, args=(60,))
    p.start()
    time.sleep(1.0)
    p.terminate()
    p.join(60)
    out["terminated"] = p.exitcode
    return out


def queue_scenario(joinable):
    back = roving.Queue()
    on(COMPUTE[0])
    owner = roving.Process(target=own_queue, args=(back, joinable, 2))
    owner.start()
    q, owner_host = back.get(timeout=60)
    users = []
    for i, host in enumerate(COMPUTE[1:3], 1):
        on(host)
        p = roving.Process(target=put_to, args=(q, i, joinable))
        p.start()
        users.append(p)
    got = back.get(timeout=60)
    for p in (owner, *users):
        p.join(60)
    return {"owner": owner_host, "address": q._address, "got": got,
            "exitcodes": [p.exitcode for p in (owner, *users)]}


def pipe_scenario():
    a, b = roving.Pipe()
    out_q = roving.Queue()
    on(COMPUTE[1])
    p1 = roving.Process(target=pipe_end, args=(a, True, out_q))
    p1.start()
    on(COMPUTE[2])
    p2 = roving.Process(target=pipe_end, args=(b, False, out_q))
    p2.start()
    got = out_q.get(timeout=60)
    p1.join(60)
    p2.join(60)
    return {"got": got, "exitcodes": [p1.exitcode, p2.exitcode]}


def manager_scenario():
    on(COMPUTE[0])  # the manager's server process
    with roving.Manager() as manager:
        d, lst = manager.dict(), manager.list()
        procs = []
        for i, host in enumerate(COMPUTE[1:3], 1):
            on(host)
            p = roving.Process(target=use_manager, args=(d, lst, i))
            p.start()
            procs.append(p)
        for p in procs:
            p.join(60)
        return {"dict": dict(d), "list": sorted(lst), "address": manager.address,
                "exitcodes": [p.exitcode for p in procs]}


def sync_scenario():
    lock, event, barrier = roving.Lock(), roving.Event(), roving.Barrier(len(COMPUTE))
    value, out = roving.Value("i", 0, lock=False), roving.Queue()
    procs = []
    for host in COMPUTE:
        on(host)
        p = roving.Process(target=sync_worker, args=(lock, event, barrier, value, out))
        p.start()
        procs.append(p)
    time.sleep(0.5)
    event.set()
    hosts = sorted(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(60)
    return {"value": value.value, "hosts": hosts, "exitcodes": [p.exitcode for p in procs]}


def shared_scenario():
    arr = np.arange(4 << 20, dtype=np.float32)  # 16 MiB
    handle = roving.shared(arr)
    with roving.Pool(6) as pool:
        res = pool.map(read_shared, [handle] * 60, chunksize=1)
    per_host = {}
    for total, host, maps, dev, pid in res:
        seen = per_host.setdefault(host, {"maps": set(), "devs": set(), "pids": set(), "sums_ok": True})
        seen["maps"].update(map(tuple, maps))
        seen["devs"].add(dev)
        seen["pids"].add(pid)
        seen["sums_ok"] &= total == float(arr.sum())
    return {"hosts": {host: {"maps": sorted(v["maps"]), "devs": sorted(v["devs"]), "workers": len(v["pids"]),
                             "sums_ok": v["sums_ok"]} for host, v in per_host.items()}}


def chaos_scenario():
    """A long imap over 3 workers (one per host, Slurm spreads them): says STARTED with the workers'
    hosts once it is under way, then goes on while the test disturbs a host; every result is checked."""
    n, seconds = int(os.environ.get("ACROSS_ITEMS", "400")), float(os.environ.get("ACROSS_TASK_S", "0.03"))
    with roving.Pool(3) as pool:
        hosts = sorted(set(pool.map(host_of_worker, range(30), chunksize=1)))
        results = []
        for i, (x, host, pid) in enumerate(pool.imap(slow_square, [(x, seconds) for x in range(n)])):
            results.append((x, host, pid))
            if i == 20:
                print("STARTED " + json.dumps(hosts), flush=True)
        ok = [x for x, _, _ in results] == [x * x for x in range(n)]
        return {"ok": ok, "count": len(results), "hosts_before": hosts,
                "late_hosts": sorted({h for _, h, _ in results[-n // 4:]}),
                "all_hosts": sorted({h for _, h, _ in results}),
                "start_failures": [why for _, why in pool.start_failures]}


def host_of_worker(_):
    time.sleep(0.05)
    return socket.gethostname()


_said = []


def _slurm_job() -> str:
    """This worker's job as roving (and squeue) name it: ``<array>_<task>`` for a task of a pool's job
    array, else the job id."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID")


def job_of_worker(_):
    time.sleep(0.05)
    if not _said:  # once per worker: what `roving logs JOB` shows of it
        print(f"worker of job {_slurm_job()} on {socket.gethostname()}", flush=True)
        _said.append(True)
    return socket.gethostname(), _slurm_job()


def job_of_worker_met(barrier, x):
    barrier.wait(60)
    return job_of_worker(x)


def slow_square(arg):
    x, seconds = arg
    time.sleep(seconds)
    return x * x, socket.gethostname(), os.getpid()


def orphans_scenario():
    """Workers on the compute hosts, then READY with their Slurm job ids; the test cuts this host off."""
    pool = roving.Pool(3)
    barrier = roving.Barrier(3)  # three items held at once: every worker runs one
    seen = set(pool.starmap(job_of_worker_met, [(barrier, x) for x in range(3)], chunksize=1))
    print("READY " + json.dumps({"hosts": sorted({h for h, _ in seen}), "jobs": sorted({j for _, j in seen})}),
          flush=True)
    time.sleep(600)
    return {}


SCENARIOS = {"pool": pool_scenario, "process": process_scenario,
             "queue": lambda: queue_scenario(False), "joinable": lambda: queue_scenario(True),
             "pipe": pipe_scenario, "manager": manager_scenario, "sync": sync_scenario,
             "shared": shared_scenario, "chaos": chaos_scenario, "orphans": orphans_scenario}


if __name__ == "__main__":
    roving.init(backend="slurm", slurm_partition=PARTITION)
    from roving.transport import session

    choice = session.current().address()
    result = SCENARIOS[sys.argv[1]]()
    result["parent_address"] = session.current().node().address
    result["parent_why"] = choice.why
    print("RESULT " + json.dumps(result), flush=True)
