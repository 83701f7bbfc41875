"""What opening one stream costs: connect, the greeting, TLS where asked, both proofs and the request,
then close. N streams opened one after another from this process to a stream listener of its own, on
127.0.0.1: plain text (``encrypt="auto"`` on loopback) and TLS 1.3 (``encrypt="always"``: what every
stream across hosts is). Two processes of one session (the root's CA issues both credentials), so the
proofs are two identities' as in a session. Prints the median and 90th percentile in microseconds, the
whole loop's seconds, and the process's CPU time per stream (the opener's and the listener's threads:
less moved by other load on the machine than the wall times). Uses only calls that are the same before
and after streams were bound to their channel (issue 51), so two trees compare side by side:

    PYTHONPATH=<tree>/src python3 benchmarks/stream_open.py --count 300
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import List

from roving.transport import identity
from roving.transport import stream as _stream


def _opened(request: dict, stream: _stream.Stream) -> bool:
    _stream.accept(stream)
    return True


def _times(address: str, creds: identity.Credentials, expect: str, encrypt: str, count: int) -> List[float]:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        _stream.connect(address, creds, {"purpose": "bench"}, 10, encrypt=encrypt, expect=expect).close()
        times.append((time.perf_counter() - start) * 1e6)
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=300)
    args = parser.parse_args(argv)
    root = identity.root(os.urandom(32), "root")
    opener = identity.Credentials(root.secret, root.authority.issue("opener"))
    served = identity.Credentials(root.secret, root.authority.issue("served"))
    for encrypt, name in (("auto", "stream (plain, loopback)"), ("always", "stream (TLS 1.3)")):
        listener = _stream.Listener(served, "127.0.0.1", None, _opened, encrypt=encrypt)
        try:
            _times(listener.address, opener, served.key, encrypt, 5)  # warm: certificates checked once
            start, cpu = time.perf_counter(), time.process_time()
            times = _times(listener.address, opener, served.key, encrypt, args.count)
            took, cpu = time.perf_counter() - start, time.process_time() - cpu
        finally:
            listener.close()
        p90 = statistics.quantiles(times, n=10)[-1]
        print(f"{name}: median {statistics.median(times):.0f} us, p90 {p90:.0f} us, "
              f"{args.count} in {took:.2f} s, CPU {cpu / args.count * 1e6:.0f} us per stream (both ends)")


if __name__ == "__main__":
    main()
