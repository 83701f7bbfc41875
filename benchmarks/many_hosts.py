"""roving across separate hosts against roving on one host, side by side in one run.

Runs on the project's test hosts (network namespaces with their own addresses, a multi-node Slurm:
``bash scripts/cluster/hosts.sh`` as root first). Each measurement is a fresh program started inside a
host; the configurations of one comparison alternate, run by run, so that the machine's noise hits them
alike: compare the ratios. Three comparisons:

* ``overhead``: the Pool overhead pattern of benchmarks/pool_overhead.py (rounds of 5 apply_async of 1,
  10, 100 ms; a map of 100,000 no-op items; 2,000 apply_async), 5 workers. *one host*: the parent and
  its workers on one host (local backend, loopback); *across hosts*: the parent on the login host, the
  workers Slurm jobs on the three compute hosts. Target: across / one host <= 1.15.
* ``chaos``: a map of ``--tasks`` tasks of ``--task-ms`` ms on ``--workers`` (3) workers spread over the
  compute hosts, undisturbed, then with one host cut off for good (its link down) ``--cut-after`` s into
  the map; every result must come back once and in order. Target: disturbed / undisturbed <= 1.3.
* ``roundtrip``: Pipe and Queue round trips (64 B, 1 MiB, 100 MiB; the measure of benchmarks/transport.py)
  between two processes on one host (local backend, loopback, plain text), between two hosts with
  ``encrypt="off"``, and between two hosts as configured by default (encrypted beyond loopback), and
  multiprocessing's on one host.

    python benchmarks/many_hosts.py overhead --repeat 3
    python benchmarks/many_hosts.py chaos --tasks 3000 --task-ms 10
    python benchmarks/many_hosts.py roundtrip --repeat 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "tests" / "support"), str(ROOT / "src")]

import helpers_hosts as hh  # noqa: E402 (the test hosts' names, addresses and faults)

COMPUTE = [h.name for h in hh.COMPUTE]


# -- inside a host -------------------------------------------------------------------------------------

def _slurm(**extra) -> None:
    import roving

    roving.init(backend="slurm", slurm_partition=hh.PARTITION, child_output="off", **extra)


def inner_overhead(where: str) -> Dict[str, float]:
    import pool_overhead as po
    import roving

    if where == "across":
        _slurm()
    else:
        roving.init(backend="local", child_output="off")
    pool = roving.Pool(po.WORKERS)
    try:
        pool.map(po.noop, range(po.WORKERS * 4))
        time.sleep(1.0)
        return {name: test(pool) for name, test in po.TESTS.items()}
    finally:
        pool.terminate()


def chaos_task(arg):
    x, seconds = arg
    time.sleep(seconds)
    return x * x


def inner_chaos(tasks: int, task_ms: float, workers: int) -> Dict[str, float]:
    import roving

    _slurm(pool_heartbeat_timeout=3.0, connect_timeout=8.0)
    with roving.Pool(workers) as pool:
        pool.map(chaos_task, [(0, 0.05)] * (10 * workers), chunksize=1)  # up, warm, spread
        print("STARTED {}", flush=True)
        start = time.perf_counter()
        out = pool.map(chaos_task, [(x, task_ms / 1000) for x in range(tasks)], chunksize=1)
        took = time.perf_counter() - start
    return {"seconds": took, "correct": out == [x * x for x in range(tasks)]}


def inner_roundtrip(where: str, repeat: int) -> Dict[str, float]:
    import multiprocessing

    import transport as tr
    import roving

    if where == "mp":
        lib = multiprocessing.get_context("spawn")
    else:
        lib = roving
        if where == "local":
            roving.init(backend="local", child_output="off")
        else:  # the echo child on another host
            _slurm(slurm_options=f"--nodelist={COMPUTE[1]}", encrypt="off" if where == "plain" else "auto")
    out = {}
    for channel, measure in (("Pipe", tr.measure_pipe), ("Queue", tr.measure_queue)):
        for label, size in tr.SIZES.items():
            out[f"{channel} {label}"] = measure(lib, tr.make_message(size, "numpy"), tr.ROUNDS[size], repeat)
    return out


# -- the driver (root namespace) ---------------------------------------------------------------------

def _inner(host, *args: str) -> "hh.Program":
    return hh.Program(host, [sys.executable, "-u", str(Path(__file__).resolve()), "--inner", *args],
                      hh.program_env(PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT / "tests" / "support"),
                                                                 str(ROOT / "src")])))


def _table(title: str, figures: Dict[str, Dict[str, float]], base: str, unit: str, scale: float) -> None:
    names = list(figures)
    print(f"\n{title}")
    print(f"| | {' | '.join(names)} | " + " | ".join(f"{n} / {base}" for n in names if n != base) + " |")
    print("|---" * (1 + len(names) + len(names) - 1) + "|")
    for test in figures[base]:
        cells = [f"{figures[n][test] * scale:.3f}" if scale == 1 else f"{figures[n][test] * scale:.0f}"
                 for n in names]
        ratios = [f"{figures[n][test] / figures[base][test]:.2f}" for n in names if n != base]
        print(f"| {test} ({unit}) | {' | '.join(cells)} | {' | '.join(ratios)} |")


def overhead(args) -> None:
    places = {"one host": (COMPUTE[0], "local"), "across hosts": (hh.LOGIN, "across")}
    runs: Dict[str, List[dict]] = {name: [] for name in places}
    for i in range(args.repeat):
        for name, (host, where) in places.items():
            hh.require()
            runs[name].append(_inner(host, "overhead", where).result(900))
            print(f"# run {i + 1}/{args.repeat} {name} done", file=sys.stderr, flush=True)
    figures = {n: {t: statistics.median(r[t] for r in rs) for t in rs[0]} for n, rs in runs.items()}
    _table(f"Pool overhead, 5 workers, seconds (median of {args.repeat})", figures, "one host", "s", 1)


def chaos(args) -> None:
    results = {}
    for name in ("undisturbed", "one host cut off"):
        hh.require()
        run = _inner(hh.LOGIN, "chaos", str(args.tasks), str(args.task_ms), str(args.workers))
        victim = None
        try:
            if name != "undisturbed":
                run.wait_for("STARTED", 120)
                time.sleep(args.cut_after)
                victim = COMPUTE[0]
                hh.cut(victim)
            results[name] = run.result(900)
        finally:
            run.kill()
            if victim:
                hh.mend()
        print(f"# {name}: {results[name]}", file=sys.stderr, flush=True)
    base, hit = results["undisturbed"], results["one host cut off"]
    print(f"\nChaos: {args.tasks} x {args.task_ms:g} ms on {args.workers} workers over 3 hosts, one host cut off "
          f"{args.cut_after:g} s into the map")
    print("| run | seconds | every result correct, in order |\n|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['seconds']:.2f} | {r['correct']} |")
    print(f"| ratio | {hit['seconds'] / base['seconds']:.2f}x | |")


def roundtrip(args) -> None:
    places = {"one host (loopback)": (COMPUTE[0], "local"), "multiprocessing, one host": (COMPUTE[0], "mp"),
              "two hosts, encrypt=off": (COMPUTE[0], "plain"), "two hosts, encrypted": (COMPUTE[0], "auto")}
    runs: Dict[str, List[dict]] = {name: [] for name in places}
    for i in range(args.runs):
        for name, (host, where) in places.items():
            hh.require()
            runs[name].append(_inner(host, "roundtrip", where, str(args.repeat)).result(1800))
            print(f"# run {i + 1}/{args.runs} {name} done", file=sys.stderr, flush=True)
    figures = {n: {t: statistics.median(r[t] for r in rs) for t in rs[0]} for n, rs in runs.items()}
    _table(f"Round trips, microseconds (median of {args.runs} runs x {args.repeat} repeats)", figures,
           "one host (loopback)", "us", 1e6)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--inner"]:
        kind, rest = argv[1], argv[2:]
        if kind == "overhead":
            result = inner_overhead(rest[0])
        elif kind == "chaos":
            result = inner_chaos(int(rest[0]), float(rest[1]), int(rest[2]))
        else:
            result = inner_roundtrip(rest[0], int(rest[1]))
        print("RESULT " + json.dumps(result), flush=True)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("overhead")
    p.add_argument("--repeat", type=int, default=3)
    p = sub.add_parser("chaos")
    p.add_argument("--tasks", type=int, default=3000)
    p.add_argument("--task-ms", type=float, default=10.0)
    p.add_argument("--cut-after", type=float, default=3.0)
    p.add_argument("--workers", type=int, default=3, help="workers in all, spread over the 3 compute hosts")
    p = sub.add_parser("roundtrip")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    {"overhead": overhead, "chaos": chaos, "roundtrip": roundtrip}[args.what](args)


if __name__ == "__main__":
    main()
