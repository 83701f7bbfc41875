"""One parent's capacity (issue 22): a real roving Pool at 1,000-4,000 connected workers.

The parent is a real ``roving.Pool`` (its dispatcher, upkeep thread, node and I/O thread, CURVE and the
session's HMAC handshake as configured). This machine cannot hold thousands of interpreters, so with
``--clients`` the pool's workers are *lightweight clients*: a few client-host processes
(``--hosts``, each a subprocess running ``pool_capacity_clients.py``) each hold many workers. Each such worker is

* two real ``roving.transport.channel.Channel`` connections of its own (the work channel and the
  heartbeat channel, as a real worker has), each a ZeroMQ DEALER that did the real CURVE handshake and
  roving's mutual HMAC proof, so the parent's node knows it as its own authenticated identity;
* driven by the real pool protocol of ``roving.pool._protocol`` (HELLO, READY with credit and key,
  TASKS parsed unit by unit, RESULTS with runs and pickled values asking for more, BYE/ACK, HEARTBEAT
  every ``heartbeat_interval`` seconds on the heartbeat channel), sending what ``_worker._Loop`` sends
  for the same units: each unit's results as soon as it is done, with the ask for more work when it then
  holds nothing (before commit "worker: results carry the ask", a RESULTS then a READY); asking
  ahead (a READY as a unit starts) once units proved shorter than 50 ms (depth 2);
* "running" a unit by a timer of (items x task seconds) in its host's single-threaded poll loop instead
  of calling the function in a thread: the value sent back is the task's argument, pickled as a real
  worker pickles it.

The pool learns of these workers through its upkeep as usual; only the object that would have been a
``roving.Process`` is replaced (``roving.pool._upkeep.Process`` and ``start_many`` are patched by this
script): its ``start()`` asks a client host to open the worker, ``kill()`` to drop it. Without
``--clients`` the workers are real pool worker processes on the local backend (the cross-check).

Figures: utilisation = busy worker-seconds (tasks x task seconds) / (workers x wall), wall from the
submit to the last result; dispatched tasks/s = tasks / wall; the parent's CPU per task = process CPU
(getrusage, all threads of the parent: caller, node I/O, upkeep, ZeroMQ's I/O threads) over the run
divided by tasks, both raw and less the idle baseline (the CPU the parent spends per second with all
workers connected and idle, measured before, times the run's wall); memory per connected worker = the
parent's RSS once all are connected and idle less its RSS with the pool made but no worker started,
divided by workers. The clients' CPU (all client hosts, from /proc) over the run is reported too: they
share this machine's cores with the parent.

    python benchmarks/pool_capacity.py --clients --workers 1000 2000 4000 --task-ms 100 10
    python benchmarks/pool_capacity.py --clients --workers 32 --task-ms 100 10     # cross-check ...
    python benchmarks/pool_capacity.py --workers 32 --task-ms 100 10               # ... real workers
    python benchmarks/pool_capacity.py --clients --workers 1000 --idle-only --trace-memory  # where memory goes

Also printed: malloc in use (glibc mallinfo2) beside the RSS, the RSS after the maps, the idle CPU split
into the upkeep's rounds (thread_time inside them) and the rest, CPU by thread, messages per task by kind
and the node thread's wake-ups per message (its voluntary context switches).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

TICK = os.sysconf("SC_CLK_TCK")


def sleep_task(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


# --------------------------------------------------------------------------------------------------
# the parent
# --------------------------------------------------------------------------------------------------
def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _threads_cpu() -> Dict[str, float]:
    """CPU seconds of each thread of this process, by name (Python's names, else the kernel's: ZeroMQ's
    I/O thread is ZMQbg/IO/0)."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: Dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        name = names.get(int(tid), comm)
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
    return out


def _wakeups(thread_name: str) -> int:
    """Voluntary context switches of this process's thread ``thread_name`` (Python's name): how often
    it went to sleep waiting (for the node's I/O thread: once per poll that found nothing yet)."""
    import threading

    tid = next((t.native_id for t in threading.enumerate() if t.name == thread_name), None)
    if tid is None:
        return 0
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    return 0


def _count_messages(disp: Any) -> Dict[int, int]:
    """Count the pool messages the dispatcher receives, by kind (the instance's on_message wrapped)."""
    counts: Dict[int, int] = {}
    handle = disp.on_message

    def counted(ident: bytes, kind: int, arg: int, key: int, frames: List[Any]) -> None:
        counts[kind] = counts.get(kind, 0) + 1
        handle(ident, kind, arg, key, frames)

    disp.on_message = counted
    return counts


def _proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK


class _Hosts:
    def __init__(self, n: int, address: str, one_connection: bool = False, streams: int = 0,
                 stream_address: str = "", jitter: float = 0.0) -> None:
        from roving.transport import session as _session

        clients = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pool_capacity_clients.py")
        session = _session.current()
        self.procs = []
        for _ in range(n):
            # each clients process a child of this session: credentials of its own, issued by its CA
            uid = _session.new_uid()
            env = {**os.environ, **session.child_env({"uid": uid, "parent": address}, True)}
            self.procs.append(subprocess.Popen([sys.executable, clients, address, "one" if one_connection else "two",
                                                str(streams), stream_address or "-", str(jitter)],
                                               stdin=subprocess.PIPE, env=env))
        self.next = 0

    def tell(self, i: int, line: str) -> None:
        self.procs[i].stdin.write((line + "\n").encode())
        self.procs[i].stdin.flush()

    def all(self, line: str) -> None:
        for i in range(len(self.procs)):
            self.tell(i, line)

    def cpu(self) -> float:
        return sum(_proc_cpu(p.pid) for p in self.procs)

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.close()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


class _ClientProc:
    """Stands where a roving.Process would: a worker held by a client host."""

    hosts: Optional[_Hosts] = None

    def __init__(self, target: Any = None, name: str = "", args: tuple = (), daemon: bool = True,
                 resources: Any = None) -> None:
        self.pool_id, self.wid = args[1], args[2]
        self.beat = args[8] if len(args) > 8 and args[8] else None  # seconds between its heartbeats
        self.name = name
        # readable once the worker is dropped, as a job's sentinel once the job ends: the upkeep learns of
        # the end through it (an eventfd: one descriptor)
        self.sentinel = os.eventfd(0, os.EFD_CLOEXEC)
        self.alive = False
        self.exitcode: Optional[int] = None
        self.host = 0

    def start(self) -> None:
        _start_clients([self])

    def is_alive(self) -> bool:
        return self.alive

    def kill(self) -> None:
        if self.alive:
            self.alive, self.exitcode = False, -9
            self.hosts.tell(self.host, f"kill {self.wid}")
            os.eventfd_write(self.sentinel, 1)

    terminate = kill

    def _release(self) -> None:
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None

    def _wait(self, timeout: float) -> None:
        pass

    def join(self, timeout: Optional[float] = None) -> None:
        pass


def _start_clients(procs: List[_ClientProc]) -> List[Optional[Exception]]:
    hosts = _ClientProc.hosts
    per: Dict[int, List[int]] = {}
    for p in procs:
        p.host = hosts.next % len(hosts.procs)
        hosts.next += 1
        p.alive = True
        per.setdefault(p.host, []).append(p.wid)
    for i, wids in per.items():
        if procs[0].beat:  # as a real worker is told: the heartbeats' spacing for this pool's size
            hosts.tell(i, f"beat {procs[0].beat}")
        hosts.tell(i, f"start {procs[0].pool_id} " + " ".join(map(str, wids)))
    return [None] * len(procs)


def _malloc_in_use() -> int:
    """Bytes the C allocator has handed out and not had back (glibc mallinfo2: arena + mmapped)."""
    import ctypes

    class _Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                          "usmblks", "fsmblks", "uordblks", "fordblks",
                                                          "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _Info
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def run_one(workers: int, task_ms: List[int], clients: bool, n_hosts: int, seconds: float,
            idle_s: float, max_tasks: int, trace: bool = False,
            one_connection: bool = False, streams: int = 0, jitter: float = 0.0) -> List[Dict[str, Any]]:
    import roving
    from roving.pool import _upkeep
    from roving.transport import session as _session

    hosts = None
    if clients:
        node = _session.current().node()
        _upkeep.Process = _ClientProc  # type: ignore[attr-defined]
        _upkeep.start_many = _start_clients  # type: ignore[attr-defined]
    # the upkeep thread's own CPU (thread_time inside each round): the idle CPU less this is what the
    # heartbeats (and ZeroMQ's keepalives) cost
    upkeep_cpu = [0.0]
    once = _upkeep.Upkeep.once

    def timed_once(self: Any) -> bool:
        t = time.thread_time()
        try:
            return once(self)
        finally:
            upkeep_cpu[0] += time.thread_time() - t

    _upkeep.Upkeep.once = timed_once  # type: ignore[method-assign]
    if trace:
        import tracemalloc

        tracemalloc.start()
    rss0 = _rss()
    pool = roving.Pool(workers) if not clients else None
    if clients:
        hosts = _ClientProc.hosts = _Hosts(n_hosts, node.address, one_connection, streams,
                                           node.streams().address if streams else "", jitter)
        time.sleep(1.0)
        rss0 = _rss()
        pool = roving.Pool(workers)
    malloc0 = _malloc_in_use()
    snap0 = tracemalloc.take_snapshot() if trace else None
    traced0 = tracemalloc.get_traced_memory()[0] if trace else 0
    disp = pool._disp
    deadline = time.monotonic() + 600
    while sum(1 for w in disp.workers_now() if w.ident is not None) < workers:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {sum(1 for w in disp.workers_now() if w.ident is not None)} of {workers} "
                             "workers connected within 600 s")
        time.sleep(0.2)
    print(f"# {workers} workers connected", file=sys.stderr, flush=True)
    time.sleep(2.0)
    rss1 = _rss()
    malloc1 = _malloc_in_use()
    memory = {"workers": workers, "rss_kb_per_worker": round((rss1 - rss0) / workers / 1024, 1),
              "malloc_kb_per_worker": round((malloc1 - malloc0) / workers / 1024, 1)}
    if os.environ.get("POOL_CAPACITY_TRIM"):  # diagnosis: how much of the RSS is memory malloc holds free
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
        memory["rss_kb_per_worker_after_malloc_trim"] = round((_rss() - rss0) / workers / 1024, 1)
    if trace:
        snap1 = tracemalloc.take_snapshot()
        traced1 = tracemalloc.get_traced_memory()[0]
        memory["traced_kb_per_worker"] = round((traced1 - traced0) / workers / 1024, 1)
        memory["tracemalloc_overhead_kb"] = round(tracemalloc.get_tracemalloc_memory() / 1024)
        tracemalloc.stop()
        print(json.dumps(memory), flush=True)
        for group in ("filename", "lineno"):
            print(f"# Python memory per connected worker by {group} (bytes, count per worker):")
            for stat in snap1.compare_to(snap0, group)[:15]:
                frame = stat.traceback[0]
                where = frame.filename if group == "filename" else f"{frame.filename}:{frame.lineno}"
                print(f"#   {stat.size_diff / workers:9.0f}  {stat.count_diff / workers:6.2f}  {where}")
        del snap0, snap1
    else:
        print(json.dumps(memory), flush=True)
    from roving.pool import _protocol as P

    names = {getattr(P, k): k for k in ("HELLO", "READY", "RESULTS", "HEARTBEAT", "BYE", "RETURNED")}
    counts = _count_messages(disp)
    m0, wk0 = dict(counts), _wakeups("roving-node")
    c0, t0, u0, th0 = _cpu(), time.monotonic(), upkeep_cpu[0], _threads_cpu()
    time.sleep(idle_s)
    idle_wall = time.monotonic() - t0
    idle_msgs = sum(counts.values()) - sum(m0.values())
    idle_wakeups = _wakeups("roving-node") - wk0
    th1 = _threads_cpu()
    by_thread = {name: round((th1[name] - th0.get(name, 0.0)) / idle_wall, 4) for name in th1
                 if th1[name] - th0.get(name, 0.0) > 0}
    idle_per_s = (_cpu() - c0) / idle_wall
    idle_upkeep_per_s = (upkeep_cpu[0] - u0) / idle_wall
    print(json.dumps({"workers": workers, "idle_parent_cpu_share": round(idle_per_s, 4),
                      "idle_upkeep_cpu_share": round(idle_upkeep_per_s, 4),
                      "idle_rest_cpu_share": round(idle_per_s - idle_upkeep_per_s, 4),
                      "idle_us_per_worker_s": round(idle_per_s / workers * 1e6, 1),
                      "idle_upkeep_us_per_worker_s": round(idle_upkeep_per_s / workers * 1e6, 1),
                      "idle_cpu_share_by_thread": by_thread,
                      "idle_messages_per_worker_s": round(idle_msgs / idle_wall / workers, 2),
                      "idle_node_wakeups_per_message": round(idle_wakeups / max(1, idle_msgs), 2)}), flush=True)
    rows = []
    for ms in task_ms:
        task_s = ms / 1000
        if hosts is not None:
            hosts.all(f"task {task_s}")
        n = max(workers, min(max_tasks, int(seconds * workers / task_s)))
        pool.map(sleep_task, [task_s] * workers, chunksize=1)  # warm: every worker holds the function
        h0 = hosts.cpu() if hosts else 0.0
        m0, wk0 = dict(counts), _wakeups("roving-node")
        c0, t0, th0 = _cpu(), time.monotonic(), _threads_cpu()
        out = pool.map(sleep_task, [task_s] * n, chunksize=1)
        wall = time.monotonic() - t0
        cpu = _cpu() - c0
        th1 = _threads_cpu()
        wakeups = _wakeups("roving-node") - wk0
        msgs = {names.get(k, str(k)): v - m0.get(k, 0) for k, v in counts.items() if v - m0.get(k, 0)}
        h1 = hosts.cpu() if hosts else 0.0
        assert len(out) == n and out[0] == task_s
        rows.append({
            "workers": workers, "kind": "clients" if clients else "real", "task_ms": ms, "tasks": n,
            "wall_s": round(wall, 2), "util": round(n * task_s / (workers * wall), 3),
            "tasks_per_s": round(n / wall), "parent_cpu_us_per_task": round(cpu / n * 1e6, 1),
            "parent_cpu_us_per_task_less_idle": round((cpu - idle_per_s * wall) / n * 1e6, 1),
            "parent_cpu_share": round(cpu / wall, 2), "idle_parent_cpu_share": round(idle_per_s, 3),
            "clients_cpu_share": round((h1 - h0) / wall, 2),
            "rss_kb_per_worker": memory["rss_kb_per_worker"],
            "idle_upkeep_cpu_share": round(idle_upkeep_per_s, 4),
            "messages_per_task": {k: round(v / n, 3) for k, v in msgs.items()},
            "node_wakeups_per_message": round(wakeups / max(1, sum(msgs.values())), 3),
            "us_per_task_by_thread": {name: round((th1[name] - th0.get(name, 0.0)) / n * 1e6, 1) for name in th1
                                      if th1[name] - th0.get(name, 0.0) > 0},
        })
        print(json.dumps(rows[-1]), flush=True)
    if rows:  # after the maps every connection has carried traffic: its ZeroMQ queues have grown
        del out
        after = round((_rss() - rss0) / workers / 1024, 1)
        for row in rows:
            row["rss_kb_per_worker_after_maps"] = after
        note = {"workers": workers, "rss_kb_per_worker_after_maps": after,
                "malloc_kb_per_worker_after_maps": round((_malloc_in_use() - malloc0) / workers / 1024, 1)}
        if os.environ.get("POOL_CAPACITY_TRIM"):
            import ctypes

            ctypes.CDLL(None).malloc_trim(0)
            note["rss_kb_per_worker_after_maps_and_malloc_trim"] = round((_rss() - rss0) / workers / 1024, 1)
        print(json.dumps(note), flush=True)
    pool.terminate()
    pool.join()  # the upkeep's last kills reach the client hosts before they are closed
    if hosts is not None:
        hosts.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[1000, 2000, 4000])
    ap.add_argument("--task-ms", type=int, nargs="+", default=[100, 10])
    ap.add_argument("--clients", action="store_true", help="lightweight clients instead of real workers")
    ap.add_argument("--hosts", type=int, default=4, help="client-host processes (with --clients)")
    ap.add_argument("--seconds", type=float, default=8.0, help="ideal wall time of each measured map")
    ap.add_argument("--idle", type=float, default=3.0, help="seconds of the idle baseline")
    ap.add_argument("--max-tasks", type=int, default=200_000, help="at most this many tasks per map")
    ap.add_argument("--idle-only", action="store_true", help="memory and idle CPU only, no maps")
    ap.add_argument("--trace-memory", action="store_true",
                    help="tracemalloc: the parent's Python memory per worker by file and line (slows start-up)")
    ap.add_argument("--one-connection", action="store_true",
                    help="clients send their heartbeats on the work connection and open no heartbeat "
                         "connection (not what a real worker does: to measure what the second costs)")
    ap.add_argument("--streams", type=int, default=0,
                    help="with --clients: each worker also holds this many roving streams to the parent's node, "
                         "pinging it a second on the last, as a real worker process does (2: its payload "
                         "fetch's and its parent-watch thread's)")
    ap.add_argument("--jitter", type=float, default=0.0,
                    help="with --clients: a unit takes its time x (1 + jitter x a random number in [0, 1)), so "
                         "that the workers of one client host do not finish together (utilisation is then "
                         "counted against the nominal time)")
    ap.add_argument("--transport", choices=("streams", "zmq"), default="streams",
                    help="with --clients: the clients' channels (real workers use streams where the parent's "
                         "node has a listener; zmq: as before the pool's channels were streams)")
    args = ap.parse_args()
    os.environ["POOL_CAPACITY_TRANSPORT"] = args.transport
    if args.clients:
        import zmq

        zmq.Context.instance().set(zmq.MAX_SOCKETS, 30000)
    for w in args.workers:
        run_one(w, [] if args.idle_only else args.task_ms, args.clients, args.hosts, args.seconds, args.idle,
                args.max_tasks, args.trace_memory, args.one_connection, args.streams,
                args.jitter)


if __name__ == "__main__":
    main()
