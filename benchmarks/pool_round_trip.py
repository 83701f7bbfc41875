"""One task's round trip through roving's Pool with its workers' channels over streams and over ZeroMQ,
beside multiprocessing's Pool and concurrent.futures' ProcessPoolExecutor, interleaved in one run.

    python benchmarks/pool_round_trip.py --repeat 5

Two rows: the median round trip of one no-op ``apply`` (2,000 in a row, one worker busy at a time), and
the Fiber pattern's rounds of 5 x 1 ms with 5 workers (200 rounds, seconds; ideal 0.20 s). The two roving
pools live side by side in this process: "roving" is the pool as it is (its workers ask the parent's
node where its stream listener is and talk over streams); "roving-zmq" was made while the node said it
has no listener (``node.streams_enabled`` off for the moment its workers connected), so its workers
talk over ZeroMQ, as every pool did before. Each run of each peer follows the others', so that the
machine's load hits all alike; each figure is the median of ``--repeat`` runs.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing
import statistics
import time
from typing import Any, Callable, Dict, List

import roving
from roving.transport import node as _node

WORKERS = 5


def noop(x: Any = None) -> Any:
    return x


def sleep_1ms(_: Any = None) -> None:
    time.sleep(0.001)


def _roving(streams: bool) -> Any:
    _node.streams_enabled = streams
    try:
        pool = roving.Pool(WORKERS)
        pool.map(noop, range(WORKERS * 20), chunksize=1)  # every worker connected and warm
    finally:
        _node.streams_enabled = True
    return pool


def _peers() -> Dict[str, Any]:
    mp = multiprocessing.get_context("fork").Pool(WORKERS)
    mp.map(noop, range(WORKERS * 20), chunksize=1)
    ex = cf.ProcessPoolExecutor(WORKERS)
    list(ex.map(noop, range(WORKERS * 20)))
    return {"roving": _roving(True), "roving-zmq": _roving(False), "multiprocessing": mp, "ProcessPoolExecutor": ex}


def _one(pool: Any) -> Callable[[], Any]:
    if isinstance(pool, cf.Executor):
        return lambda: pool.submit(noop, 1).result()
    return lambda: pool.apply(noop, (1,))


def _round(pool: Any) -> Callable[[], Any]:
    if isinstance(pool, cf.Executor):
        return lambda: [f.result() for f in [pool.submit(sleep_1ms) for _ in range(WORKERS)]]
    return lambda: [r.get() for r in [pool.apply_async(sleep_1ms) for _ in range(WORKERS)]]


def round_trip_us(pool: Any, n: int = 2000) -> float:
    one, took = _one(pool), []
    for _ in range(n):
        t0 = time.perf_counter()
        one()
        took.append(time.perf_counter() - t0)
    return statistics.median(took) * 1e6


def rounds_s(pool: Any, n: int = 200) -> float:
    one = _round(pool)
    t0 = time.perf_counter()
    for _ in range(n):
        one()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    pools = _peers()
    got: Dict[str, Dict[str, List[float]]] = {p: {"rt": [], "rounds": []} for p in pools}
    try:
        for _ in range(args.repeat):
            for name, pool in pools.items():
                got[name]["rt"].append(round_trip_us(pool))
                got[name]["rounds"].append(rounds_s(pool))
    finally:
        for _name, pool in pools.items():
            if isinstance(pool, cf.Executor):
                pool.shutdown()
            else:
                pool.terminate()
    names = list(pools)
    print(f"| median of {args.repeat} | " + " | ".join(names) + " | roving / roving-zmq | roving / multiprocessing "
          "| roving / ProcessPoolExecutor |")
    print("|---" * (len(names) + 4) + "|")
    for row, key, fmt in (("no-op apply round trip (us)", "rt", "{:.0f}"),
                          ("rounds of 5 x 1 ms, 200 rounds (s; ideal 0.20)", "rounds", "{:.3f}")):
        med = {n: statistics.median(got[n][key]) for n in names}
        ratios = [med["roving"] / med[b] for b in ("roving-zmq", "multiprocessing", "ProcessPoolExecutor")]
        print(f"| {row} | " + " | ".join(fmt.format(med[n]) for n in names) + " | "
              + " | ".join(f"{r:.2f}" for r in ratios) + " |")


if __name__ == "__main__":
    main()
