"""Large numpy arrays between processes: roving beside the standard library's multiprocessing (spawn).

Each measurement runs in a fresh parent process of its own (``--one``), which moves one array of the size
given through one path and reports the seconds from the call to its arrival and its own peak memory above
what it held before (VmHWM, reset through /proc/self/clear_refs; the array made in the parent counts):

* ``arg``: a Pool call's argument (the worker returns a checksum);
* ``result``: a Pool call's result (the worker makes the array);
* ``queue``: a queue item from a child process to the parent;
* ``shared``: read-only data made in the parent and read by a worker (roving.shared; multiprocessing's
  ``shared_memory.SharedMemory`` with a numpy view).

Each parent first starts its pool or child and waits until it runs, so start-up is not counted. A
measurement runs only when the machine has ``2.5 x size + 1 GiB`` available (MemAvailable); otherwise its
row says so. The standard library's are run at the smaller sizes only: it pickles the array into one bytes
object (in band), so a parent and a child each hold about twice the array.

    PYTHONPATH=src python benchmarks/large_objects.py --sizes 1024 --libs roving,mp
    PYTHONPATH=src python benchmarks/large_objects.py --sizes 5120 --libs roving

``--backend slurm`` runs roving's other process as a Slurm job (the Pool's worker, the child): with
``SLURM_CONF`` naming the test hosts' multi-node Slurm, on another host, every transfer crossing the
network (TLS)::

    SLURM_CONF=/etc/slurm-hosts/slurm.conf PYTHONPATH=src python benchmarks/large_objects.py \
        --sizes 5120 --libs roving --backend slurm --paths arg,result,queue
"""
from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import socket
import subprocess
import sys
import time
from typing import Any, Dict, List

import numpy as np

MiB = 2**20
STRIDE = 4096
PATHS = ("arg", "result", "queue", "shared")


def make(nbytes: int) -> np.ndarray:
    a = np.full(nbytes, 7, dtype=np.uint8)
    a[::STRIDE] = (np.arange(len(a[::STRIDE])) % 251).astype(np.uint8)
    return a


def checksum(a: Any) -> List[int]:
    return [int(a.nbytes), int(a[::STRIDE].astype(np.uint64).sum()), int(a[-1])]


def expected(nbytes: int) -> List[int]:
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


def available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise LookupError("MemAvailable")


def ready() -> str:
    return socket.gethostname()


def sum_of(a: Any) -> List[int]:
    return checksum(a)


def made_here(nbytes: int) -> Any:
    return make(nbytes)


def put_made(q: Any, nbytes: int, go: Any) -> None:
    go.get()
    q.put((make(nbytes), socket.gethostname()))


def sum_of_shared(handle: Any) -> List[int]:
    return checksum(handle.get())


def sum_of_segment(name: str, nbytes: int) -> List[int]:
    from multiprocessing import shared_memory

    seg = shared_memory.SharedMemory(name=name)
    try:
        return checksum(np.ndarray((nbytes,), dtype=np.uint8, buffer=seg.buf))
    finally:
        seg.close()


def _api(lib: str, backend: str) -> Any:
    if lib == "roving":
        import roving

        roving.init(child_output="off", backend=backend)
        return roving
    return multiprocessing.get_context("spawn")


def one(lib: str, path: str, nbytes: int, backend: str = "local") -> Dict[str, Any]:
    """One measurement in this process (see the module docstring)."""
    api = _api(lib, backend)
    pool = q = go = child = None
    host = "?"
    if path in ("arg", "result", "shared"):
        pool = api.Pool(1)
        host = pool.apply(ready)
    else:
        q, go = api.Queue(), api.Queue()
        child = api.Process(target=put_made, args=(q, nbytes, go))
        child.start()
    gc.collect()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    seg = None
    if path == "result":
        started = time.monotonic()
        got = checksum(pool.apply(made_here, (nbytes,)))
    elif path == "queue":
        started = time.monotonic()
        go.put(1)
        array, host = q.get(timeout=1200)
        got = checksum(array)
        del array
        child.join()
    else:
        a = make(nbytes)
        started = time.monotonic()
        if path == "arg":
            got = pool.apply(sum_of, (a,))
        elif lib == "roving":
            handle = api.shared(a)
            got = pool.apply(sum_of_shared, (handle,))
            handle.release()
        else:
            from multiprocessing import shared_memory

            seg = shared_memory.SharedMemory(create=True, size=nbytes)
            np.ndarray((nbytes,), dtype=np.uint8, buffer=seg.buf)[:] = a
            got = pool.apply(sum_of_segment, (seg.name, nbytes))
    seconds = time.monotonic() - started
    peak = _status("VmHWM") - before
    if seg is not None:
        seg.close()
        seg.unlink()
    if pool is not None:
        pool.close()
        pool.join()
    return {"seconds": seconds, "peak": peak, "ok": got == expected(nbytes), "host": host}


def run(lib: str, path: str, mib: int, backend: str) -> Dict[str, Any]:
    nbytes = mib * MiB
    need = int(2.5 * nbytes) + 2**30
    if available() < need:
        return {"skipped": f"MemAvailable {available() / 2**30:.1f} GiB < {need / 2**30:.1f} GiB"}
    done = subprocess.run([sys.executable, __file__, "--one", lib, path, str(mib), "--backend", backend],
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        return {"skipped": f"failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1024", help="MiB, comma-separated")
    ap.add_argument("--libs", default="roving,mp")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--backend", default="local", help="roving's backend (the standard library's is local)")
    ap.add_argument("--one", nargs=3, metavar=("LIB", "PATH", "MIB"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        lib, path, mib = args.one
        print(json.dumps(one(lib, path, int(mib) * MiB, args.backend)))
        return
    print(f"python {sys.version.split()[0]}; roving backend {args.backend}; seconds from the call to the arrival; "
          "peak: the parent's VmHWM above what it held before, as a multiple of the array")
    print("| size | path | roving s | roving MiB/s | roving peak | mp s | mp MiB/s | mp peak | roving/mp time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mib in (int(s) for s in args.sizes.split(",")):
        for path in args.paths.split(","):
            rows = {lib: run(lib, path, mib, args.backend) for lib in args.libs.split(",")}
            cells = []
            for lib in ("roving", "mp"):
                r = rows.get(lib)
                if r is None or "skipped" in r:
                    cells += [r["skipped"] if r else "not run", "", ""]
                    continue
                mark = ("" if r["ok"] else " (WRONG DATA)") + (f" on {r['host']}" if r["host"] != socket.gethostname()
                                                               else "")
                cells += [f"{r['seconds']:.2f}{mark}", f"{mib / r['seconds']:.0f}",
                          f"{r['peak'] / (mib * MiB):.2f}x"]
            ratio = (f"{rows['roving']['seconds'] / rows['mp']['seconds']:.2f}x"
                     if all(lib in rows and "seconds" in rows[lib] for lib in ("roving", "mp")) else "")
            print(f"| {mib / 1024:g} GiB | {path} | " + " | ".join(cells) + f" | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
