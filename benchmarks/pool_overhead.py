"""Framework overhead of roving's Pool beside multiprocessing's, loky's and Ray's, in one run.

The Fiber paper's test (arXiv 2003.11164, Fig. 4): 5 workers, rounds of 5 ``apply_async`` of tasks that
sleep 1, 10 and 100 ms, about 1 s of work per size (so 0.2 s of wall time at best), waiting for each
round before the next; plus a ``map`` of 100,000 no-op items and 2,000 ``apply_async`` at once. Each
figure is the median of ``--repeat`` runs; the peers' runs are interleaved in the same invocation (Ray's
after the others, alone, since its daemons load the machine).

    python benchmarks/pool_overhead.py                       # every peer that is installed
    python benchmarks/pool_overhead.py --peers roving multiprocessing --repeat 5
    python benchmarks/pool_overhead.py --peers roving multiprocessing --encrypt off   # roving's option
    python benchmarks/pool_overhead.py --peers roving --dashboard --repeat 5   # dashboard off vs on

With ``--dashboard`` a second roving pool, "roving+dashboard", runs beside "roving": before each of its
runs the dashboard (roving.dashboard) is served and a headless Chromium (selenium, Debian's chromium and
chromium-driver) shows its Pools page, polling it every second; before each run of "roving" the browser
leaves the page (about:blank) and the dashboard is stopped. Both are measured in the same process,
interleaved, so that the machine's load hits them alike. ``--browser-nice 19`` runs the browser at the
lowest priority: on a machine of two cores a browser at the program's priority takes its CPU from the
pool's workers, which a browser on the user's own machine (the usual case) does not.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

import roving

WORKERS = 5
SLEEPS = (0.001, 0.01, 0.1)
TOTAL_WORK_S = 1.0


def sleep_task(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def noop(x: Any) -> Any:
    return x


class _Loky:
    """loky's reusable executor behind the two Pool calls the benchmark makes."""

    def __init__(self, n: int) -> None:
        import loky

        self._ex = loky.get_reusable_executor(max_workers=n, reuse=False)

    def apply_async(self, func: Callable, args: tuple = ()) -> Any:
        fut = self._ex.submit(func, *args)
        fut.get = fut.result
        return fut

    def map(self, func: Callable, items: Any) -> List[Any]:
        items = list(items)
        return list(self._ex.map(func, items, chunksize=max(1, len(items) // (WORKERS * 4))))

    def terminate(self) -> None:
        self._ex.shutdown(wait=True)


class _Watched:
    """``--dashboard``: the dashboard served and a browser watching it, or neither (see the docstring)."""

    def __init__(self, nice: int = 0) -> None:
        import os
        import stat
        import tempfile

        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        driver = "/usr/bin/chromedriver"
        if nice:  # the driver, and so the browser it starts, at a lower priority than the program
            self._wrapper_dir = tempfile.mkdtemp(prefix="roving-bench-")
            driver = os.path.join(self._wrapper_dir, "chromedriver")
            with open(driver, "w") as f:
                f.write(f"#!/bin/sh\nexec nice -n {int(nice)} /usr/bin/chromedriver \"$@\"\n")
            os.chmod(driver, stat.S_IRWXU)
        opts = webdriver.ChromeOptions()
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                    "--window-size=1280,1000"):
            opts.add_argument(arg)
        self.driver = webdriver.Chrome(service=Service(driver), options=opts)
        self.on = False
        self.watched_s = self.browser_cpu_s = 0.0
        self._since = (0.0, 0.0)

    def _browser_cpu(self) -> float:
        """CPU seconds used so far by the browser's processes (the driver's descendants), from /proc."""
        import os

        tick = os.sysconf("SC_CLK_TCK")
        parents, total = {self.driver.service.process.pid}, 0.0
        stats = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                stats.append((int(entry), int(fields[1]), int(fields[11]) + int(fields[12])))
        grew = True
        while grew:
            grew = False
            for pid, ppid, _ in stats:
                if ppid in parents and pid not in parents:
                    parents.add(pid)
                    grew = True
        for pid, _, ticks in stats:
            if pid in parents:
                total += ticks / tick
        return total

    def request_cost(self) -> float:
        """Median seconds this process spends on one answer of /api/state (what the page asks once a
        second), measured over 50 answers while the pools exist."""
        import urllib.request

        from roving import dashboard

        url = dashboard.start(announce=False).url.replace("/?", "/api/state?")
        took = []
        for _ in range(50):
            t0 = time.thread_time()
            # the work of the server thread for one answer (done here, to time it)
            json.dumps(dashboard.current().views.state(), default=str)
            took.append(time.thread_time() - t0)
        urllib.request.urlopen(url, timeout=30).read()
        return statistics.median(took)

    def set(self, on: bool) -> None:
        from roving import dashboard

        if on and not self.on:
            self.driver.get(dashboard.start(announce=False).url + "#pools")
        elif not on and self.on:
            self.watched_s += time.monotonic() - self._since[0]
            self.browser_cpu_s += self._browser_cpu() - self._since[1]
            self.driver.get("about:blank")
            dashboard.stop()
        # the page loaded, drawn and polling once a second (its steady state), or the browser quiet; the
        # same wait either way, so that both pools come to each run after the same idle time
        time.sleep(3.0)
        if on and not self.on:
            self._since = (time.monotonic(), self._browser_cpu())
        self.on = on

    def close(self) -> None:
        self.set(False)
        self.driver.quit()


_watched: Any = None
_stat = "median"


def _make(peer: str) -> Any:
    if peer in ("roving", "roving+dashboard"):
        return roving.Pool(WORKERS)
    if peer == "multiprocessing":
        return multiprocessing.Pool(WORKERS)
    if peer == "loky":
        return _Loky(WORKERS)
    if peer == "ray":
        import ray
        from ray.util.multiprocessing import Pool as RayPool

        ray.init(num_cpus=WORKERS, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
        return RayPool(WORKERS)
    raise ValueError(peer)


def _installed(peer: str) -> bool:
    if peer in ("roving", "multiprocessing", "roving+dashboard"):
        return True
    try:
        __import__({"ray": "ray.util.multiprocessing"}.get(peer, peer))
        return True
    except ImportError:
        return False


def _rounds(pool: Any, seconds: float) -> float:
    n = round(TOTAL_WORK_S / seconds)
    start = time.perf_counter()
    for _ in range(0, n, WORKERS):
        for r in [pool.apply_async(sleep_task, (seconds,)) for _ in range(WORKERS)]:
            r.get()
    return time.perf_counter() - start


def _map(pool: Any) -> float:
    start = time.perf_counter()
    out = pool.map(noop, range(100_000))
    took = time.perf_counter() - start
    assert len(out) == 100_000 and out[-1] == 99_999
    return took


def _apply_many(pool: Any) -> float:
    start = time.perf_counter()
    results = [pool.apply_async(noop, (i,)) for i in range(2000)]
    assert [r.get() for r in results] == list(range(2000))
    return time.perf_counter() - start


TESTS: Dict[str, Callable[[Any], float]] = {
    **{f"rounds of 5 x {int(s * 1000)} ms ({round(TOTAL_WORK_S / s)} tasks; ideal 0.20 s)":
       (lambda p, s=s: _rounds(p, s)) for s in SLEEPS},
    "map of 100,000 no-op items": _map,
    "2,000 apply_async (no-op)": _apply_many,
}


def _close(peer: str, pool: Any) -> None:
    pool.terminate()
    if peer == "ray":
        import ray

        ray.shutdown()


def measure(peers: List[str], repeat: int) -> Dict[str, Dict[str, float]]:
    """Each test ``repeat`` times, the peers' runs interleaved (so that the machine's load hits them
    alike), every pool up and warm before the clocks start."""
    pools = {}
    try:
        for peer in peers:
            pools[peer] = _make(peer)
            pools[peer].map(noop, range(WORKERS * 4))
        time.sleep(1.0)
        if _watched is not None:
            cost = _watched.request_cost()
            print(f"# dashboard: one /api/state answer costs {cost * 1000:.2f} ms of CPU in this process "
                  f"(median of 50; once a second per browser: {cost * 100:.3f}% of one core)", file=sys.stderr)
        runs: Dict[str, Dict[str, List[float]]] = {p: {name: [] for name in TESTS} for p in peers}
        for name, test in TESTS.items():
            for _ in range(repeat):
                for peer in peers:
                    if _watched is not None:
                        _watched.set(peer == "roving+dashboard")
                    runs[peer][name].append(test(pools[peer]))
        pick = min if _stat == "min" else statistics.median
        return {p: {name: pick(v) for name, v in runs[p].items()} for p in peers}
    finally:
        for peer, pool in pools.items():
            _close(peer, pool)


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", nargs="+", default=["roving", "multiprocessing", "loky", "ray"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--encrypt", choices=["auto", "always", "off"], default="auto",
                        help="roving's encrypt option (auto: CURVE on ZeroMQ, plain loopback streams)")
    parser.add_argument("--dashboard", action="store_true",
                        help="add the peer roving+dashboard: roving with the dashboard on and a browser watching")
    parser.add_argument("--browser-nice", type=int, default=0, metavar="N",
                        help="with --dashboard: run the browser under nice -n N (as a browser on another "
                             "machine, it then takes no CPU the program wants; 0: the same priority)")
    parser.add_argument("--stat", choices=["median", "min"], default="median",
                        help="each figure: the median of the runs, or the fastest (less sensitive to a loaded machine)")
    args = parser.parse_args(argv)
    roving.init(encrypt=args.encrypt)
    global _watched, _stat
    _stat = args.stat
    if args.dashboard:
        _watched = _Watched(args.browser_nice)
        if "roving+dashboard" not in args.peers:
            args.peers.insert(args.peers.index("roving") + 1 if "roving" in args.peers else 0, "roving+dashboard")
    print(f"# roving encrypt={args.encrypt}", file=sys.stderr)
    present = [p for p in args.peers if _installed(p)]
    for peer in set(args.peers) - set(present):
        print(f"# {peer}: not installed", file=sys.stderr)
    # Ray runs alone, after the others: its own daemons would load the machine while they are measured.
    try:
        figures = measure([p for p in present if p != "ray"], args.repeat)
    finally:
        if _watched is not None:
            _watched.close()
            print(f"# the browser watching used {_watched.browser_cpu_s:.2f} s of CPU in "
                  f"{_watched.watched_s:.1f} s of runs with the dashboard on "
                  f"({100 * _watched.browser_cpu_s / max(_watched.watched_s, 1e-9):.1f}% of one core)", file=sys.stderr)
    if "ray" in present:
        figures.update(measure(["ray"], args.repeat))
    peers = list(figures)
    base, with_dash = "multiprocessing", "roving+dashboard" in figures
    if with_dash:
        base = "roving"
    print("| seconds (%s of %d) | %s | %s / %s |" % (args.stat, args.repeat, " | ".join(peers),
                                                       "roving+dashboard" if with_dash else "roving", base))
    print("|---" * (len(peers) + 2) + "|")
    for name in TESTS:
        row = [f"{figures[p][name]:.3f}" for p in peers]
        top = "roving+dashboard" if with_dash else "roving"
        ratio = (f"{figures[top][name] / figures[base][name]:.{3 if with_dash else 2}f}"
                 if {top, base} <= set(figures) else "")
        print(f"| {name} | {' | '.join(row)} | {ratio} |")


if __name__ == "__main__":
    main()
