"""A roving parent that moves one large numpy array through each path between processes and measures its
own peak memory for each: a Pool call's argument and result (``pool``: the worker returns what it got), a
Pool call's result alone (``result``: the worker makes the array), a Process's argument and a queue item
back (``process``), a queue item each way (``queue``), and roving.shared data read by a worker
(``shared``). Prints, as JSON, per path: whether what arrived is what was sent, the parent's peak memory
above what it held before (VmHWM, reset before each path through /proc/self/clear_refs), the seconds it
took and the host the other process ran on.

usage: large_objects.py OPTIONS_JSON MIB PATH...   (OPTIONS_JSON: roving.init's keyword arguments)

A program of its own: its memory is its own to measure, and a process's roving endpoint binds once, with
the options of its first use (tests/support/helpers_hosts.py).
"""
import gc
import json
import socket
import sys
import time

import numpy as np

import roving

MiB = 2**20
STRIDE = 4096


def make(nbytes: int) -> np.ndarray:
    """An array of ``nbytes`` whose every page is written, in a pattern :func:`checksum` sees."""
    a = np.full(nbytes, 7, dtype=np.uint8)
    a[::STRIDE] = (np.arange(len(a[::STRIDE])) % 251).astype(np.uint8)
    return a


def checksum(a) -> list:
    return [int(a.nbytes), int(a[::STRIDE].astype(np.uint64).sum()), int(a[-1])]


def expected(nbytes: int) -> list:
    """:func:`checksum` of ``make(nbytes)``, without making it."""
    k = -(-nbytes // STRIDE)
    full, rest = divmod(k, 251)
    last = ((nbytes - 1) // STRIDE) % 251 if (nbytes - 1) % STRIDE == 0 else 7
    return [nbytes, full * (250 * 251 // 2) + rest * (rest - 1) // 2, last]


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise LookupError(field)


def echo(a):
    return a, socket.gethostname()


def made_here(nbytes):
    return make(nbytes), socket.gethostname()


def echo_from_queue(q_in, q_out):
    q_out.put((q_in.get(timeout=600), socket.gethostname()))


def send_back(a, q_out):
    q_out.put((a, socket.gethostname()))


def sum_of_shared(handle):
    return checksum(handle.get()), socket.gethostname()


def _move(path: str, nbytes: int):
    """(checksum of what arrived, host of the other process)."""
    if path == "result":
        with roving.Pool(1) as pool:
            back, host = pool.apply(made_here, (nbytes,))
        return checksum(back), host
    a = make(nbytes)
    if path == "pool":
        with roving.Pool(1) as pool:
            back, host = pool.apply(echo, (a,))
    elif path in ("process", "queue"):
        q_in, q_out = roving.Queue(), roving.Queue()
        p = (roving.Process(target=send_back, args=(a, q_out)) if path == "process" else
             roving.Process(target=echo_from_queue, args=(q_in, q_out)))
        p.start()
        if path == "queue":
            q_in.put(a)
        back, host = q_out.get(timeout=600)
        p.join(60)
    elif path == "shared":
        handle = roving.shared(a)
        with roving.Pool(1) as pool:
            got, host = pool.apply(sum_of_shared, (handle,))
        handle.release()
        return got, host
    else:
        raise SystemExit(f"unknown path {path!r}")
    return checksum(back), host


def one_path(path: str, nbytes: int) -> dict:
    gc.collect()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    started = time.monotonic()
    got, host = _move(path, nbytes)
    seconds = time.monotonic() - started
    gc.collect()
    return {"same": got == expected(nbytes), "peak_over": _status("VmHWM") - before, "bytes": nbytes,
            "seconds": seconds, "host": host}


if __name__ == "__main__":
    options, mib, paths = json.loads(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
    roving.init(child_output="off", **options)
    out = {path: one_path(path, int(mib * MiB)) for path in paths}
    print(json.dumps({"parent": socket.gethostname(), "paths": out}))
