"""The pool's per-task CPU on each side of its wire, without processes or sockets: what the codec
(``roving.pool._protocol``) and the bookkeeping around it cost per task, apart from the scheduling noise
of workers on a loaded machine (pool_overhead.py and pool_round_trip.py measure the whole path).

    PYTHONPATH=<tree>/src python benchmarks/pool_wire.py --repeat 5

Rows (microseconds, the median of ``--repeat`` timed runs in this process):

* parent, per apply: one ``submit`` of one item to a dispatcher whose one worker has credit, the TASKS
  message it sends (to a fake node), and the RESULTS message back with the next credit
  (``Dispatcher.on_message``): the parent's side of one task of the 1 ms rounds.
* worker, per unit: the worker loop (``_worker._Loop``, on a fake channel) reading one TASKS message of
  one item, running it (a no-op) and sending its RESULTS: the worker's side of the same task.
* worker, per item of a map: one unit of 100,000 no-op items run by the worker loop (its results
  gathered into runs and sent): the worker's side of the map of 100,000.

The messages are made with the header structs both before and after issue 33 have (``TO_WORKER``,
``TO_PARENT``), so the same script times either tree: run it with each tree's ``src`` first on the
path, the trees' runs interleaved (before, after, before, after, ...).
"""
from __future__ import annotations

import argparse
import statistics
import time
from array import array
from typing import Any, List

from roving.pool import _protocol as P
from roving.pool import _worker
from roving.pool._dispatch import Dispatcher, WorkerState
from roving.transport.serialize import dumps


def noop(x: Any = None) -> Any:
    return x


class _Result:
    def _set_run(self, index: int, ok: bool, values: List[Any]) -> None:
        pass


class _Node:
    def __init__(self) -> None:
        self.last: Any = None

    def send_to(self, ident: bytes, frames: List[Any], undeliverable: Any = None) -> None:
        self.last = frames


class _Chan:
    def __init__(self) -> None:
        self.sent = 0

    def send(self, frames: List[Any]) -> None:
        self.sent += 1

    def recv(self, timeout: float) -> Any:
        return None

    def close(self, timeout: float = 0) -> None:
        pass


def parent_us(n: int) -> float:
    """Microseconds of the parent's CPU per apply (see the module docstring)."""
    disp = Dispatcher(900_000, max_task_retries=3)
    node = _Node()
    disp.node = node
    w = WorkerState(1, None)
    disp.add_worker(w)
    disp.on_message(b"w", P.HELLO, 1, 0, [])
    disp.on_message(b"w", P.READY, 1, 0, [])
    result, item = _Result(), ((1,), {})
    values = dumps([1])
    started = time.process_time()
    for _ in range(n):
        disp.submit(result, noop, P.APPLY, (item,), 1, inline=True)
        cid = P.TO_WORKER.unpack(node.last[0])[1]
        runs = array("q", (cid, 0, 1, 1)).tobytes()
        disp.on_message(b"w", P.RESULTS, 1, 0, [P.TO_PARENT.pack(disp.pool_id, P.RESULTS, 1, 0), runs, *values])
    return (time.process_time() - started) / n * 1e6


def _tasks(cid: int, fid: int, func_frames: List[Any], arg_frames: List[Any], count: int) -> List[Any]:
    header = P.TO_WORKER.pack(P.TASKS, cid, fid, 7, len(func_frames), len(arg_frames), count)
    return [header, b"", b"", *func_frames, *arg_frames]


def worker_unit_us(n: int) -> float:
    """Microseconds of the worker's CPU per unit of one item (see the module docstring)."""
    chan = _Chan()
    loop = _worker._Loop(chan, 900_000, None, lambda: chan)
    func = dumps((noop, int(P.MAP)))
    args = dumps([1])
    loop._take(_tasks(1, 5, func, args, 1))  # the function once; then its id only
    loop._turn(1)
    messages = [_tasks(cid, 5, [], args, 1) for cid in range(2, n + 2)]
    started = time.process_time()
    for frames in messages:
        loop._take(frames)
        loop._turn(1)
        loop.results.flush()
    return (time.process_time() - started) / n * 1e6


def worker_map_us(items: int) -> float:
    """Microseconds of the worker's CPU per item of one unit of ``items`` no-op items."""
    chan = _Chan()
    loop = _worker._Loop(chan, 900_000, None, lambda: chan)
    frames = _tasks(1, 5, dumps((noop, int(P.MAP))), dumps(list(range(items))), items)
    started = time.process_time()
    loop._take(frames)
    loop._turn(1)
    loop.results.flush()
    return (time.process_time() - started) / items * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("-n", type=int, default=20_000, help="tasks per timed run of the per-task rows")
    args = ap.parse_args()
    rows = {"parent, per apply (us)": lambda: parent_us(args.n),
            "worker, per unit of 1 item (us)": lambda: worker_unit_us(args.n),
            "worker, per item of a map of 100,000 (us)": lambda: worker_map_us(100_000)}
    for fn in rows.values():  # warm up
        fn()
    got = {name: [] for name in rows}
    for _ in range(args.repeat):
        for name, fn in rows.items():
            got[name].append(fn())
    for name, runs in got.items():
        print(f"| {name} | {statistics.median(runs):.2f} | min {min(runs):.2f} max {max(runs):.2f} |")


if __name__ == "__main__":
    main()
