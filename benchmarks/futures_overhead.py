"""Framework overhead of roving's concurrent.futures Executor and joblib backend beside the standard
library's ProcessPoolExecutor, loky's reusable executor and Dask's LocalCluster executor, in one run.

Executors: the Fiber paper's test (arXiv 2003.11164, Fig. 4; as benchmarks/pool_overhead.py): 5 workers,
rounds of 5 ``submit`` of tasks that sleep 1, 10 and 100 ms, about 1 s of work per size (0.2 s of wall
time at best), waiting for each round before the next; then 2,000 ``submit`` of a no-op, all gathered.
joblib: ``Parallel(n_jobs=5)`` of 1,000 calls that sleep 1 ms and of 20,000 no-op calls (joblib's
auto-batching), on the "roving" backend and on loky (joblib's default). Each figure is the median of
``--repeat`` runs; the peers' runs are interleaved in the same invocation (Dask's after the others, alone,
since its scheduler and nanny processes load the machine).

    python benchmarks/futures_overhead.py --repeat 5
    python benchmarks/futures_overhead.py --peers roving stdlib --repeat 5
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import logging
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

from roving.futures import Executor

WORKERS = 5
SLEEPS = (0.001, 0.01, 0.1)
TOTAL_WORK_S = 1.0


def sleep_task(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def noop(x: Any) -> Any:
    return x


class _Dask:
    """Dask's LocalCluster (a process per worker, one thread each) behind its concurrent.futures executor."""

    def __init__(self, n: int) -> None:
        from distributed import Client, LocalCluster

        self._cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                                     dashboard_address=None, silence_logs=logging.ERROR)
        self._client = Client(self._cluster)
        self._ex = self._client.get_executor(pure=False)

    def submit(self, fn: Callable, *args: Any) -> Any:
        return self._ex.submit(fn, *args)

    def map(self, fn: Callable, items: Any) -> Any:
        return self._ex.map(fn, items)

    def shutdown(self) -> None:
        self._ex.shutdown(wait=True)
        self._client.close()
        self._cluster.close()


def _make(peer: str) -> Any:
    if peer == "roving":
        return Executor(WORKERS)
    if peer == "stdlib":
        return cf.ProcessPoolExecutor(WORKERS)
    if peer == "loky":
        import loky

        return loky.get_reusable_executor(max_workers=WORKERS, reuse=False)
    if peer == "dask":
        return _Dask(WORKERS)
    raise ValueError(peer)


def _installed(peer: str) -> bool:
    try:
        __import__({"loky": "loky", "dask": "distributed", "joblib": "joblib"}.get(peer, "roving"))
        return True
    except ImportError:
        return False


def _rounds(ex: Any, seconds: float) -> float:
    n = round(TOTAL_WORK_S / seconds)
    start = time.perf_counter()
    for _ in range(0, n, WORKERS):
        for f in [ex.submit(sleep_task, seconds) for _ in range(WORKERS)]:
            f.result()
    return time.perf_counter() - start


def _submit_many(ex: Any) -> float:
    start = time.perf_counter()
    futures = [ex.submit(noop, i) for i in range(2000)]
    assert [f.result() for f in futures] == list(range(2000))
    return time.perf_counter() - start


EXECUTOR_TESTS: Dict[str, Callable[[Any], float]] = {
    **{f"rounds of 5 x {int(s * 1000)} ms ({round(TOTAL_WORK_S / s)} tasks; ideal 0.20 s)":
       (lambda ex, s=s: _rounds(ex, s)) for s in SLEEPS},
    "2,000 submit (no-op)": _submit_many,
}


def measure_executors(peers: List[str], repeat: int) -> Dict[str, Dict[str, float]]:
    """Each test ``repeat`` times, the peers' runs interleaved, every executor up and warm first."""
    executors = {}
    try:
        for peer in peers:
            executors[peer] = _make(peer)
            assert list(executors[peer].map(noop, range(WORKERS * 4))) == list(range(WORKERS * 4))
        time.sleep(1.0)
        runs: Dict[str, Dict[str, List[float]]] = {p: {name: [] for name in EXECUTOR_TESTS} for p in peers}
        for name, test in EXECUTOR_TESTS.items():
            for _ in range(repeat):
                for peer in peers:
                    runs[peer][name].append(test(executors[peer]))
        return {p: {name: statistics.median(v) for name, v in runs[p].items()} for p in peers}
    finally:
        for ex in executors.values():
            ex.shutdown()


def _parallel_sleeps(backend: str) -> float:
    from joblib import Parallel, delayed, parallel_config

    start = time.perf_counter()
    with parallel_config(backend=backend, n_jobs=WORKERS):
        out = Parallel()(delayed(sleep_task)(0.001) for _ in range(1000))
    assert len(out) == 1000
    return time.perf_counter() - start


def _parallel_noops(backend: str) -> float:
    from joblib import Parallel, delayed, parallel_config

    start = time.perf_counter()
    with parallel_config(backend=backend, n_jobs=WORKERS):
        out = Parallel()(delayed(noop)(i) for i in range(20_000))
    assert out[-1] == 19_999
    return time.perf_counter() - start


JOBLIB_TESTS: Dict[str, Callable[[str], float]] = {
    "joblib Parallel: 1,000 x 1 ms (ideal 0.20 s)": _parallel_sleeps,
    "joblib Parallel: 20,000 no-op": _parallel_noops,
}


def measure_joblib(backends: List[str], repeat: int) -> Dict[str, Dict[str, float]]:
    import roving.joblib

    for backend in backends:  # workers up (both backends keep theirs between calls)
        _parallel_noops(backend)
    runs: Dict[str, Dict[str, List[float]]] = {b: {name: [] for name in JOBLIB_TESTS} for b in backends}
    for name, test in JOBLIB_TESTS.items():
        for _ in range(repeat):
            for backend in backends:
                runs[backend][name].append(test(backend))
    roving.joblib.shutdown()
    return {b: {name: statistics.median(v) for name, v in runs[b].items()} for b in backends}


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", nargs="+", default=["roving", "stdlib", "loky", "dask"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-joblib", action="store_true", help="executors only")
    args = parser.parse_args(argv)
    present = [p for p in args.peers if _installed(p)]
    for peer in set(args.peers) - set(present):
        print(f"# {peer}: not installed", file=sys.stderr)
    figures = measure_executors([p for p in present if p != "dask"], args.repeat)
    if "dask" in present:
        figures.update(measure_executors(["dask"], args.repeat))
    peers = list(figures)
    others = [p for p in peers if p != "roving"]
    print(f"| seconds (median of {args.repeat}) | {' | '.join(peers)} | "
          + " | ".join(f"roving / {p}" for p in others) + " |")
    print("|---" * (len(peers) + len(others) + 1) + "|")
    for name in EXECUTOR_TESTS:
        row = [f"{figures[p][name]:.3f}" for p in peers]
        ratios = [f"{figures['roving'][name] / figures[p][name]:.2f}" for p in others] if "roving" in figures \
            else [""] * len(others)
        print(f"| {name} | {' | '.join(row)} | {' | '.join(ratios)} |")
    if args.no_joblib or not _installed("joblib"):
        return
    jl = measure_joblib(["roving", "loky"], args.repeat)
    print()
    print(f"| seconds (median of {args.repeat}) | joblib on roving | joblib on loky | roving / loky |")
    print("|---|---|---|---|")
    for name in JOBLIB_TESTS:
        print(f"| {name} | {jl['roving'][name]:.3f} | {jl['loky'][name]:.3f} | "
              f"{jl['roving'][name] / jl['loky'][name]:.2f} |")


if __name__ == "__main__":
    main()
