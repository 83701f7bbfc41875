"""What one incoming connection costs the process that accepts it (issue 22: parent memory per worker).

Kinds (``--kind``), each measured as the accepting process's RSS and malloc'd bytes (glibc mallinfo2) with N
connections open from another process, less before, per connection:

* ``zmq``, ``zmq-curve``, ``zmq-curve-zap``: a bare ZeroMQ ROUTER (no roving), plain, with CURVE, and with
  CURVE and a ZAP handler that accepts everyone (as roving's node has one); each DEALER sends ``--messages``
  messages of 22 bytes first, which the ROUTER reads;
* ``roving-channel``: a roving node, each connection a ``transport.channel.Channel`` (CURVE, ZAP and the
  HMAC handshake: what a pool worker's work or heartbeat connection is);
* ``roving-stream``: a roving node, each connection a stream to its stream listener (what a roving child
  process opens to its parent for its payload and its parent-watch pings).

    python benchmarks/connection_memory.py --kind zmq-curve-zap --connections 1000 --messages 10
    PYTHONPATH=src python benchmarks/connection_memory.py --kind roving-stream --connections 1000
"""
from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import threading
import time

KINDS = ("zmq", "zmq-curve", "zmq-curve-zap", "roving-channel", "roving-stream")


class _Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _malloc() -> int:
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _Info
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _connector(kind: str, address: str, key: str, n: int, messages: int) -> None:
    """The other process: open ``n`` connections, say they are open on stdout, hold them until killed."""
    keep = []
    if kind.startswith("zmq"):
        import zmq

        ctx = zmq.Context()
        ctx.set(zmq.MAX_SOCKETS, 2 * n + 100)
        public, secret = zmq.curve_keypair()
        for _ in range(n):
            sock = ctx.socket(zmq.DEALER)
            if kind != "zmq":
                sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = key.encode(), public, secret
            sock.connect(address)
            keep.append(sock)
        for sock in keep:
            for _ in range(messages):
                sock.send_multipart([b"op", b"x" * 20])
    else:
        from roving.transport import stream as _stream
        from roving.transport.channel import Channel

        for _ in range(n):
            if kind == "roving-stream":
                keep.append(_stream.connect(address, bytes.fromhex(key), {"purpose": "node"}, 60.0))
            else:
                keep.append(Channel(address, bytes.fromhex(key), 60.0))
    print("open", flush=True)
    time.sleep(3600)


def measure(kind: str, n: int, messages: int) -> dict:
    """Open ``n`` connections of ``kind`` to this process; its memory per connection."""
    router = None  # the zmq kinds read the connections' messages
    if kind.startswith("zmq"):
        import zmq

        ctx = zmq.Context()
        ctx.set(zmq.MAX_SOCKETS, 2 * n + 100)
        if kind == "zmq-curve-zap":
            zap = ctx.socket(zmq.REP)
            zap.bind("inproc://zeromq.zap.01")

            def serve() -> None:
                while True:
                    request = zap.recv_multipart()
                    zap.send_multipart([request[0], request[1], b"200", b"OK", b"user", b""])

            threading.Thread(target=serve, daemon=True).start()
        router = ctx.socket(zmq.ROUTER)
        public, secret = zmq.curve_keypair()
        if kind != "zmq":
            router.curve_server, router.curve_secretkey, router.curve_publickey = True, secret, public
        if kind == "zmq-curve-zap":
            router.zap_domain = b"bench"
        address, key = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}", public.decode()
    else:
        from roving.transport import session as _session

        sess = _session.current()
        node = sess.node()
        address = node.streams().address if kind == "roving-stream" else node.address
        key = sess.secret.hex()
    time.sleep(0.5)
    rss0, malloc0 = _rss(), _malloc()
    other = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--connect", kind, address, key, str(n),
                              str(messages)], stdout=subprocess.PIPE)
    try:
        if other.stdout.readline() != b"open\n":
            raise SystemExit("the connecting process failed")
        for _ in range(n * messages if router is not None else 0):
            if not router.poll(60_000):
                raise SystemExit("the connections' messages did not all arrive within 60 s")
            router.recv_multipart()
        time.sleep(2.0)
        return {"kind": kind, "connections": n, "messages": messages if kind.startswith("zmq") else 0,
                "rss_kb_per_connection": round((_rss() - rss0) / n / 1024, 1),
                "malloc_kb_per_connection": round((_malloc() - malloc0) / n / 1024, 1)}
    finally:
        other.kill()
        other.wait(10)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--connect":
        _connector(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=KINDS, nargs="+", default=list(KINDS))
    ap.add_argument("--connections", type=int, default=1000)
    ap.add_argument("--messages", type=int, default=10, help="messages per connection first (zmq kinds)")
    args = ap.parse_args()
    for kind in args.kind:  # each in a fresh process: memory freed by the one before would be reused
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", kind, str(args.connections),
                              str(args.messages)], capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise SystemExit(f"{kind}: {out.stderr.strip()}")
        print(out.stdout.strip(), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        import json

        print(json.dumps(measure(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
    else:
        main()
