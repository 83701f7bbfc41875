"""The link emulator delays a message by latency + bytes / bandwidth, sharing a link's bandwidth
between overlapping transfers, and keeps different links apart (the simulator's model)."""

import threading
import time

from roving.pipeline.runtime.emulate import LinkEmulator
from roving.pipeline.planning.network import Link

SLACK = 0.15  # the machine is shared: deliveries may come late, never early


def _arrivals(emu, sends):
    t0 = time.monotonic()
    got, lock = {}, threading.Lock()

    def deliver(key):
        def f():
            with lock:
                got[key] = time.monotonic() - t0
        return f

    for key, dst, nbytes in sends:
        emu.send(dst, nbytes, deliver(key))
    assert emu.drain(10)
    return got


def test_latency_plus_bandwidth_and_sharing_on_one_link():
    emu = LinkEmulator({"b": Link(0.05, 1e6), "c": Link(0.0, 1e6)})
    try:
        got = _arrivals(emu, [("alone", "c", 100_000)])
        assert 0.1 <= got["alone"] < 0.1 + SLACK
        # two overlapping transfers on b share it: each gets half the bandwidth
        got = _arrivals(emu, [("x", "b", 100_000), ("y", "b", 100_000), ("z", "c", 100_000)])
        for k in ("x", "y"):
            assert 0.25 <= got[k] < 0.25 + SLACK, got
        # the transfer on c does not wait for b's
        assert 0.1 <= got["z"] < 0.1 + SLACK, got
    finally:
        emu.close()
