"""A fresh parent for test_addressing.py (its endpoint's address is chosen once per process, so each
case needs a process of its own): ``MODE [LOG_DIR]``; prints one JSON line of what it saw."""
import json
import sys
import time

import roving


def double(x):
    return 2 * x


def report_address(q):
    cfg = roving.config.current()
    own = roving.Queue()  # a queue owned by this child: its address is the child's own
    q.put((cfg.host, cfg.advertise, own._address))


def nothing():
    pass


def main(mode: str) -> dict:
    if mode in ("inherit", "wildcard"):
        roving.init(**({"host": "127.0.0.1", "advertise": "localhost"} if mode == "inherit" else {"host": "0.0.0.0"}))
        q = roving.Queue()
        p = roving.Process(target=report_address, args=(q,))
        p.start()
        host, advertise, child_queue = q.get(timeout=60)
        p.join(60)
        return {"parent_queue": q._address, "host": host, "advertise": advertise, "child_queue": child_queue}
    # 127.0.0.2 is loopback, but nothing of this session listens there: a child told to reach its parent
    # there cannot (a wrong advertise, as on a cluster whose nodes cannot route to the parent).
    roving.init(advertise="127.0.0.2", connect_timeout=2, child_output="files", log_dir=sys.argv[2])
    started = time.monotonic()
    if mode == "stranded":
        p = roving.Process(target=nothing, name="stranded")
        p.start()
        out = {}
        try:
            p.join(60)
        except roving.ProcessStartError as exc:
            out["error"] = str(exc)
        out["seconds"], out["exitcode"] = time.monotonic() - started, p.exitcode
        p.join(60)  # said once: a second join just returns
        return out
    roving.init(pool_start_failures=3)
    with roving.Pool(2) as pool:
        pending = pool.map_async(double, range(4))
        out = {}
        try:
            pending.get(120)
        except roving.PoolStartError as exc:
            out["error"] = str(exc)
        out["seconds"], out["failures"] = time.monotonic() - started, len(pool.start_failures)
        try:
            pool.apply(double, (1,))
        except roving.PoolStartError as exc:
            out["later"] = type(exc).__name__
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])), flush=True)
