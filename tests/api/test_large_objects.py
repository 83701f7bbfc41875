"""Large numpy arrays between processes on the local backend: a Pool call's argument and result, a
Process's argument, queue items, roving.shared data, each arriving whole, with the parent's peak memory at
most about twice the array (measured by tests/support/programs/large_objects.py, a parent of its own);
and once, a result past 4 GiB (pickle's and many transports' old limit) in one piece."""
from __future__ import annotations

import json
import os
import sys

import helpers_core as hc

PROGRAM = str(hc.PROGRAMS / "large_objects.py")
MiB = 2**20


def moved(mib: float, *paths: str, options: dict = None) -> dict:
    import subprocess

    done = subprocess.run([sys.executable, PROGRAM, json.dumps(options or {}), str(mib), *paths],
                          capture_output=True, text=True, timeout=900, env={**os.environ})
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])["paths"]


def test_an_array_arrives_whole_through_each_path_with_the_parents_peak_at_most_twice_its_size():
    seen = moved(384.5, "pool", "result", "process", "queue", "shared")
    for path, got in seen.items():
        assert got["same"], f"{path}: what arrived is not what was sent"
        # the parent holds the array and what comes back (the result path: only what comes back)
        assert got["peak_over"] <= 2.1 * got["bytes"], (path, got["peak_over"] / got["bytes"])
    assert seen["result"]["peak_over"] <= 1.1 * seen["result"]["bytes"]


def test_a_result_past_4_gib_arrives_whole_with_the_parents_peak_about_its_size():
    # the one test past the 4 GiB boundary (this machine's memory is shared): 4 GiB and 16 MiB made in a
    # worker, moved as one result
    avail = int(open("/proc/meminfo").read().split("MemAvailable:")[1].split()[0]) * 1024
    assert avail > 10 * 2**30, f"this test needs 10 GiB of free memory, the machine has {avail / 2**30:.1f} GiB"
    got = moved(4 * 1024 + 16, "result")["result"]
    assert got["same"] and got["bytes"] > 2**32
    assert got["peak_over"] <= 1.1 * got["bytes"], got["peak_over"] / got["bytes"]
