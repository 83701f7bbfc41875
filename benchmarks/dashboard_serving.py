"""What the dashboard's server costs the program per request: CPU seconds of the serving process and
wall time per ``/api/state`` answer, asked 400 times over one keep-alive connection by a client in
another process (as a browser polling the page does, but without pause).

    python benchmarks/dashboard_serving.py                              # the roving on sys.path
    python benchmarks/dashboard_serving.py --src /old/src --src src --repeat 3   # two trees, interleaved

Each ``--src`` is put first on the serving process's PYTHONPATH; the trees' runs alternate.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import time

REQUESTS = 400


def _serve() -> None:
    from roving.dashboard import Server, Views

    server = Server(Views()).start()
    print(json.dumps({"port": server.port, "token": server.token}), flush=True)
    for _ in range(2):  # before and after the client's timed requests
        sys.stdin.readline()
        t = os.times()
        print(t.user + t.system, flush=True)
    sys.stdin.readline()


def _measure(src: str) -> tuple:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = os.path.abspath(src)
    proc = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        info = json.loads(proc.stdout.readline())
        conn = http.client.HTTPConnection("127.0.0.1", info["port"], timeout=30)
        path = f"/api/state?token={info['token']}"

        def ask() -> None:
            conn.request("GET", path)
            answer = conn.getresponse()
            answer.read()
            assert answer.status == 200, answer.status

        def cpu() -> float:
            proc.stdin.write("\n")
            proc.stdin.flush()
            return float(proc.stdout.readline())

        for _ in range(20):  # warm: imports, first snapshot
            ask()
        cpu0, t0 = cpu(), time.perf_counter()
        for _ in range(REQUESTS):
            ask()
        wall, cpu1 = time.perf_counter() - t0, cpu()
        proc.stdin.write("\n")
        proc.stdin.flush()
        return (cpu1 - cpu0) / REQUESTS, wall / REQUESTS
    finally:
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--src", action="append", default=[], help="a source tree to serve from (repeatable)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if args.serve:
        _serve()
        return
    trees = args.src or [""]
    print("| tree | server CPU ms/request | wall ms/request |")
    print("|---|---|---|")
    for _ in range(args.repeat):
        for src in trees:
            cpu, wall = _measure(src)
            print(f"| {src or '(sys.path)'} | {cpu * 1000:.3f} | {wall * 1000:.3f} |", flush=True)


if __name__ == "__main__":
    main()
