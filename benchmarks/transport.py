"""Round-trip latency and throughput of roving's Pipe and Queue against multiprocessing's, side by side.

For each message size a child echoes every message back; the figure is the mean round trip (parent send
→ child receive → child send → parent receive) and the throughput it implies (2 x size / round trip).
Both libraries run in the same invocation, interleaved by size, so machine noise hits both alike:
compare the ratios.

    python benchmarks/transport.py                 # 64 B, 1 MiB, 100 MiB; numpy payloads
    python benchmarks/transport.py --payload bytes
    python benchmarks/transport.py --transport zmq  # roving as it was before streams: all over ZeroMQ
    python benchmarks/transport.py --encrypted      # adds roving with encrypt="always" (TLS on loopback)
"""
from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time

import numpy as np

import roving

SIZES = {"64 B": 64, "1 MiB": 1 << 20, "100 MiB": 100 << 20}
ROUNDS = {64: 3000, 1 << 20: 200, 100 << 20: 6}


def pipe_echo(conn):
    while True:
        msg = conn.recv()
        if msg is None:
            return
        conn.send(msg)


def queue_echo(inbox, outbox):
    while True:
        msg = inbox.get()
        if msg is None:
            return
        outbox.put(msg)


def make_message(size: int, payload: str):
    if payload == "bytes":
        return bytes(size)
    return np.zeros(size, dtype=np.uint8)


def measure_pipe(lib, message, rounds: int, repeats: int) -> float:
    here, there = lib.Pipe()
    child = lib.Process(target=pipe_echo, args=(there,))
    child.start()
    for _ in range(min(rounds, 20)):  # warm up: connections, first allocations
        here.send(message)
        here.recv()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(rounds):
            here.send(message)
            here.recv()
        samples.append((time.perf_counter() - start) / rounds)
    here.send(None)
    child.join(30)
    return statistics.median(samples)


def measure_queue(lib, message, rounds: int, repeats: int) -> float:
    inbox, outbox = lib.Queue(), lib.Queue()
    child = lib.Process(target=queue_echo, args=(inbox, outbox))
    child.start()
    for _ in range(min(rounds, 20)):
        inbox.put(message)
        outbox.get(timeout=60)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(rounds):
            inbox.put(message)
            outbox.get(timeout=60)
        samples.append((time.perf_counter() - start) / rounds)
    inbox.put(None)
    child.join(30)
    return statistics.median(samples)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--payload", choices=["numpy", "bytes"], default="numpy")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per cell; the median is kept")
    parser.add_argument("--quick", action="store_true", help="a tenth of the rounds (a smoke run)")
    parser.add_argument("--transport", choices=["streams", "zmq"], default="streams",
                        help="zmq: no direct streams (pipes and requests all over ZeroMQ), to compare")
    parser.add_argument("--encrypted", action="store_true",
                        help="also roving with encrypt='always' (TLS 1.3 streams, CURVE), beside plain")
    args = parser.parse_args(argv)
    if args.encrypted:
        return main_encrypted(args)
    if args.transport == "zmq":
        from roving.transport import link, node

        node.streams_enabled = link.enabled = False
    libs = {"multiprocessing": multiprocessing.get_context("spawn"), "roving": roving}
    print(f"python {sys.version.split()[0]}, payload {args.payload}, roving transport {args.transport}, "
          f"median of {args.repeats} repeats")
    header = f"{'channel':8} {'size':>8} | {'mp round trip':>14} {'roving round trip':>18} | " \
             f"{'mp MiB/s':>9} {'roving MiB/s':>12} | {'roving/mp time':>14}"
    print(header)
    print("-" * len(header))
    for channel, measure in (("Pipe", measure_pipe), ("Queue", measure_queue)):
        for label, size in SIZES.items():
            rounds = max(2, ROUNDS[size] // (10 if args.quick else 1))
            message = make_message(size, args.payload)
            times = {name: measure(lib, message, rounds, args.repeats) for name, lib in libs.items()}
            rate = {name: 2 * size / t / 2**20 for name, t in times.items()}
            print(f"{channel:8} {label:>8} | {times['multiprocessing'] * 1e6:>11.0f} us "
                  f"{times['roving'] * 1e6:>15.0f} us | {rate['multiprocessing']:>9.0f} "
                  f"{rate['roving']:>12.0f} | {times['roving'] / times['multiprocessing']:>13.2f}x",
                  flush=True)


def main_encrypted(args) -> None:
    """multiprocessing, roving with plain loopback streams (encrypt="auto") and roving with every
    connection encrypted (encrypt="always"), interleaved by size. The mode is set before each cell's
    pipe, queues and child are made: the child inherits it, and every connection of the cell is new."""
    libs = {"multiprocessing": multiprocessing.get_context("spawn"), "plain": roving, "tls": roving}
    print(f"python {sys.version.split()[0]}, payload {args.payload}, median of {args.repeats} repeats; "
          "roving plain = encrypt auto on loopback, tls = encrypt always")
    header = f"{'channel':8} {'size':>8} | {'mp':>10} {'roving plain':>13} {'roving tls':>11} | " \
             f"{'tls MiB/s':>9} | {'tls/plain':>9} {'tls/mp':>7}"
    print(header)
    print("-" * len(header))
    for channel, measure in (("Pipe", measure_pipe), ("Queue", measure_queue)):
        for label, size in SIZES.items():
            rounds = max(2, ROUNDS[size] // (10 if args.quick else 1))
            message = make_message(size, args.payload)
            times = {}
            for name, lib in libs.items():
                if name != "multiprocessing":
                    roving.init(encrypt="always" if name == "tls" else "auto")
                times[name] = measure(lib, message, rounds, args.repeats)
            print(f"{channel:8} {label:>8} | {times['multiprocessing'] * 1e6:>7.0f} us "
                  f"{times['plain'] * 1e6:>10.0f} us {times['tls'] * 1e6:>8.0f} us | "
                  f"{2 * size / times['tls'] / 2**20:>9.0f} | {times['tls'] / times['plain']:>8.2f}x "
                  f"{times['tls'] / times['multiprocessing']:>6.2f}x", flush=True)


if __name__ == "__main__":
    main()
