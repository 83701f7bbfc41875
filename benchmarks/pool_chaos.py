"""A map that survives its workers being killed: 10,000 tasks of 10 ms on 5 workers, with and without a
worker killed (SIGKILL) every second, in one run. The map must return every result once, in order; the
figure is the time with kills over the time without (target: at most 1.3).

With ``--cut-every S`` a third run puts every worker's connections to the parent behind a forwarder on
127.0.0.1 and cuts one of them every S seconds (a network drop: both processes live on); the worker
whose connection broke reconnects, and the units it held go back in line.

    python benchmarks/pool_chaos.py
    python benchmarks/pool_chaos.py --tasks 10000 --workers 5 --task-ms 10 --kill-every 1.0 --cut-every 1.0
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, List, Optional

import roving
from roving.pool import _dispatch
from roving.transport import session as _session

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
from helpers_net import CuttingProxy, NodeVia


def task(x: int, seconds: float) -> int:
    time.sleep(seconds)
    return x * x


def _killer(pool: Any, every: float, stop: threading.Event, killed: List[int]) -> None:
    while not stop.wait(every):
        busy = [w.proc.pid for w in list(pool._workers.values())
                if w.units and w.ident is not None and not w.retiring]
        if busy:
            pid = random.choice(busy)
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass


def _cutter(proxy: CuttingProxy, every: float, stop: threading.Event, cut: List[int]) -> None:
    rng = random.Random(0)
    while not stop.wait(every):
        if proxy.cut(1, rng):
            cut.append(1)


def run(tasks: int, workers: int, seconds: float, kill_every: float, chunksize: int,
        cut_every: float = 0.0) -> tuple:
    proxy: Optional[CuttingProxy] = None
    made = _dispatch.Dispatcher.__init__
    if cut_every:
        proxy = CuttingProxy(_session.current().node().address)

        def via_proxy(self: Any, *args: Any, **kwargs: Any) -> None:
            made(self, *args, **kwargs)
            self.node = NodeVia(self.node, proxy.address)

        _dispatch.Dispatcher.__init__ = via_proxy  # every worker of this pool connects through it
    try:
        return _run(tasks, workers, seconds, kill_every, chunksize, proxy, cut_every)
    finally:
        _dispatch.Dispatcher.__init__ = made
        if proxy is not None:
            proxy.close()


def _run(tasks: int, workers: int, seconds: float, kill_every: float, chunksize: int,
         proxy: Optional[CuttingProxy], cut_every: float) -> tuple:
    with roving.Pool(workers) as pool:
        pool.starmap(task, [(i, 0.0) for i in range(50)])
        deadline = time.monotonic() + 30
        while len([w for w in pool._workers.values() if w.ident]) < workers and time.monotonic() < deadline:
            time.sleep(0.05)
        stop, killed = threading.Event(), []
        killer = None
        if kill_every:
            killer = threading.Thread(target=_killer, args=(pool, kill_every, stop, killed), daemon=True)
        if proxy is not None:
            killer = threading.Thread(target=_cutter, args=(proxy, cut_every, stop, killed), daemon=True)
        start = time.perf_counter()
        if killer:
            killer.start()
        out = pool.starmap(task, [(i, seconds) for i in range(tasks)], chunksize=chunksize)
        took = time.perf_counter() - start
        stop.set()
        assert out == [i * i for i in range(tasks)], "wrong or missing results"
        return took, len(killed)


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=5)
    parser.add_argument("--task-ms", type=float, default=10.0)
    parser.add_argument("--kill-every", type=float, default=1.0)
    parser.add_argument("--chunksize", type=int, default=10)
    parser.add_argument("--cut-every", type=float, default=0.0,
                        help="also a run where one worker connection is cut every this many seconds (0: none)")
    args = parser.parse_args(argv)
    if args.cut_every < 0 or args.kill_every < 0:
        parser.error("--kill-every and --cut-every must be >= 0")
    seconds = args.task_ms / 1000
    ideal = args.tasks * seconds / args.workers
    calm, _ = run(args.tasks, args.workers, seconds, 0, args.chunksize)
    chaos, kills = run(args.tasks, args.workers, seconds, args.kill_every, args.chunksize)
    print(f"| {args.tasks} x {args.task_ms:g} ms on {args.workers} workers (ideal {ideal:.1f} s) | "
          f"no kills s | a kill every {args.kill_every:g} s: s | workers killed | results | ratio (<= 1.3) |")
    print("|---|---|---|---|---|---|")
    print(f"| roving.Pool.starmap(chunksize={args.chunksize}) | {calm:.2f} | {chaos:.2f} | {kills} "
          f"| all correct, in order "
          f"| {chaos / calm:.2f} |")
    if args.cut_every:
        cut_s, cuts = run(args.tasks, args.workers, seconds, 0, args.chunksize, args.cut_every)
        print()
        print(f"| {args.tasks} x {args.task_ms:g} ms on {args.workers} workers | no kills s | a connection cut every "
              f"{args.cut_every:g} s: s | connections cut | results | ratio |")
        print("|---|---|---|---|---|---|")
        print(f"| roving.Pool.starmap(chunksize={args.chunksize}) | {calm:.2f} | {cut_s:.2f} | {cuts} | "
              f"all correct, in order | {cut_s / calm:.2f} |")


if __name__ == "__main__":
    main()
