"""Whether an emulated link (roving.pipeline.runtime.emulate) keeps the order in which one sender sent.

It does not, by design: overlapping transfers share a link's bandwidth (the simulator's model), so a
small transfer sent just after a large one arrives first. docs/ARCHITECTURE.md records this as one reason the
emulator sits at the pipeline's send call rather than in the transport, which promises order.

    python benchmarks/emulated_link_order.py            # 4 MiB, then 64 KiB 1 ms later; 1 Gbit/s, 10 ms
"""
from __future__ import annotations

import argparse
import threading
import time

from roving.pipeline.runtime.emulate import LinkEmulator
from roving.pipeline.planning.network import Link


def arrivals(big: int, small: int, gap_s: float, bandwidth_bps: float, latency_s: float) -> dict:
    emu = LinkEmulator({"b": Link(latency_s, bandwidth_bps)})
    start, got, lock = time.monotonic(), {}, threading.Lock()

    def mark(key: str):
        def deliver() -> None:
            with lock:
                got[key] = time.monotonic() - start
        return deliver

    try:
        emu.send("b", big, mark("large"))
        time.sleep(gap_s)
        emu.send("b", small, mark("small"))
        if not emu.drain(60):
            raise SystemExit("the emulator did not deliver within 60 s")
    finally:
        emu.close()
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--large", type=int, default=4 << 20, help="bytes of the first transfer")
    parser.add_argument("--small", type=int, default=64 << 10, help="bytes of the second transfer")
    parser.add_argument("--gap-ms", type=float, default=1.0, help="the second is sent this much later")
    parser.add_argument("--bandwidth", type=float, default=125e6, help="link bandwidth, bytes per second")
    parser.add_argument("--latency-ms", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3)
    a = parser.parse_args()
    for _ in range(a.repeats):
        got = arrivals(a.large, a.small, a.gap_ms / 1000, a.bandwidth, a.latency_ms / 1000)
        order = sorted(got, key=got.get)
        print(f"{a.large} B sent at 0 ms, {a.small} B at {a.gap_ms:g} ms: arrived "
              + ", ".join(f"{k} at {got[k] * 1000:.1f} ms" for k in order)
              + ("  (out of order)" if order[0] == "small" else ""))


if __name__ == "__main__":
    main()
