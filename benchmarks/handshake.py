"""What opening one authenticated connection costs, and preparing one child's start: the per-connection
and per-child parts of roving's security, apart from any message's cost.

In one process: a node, and N connections opened to it one after another (each authenticated, then
closed): a stream (the way a thread reaches a node), a ZeroMQ connection (managers, locks), and a TLS
stream (``encrypt="always"``: what every stream across hosts is). Then N times what the parent adds to a
child's job environment (``Session.child_env``: with per-process identities, the child's credentials are
issued there). Median and 90th percentile in microseconds. Runs against any tree of roving (the calls
it uses are the same before and after identities), so two trees can be compared side by side:

    PYTHONPATH=<tree>/src python benchmarks/handshake.py --count 300
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable, List

from roving.transport import crypto
from roving.transport import endpoint as _endpoint
from roving.transport import node as _node
from roving.transport import session as _session


def _timed(fn: Callable[[], None], count: int) -> List[float]:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=300)
    args = parser.parse_args(argv)
    session = _session.current()
    node = session.node()
    listener = node.streams().address
    rows = {}

    def stream() -> None:
        _endpoint._StreamConnection(node.address, listener, session.secret, 10).close()

    def zeromq() -> None:
        _endpoint._ZmqConnection(node.address, session.secret, 10).close()

    rows["stream (plain, loopback)"] = _timed(stream, args.count)
    rows["ZeroMQ (CURVE)"] = _timed(zeromq, args.count)
    tls_node = _node.Node(session.secret, encrypt="always")
    tls_listener = tls_node.streams().address
    real_mode = crypto.mode
    crypto.mode = lambda: "always"  # type: ignore[assignment]
    try:
        rows["stream (TLS 1.3)"] = _timed(
            lambda: _endpoint._StreamConnection(tls_node.address, tls_listener, session.secret, 10).close(),
            args.count)
    finally:
        crypto.mode = real_mode  # type: ignore[assignment]
        tls_node.close()
    rows["a child's job environment"] = _timed(
        lambda: session.child_env({"uid": _session.new_uid(), "parent": node.address, "box": 1}), args.count)
    print(f"| {args.count} each | median us | 90th percentile us |")
    print("|---|---|---|")
    for name, times in rows.items():
        times.sort()
        print(f"| {name} | {statistics.median(times):.0f} | {times[int(len(times) * 0.9)]:.0f} |", flush=True)
    os._exit(0)  # the connections' exit flush has nothing to wait for


if __name__ == "__main__":
    main()
