"""Round trips through one process's node, with little else in them: a Queue and a Pipe of 64 bytes to a
child (transport.py's measure_queue and measure_pipe), and PUT+GET pairs of 64 bytes from a thread of
this process to its own node over a stream (an Endpoint without the local shortcut, as another
process's), which is the node's serve path alone.

    PYTHONPATH=<tree>/src python3 benchmarks/node_serve.py [--pairs 5000] [--repeats 5]

Prints one line: ``RESULT queue64 <µs> pipe64 <µs> put+get-in-process <µs>`` (medians of the repeats).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import roving
import transport as tb  # benchmarks/transport.py, beside this script
from roving.transport import node as _node
from roving.transport import session as _session
from roving.transport.endpoint import Endpoint


def put_get_in_process(pairs: int, repeats: int) -> float:
    """Seconds per PUT+GET pair from this thread to this process's node, over a stream."""
    q = roving.Queue()
    ep = Endpoint(q._address, _session.current().secret, None)
    for _ in range(50):
        ep.call(_node.PING, 0, 0)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(pairs):
            ep.call(_node.PUT, q._box, 0, [b"x" * 64])
            ep.call(_node.GET, q._box, 1)
        samples.append((time.perf_counter() - start) / pairs)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    msg = tb.make_message(64, "bytes")
    q = tb.measure_queue(roving, msg, 3000, args.repeats)
    p = tb.measure_pipe(roving, msg, 3000, args.repeats)
    r = put_get_in_process(args.pairs, args.repeats)
    print(f"RESULT queue64 {q * 1e6:.0f} pipe64 {p * 1e6:.0f} put+get-in-process {r * 1e6:.0f}", flush=True)


if __name__ == "__main__":
    main()
