"""The client hosts of benchmarks/pool_capacity.py: one subprocess holds many lightweight pool workers in
one single-threaded poll loop (see that file's docstring for what each worker is and does).

    python benchmarks/pool_capacity_clients.py ADDRESS SECRET_HEX one|two STREAMS STREAM_ADDRESS JITTER

(with ``POOL_CAPACITY_TRANSPORT=zmq`` in the environment its workers' channels are ZeroMQ, else streams)
reads ``start POOL WID...``, ``task SECONDS`` and ``kill WID...`` lines on stdin, until it ends.
"""
from __future__ import annotations

import heapq
import os
import sys
import time
from array import array
from typing import Any, Dict, List, Optional

class _Client:
    __slots__ = ("wid", "chan", "beat", "units", "asked", "depth", "key", "running", "leaving", "acked", "quiet",
                 "streams")

    def __init__(self, wid: int) -> None:
        self.wid = wid
        self.chan: Any = None
        self.beat: Any = None
        self.units: List[Any] = []
        self.asked = 0
        self.depth = 1
        self.key = 0
        self.running: Optional[Any] = None
        self.leaving = False
        self.acked = False
        self.quiet = 0.0  # since when nothing arrived on its work channel (or its last word on it)
        self.streams: List[Any] = []  # with --streams: as a real worker process's streams to the parent


def _host(address: str, one_connection: bool, n_streams: int, stream_address: str, jitter: float) -> None:
    import random

    import zmq

    zmq.Context.instance().set(zmq.MAX_SOCKETS, 30000)
    from roving import config as _config
    from roving.pool import _protocol as P
    from roving.transport import stream as _stream
    from roving.transport.channel import Channel
    from roving.transport.serialize import dumps
    from roving.transport import session as _session
    from roving.transport.wire import HEADER, PING, REQUEST

    secret = _session.current().credentials  # a child of the benchmark's session (its environment says)

    interval = _config.current().heartbeat_interval
    # as a real worker: its channels are streams where the parent's node has a listener (else ZeroMQ);
    # pool_capacity.py --transport zmq makes them ZeroMQ (the pool's transport before streams)
    over_streams = os.environ.get("POOL_CAPACITY_TRANSPORT", "streams") == "streams"

    def _key(ch: Any) -> Any:
        return ch.pollable

    poller = zmq.Poller()
    stdin = sys.stdin.fileno()
    os.set_blocking(stdin, False)
    poller.register(stdin, zmq.POLLIN)
    by_sock: Dict[Any, _Client] = {}
    by_fd: Dict[int, Any] = {}  # a stream's descriptor -> (client, stream)

    def drop_streams(c: _Client) -> None:
        for st in c.streams:
            by_fd.pop(st.sock.fileno(), None)
            try:
                poller.unregister(st.sock.fileno())
            except KeyError:
                pass
            st.close()
        c.streams = []
    clients: Dict[int, _Client] = {}
    timers: List[Any] = []  # (when, seq, kind, client)
    seq = 0
    pool_id = 0
    buf = b""

    def send(c: _Client, kind: int, arg: int, key: int = 0) -> None:
        c.chan.send([P.OP, P.TO_PARENT.pack(pool_id, kind, arg, key)])

    def want(c: _Client) -> int:
        if c.leaving:
            return 0
        held = len(c.units) + c.asked + (1 if c.running else 0)
        if held > c.depth // 2:
            return 0
        return c.depth - held

    def start_next(c: _Client, now: float) -> None:
        nonlocal seq
        if c.running is not None or not c.units:
            return
        unit = c.units.pop(0)
        if unit[3] != c.key:
            c.key, c.depth = unit[3], 1
        c.running = unit
        seq += 1
        took = unit[1] * unit[2] * (1.0 + jitter * random.random()) if jitter else unit[1] * unit[2]
        heapq.heappush(timers, (now + took, seq, 1, c))
        if c.depth > 1:
            ask(c)

    def ask(c: _Client) -> None:
        n = want(c)
        if n > 0:
            c.asked += n
            send(c, P.READY, n, c.key if c.depth > 1 else 0)

    def finish(c: _Client, now: float) -> None:
        # as _worker._Loop: the unit's results leave at once (the flush interval has passed), with the
        # ask for more work when the worker then holds nothing (one message)
        cid, count, task_s, key, _ = c.running
        c.running = None
        c.depth = 2 if count * task_s < 0.05 else 1
        n = want(c) if not c.units and c.asked == 0 else 0
        if n > 0:
            c.asked += n
        keys = array("q", [cid, 0, count, 1]).tobytes()
        c.chan.send([P.OP, P.TO_PARENT.pack(pool_id, P.RESULTS, n, key if n and c.depth > 1 else 0), keys,
                     *dumps([task_s] * count)])
        start_next(c, now)

    def take(c: _Client, frames: List[Any], now: float) -> None:
        c.quiet = now
        kind, cid, fid, key, nfunc, nargs, count = P.TO_WORKER.unpack(frames[0])
        if kind == P.ACK:
            c.acked = True
            drop_streams(c)
            c.chan.close(1.0)
            if c.beat is not c.chan:
                c.beat.close(0)
            poller.unregister(c.chan.pollable)
            by_sock.pop(_key(c.chan), None)
            clients.pop(c.wid, None)
            return
        if kind == P.STOP:
            c.leaving = True
            send(c, P.BYE, 0)
            return
        if kind == P.REVOKE:
            for unit in c.units:
                if unit[0] == cid:
                    c.units.remove(unit)
                    send(c, P.RETURNED, cid)
                    break
            return
        at = 0
        while True:
            c.asked = max(0, c.asked - 1)
            # the benchmark's task takes its argument's seconds; the clients are told it on stdin
            c.units.append((cid, count, task_seconds, key, 1))
            at += 3 + nfunc + nargs
            if at >= len(frames):
                break
            kind, cid, fid, key, nfunc, nargs, count = P.TO_WORKER.unpack(frames[at])
        start_next(c, now)

    task_seconds = 0.1
    while True:
        now = time.monotonic()
        wait = None if not timers else max(0.0, (timers[0][0] - now) * 1000)
        for sock, _ in poller.poll(wait):
            if sock == stdin:
                try:
                    chunk = os.read(stdin, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    return
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    cmd, _, arg = line.decode().partition(" ")
                    if cmd == "start":
                        pool_id, *wids = map(int, arg.split())
                        for wid in wids:
                            c = _Client(wid)
                            c.chan = Channel(address, secret, 60.0, stream=over_streams)
                            c.beat = c.chan if one_connection else Channel(address, secret, 60.0,
                                                                           stream=over_streams)
                            c.quiet = time.monotonic()
                            for _ in range(n_streams):
                                st = _stream.connect(stream_address, secret, {"purpose": "node"}, 60.0)
                                c.streams.append(st)
                                by_fd[st.sock.fileno()] = (c, st)
                                poller.register(st.sock.fileno(), zmq.POLLIN)
                            clients[wid] = c
                            by_sock[_key(c.chan)] = c
                            poller.register(c.chan.pollable, zmq.POLLIN)
                            send(c, P.HELLO, wid)
                            ask(c)
                            seq += 1
                            heapq.heappush(timers, (time.monotonic() + interval, seq, 0, c))
                    elif cmd == "task":
                        task_seconds = float(arg)
                    elif cmd == "beat":
                        interval = float(arg)
                    elif cmd == "kill":
                        for wid in map(int, arg.split()):
                            c = clients.pop(wid, None)
                            if c is not None:
                                poller.unregister(c.chan.pollable)
                                by_sock.pop(_key(c.chan), None)
                                drop_streams(c)
                                for ch in {c.chan, c.beat}:  # no goodbye: as a killed process
                                    if ch.over_stream:
                                        ch.close()  # a stream has no goodbye: its end is all there is
                                    else:
                                        ch.pollable.close(0)
                continue
            if sock in by_fd:  # the answer to a stream's ping
                _, st = by_fd[sock]
                try:
                    while st.readable(0):
                        st.recv()
                except (EOFError, OSError):
                    by_fd.pop(sock, None)
                    poller.unregister(sock)
                continue
            c = by_sock.get(sock)
            if c is None:
                continue
            while True:
                frames = c.chan.recv(0)
                if frames is None:
                    break
                take(c, frames, time.monotonic())
                if c.acked:
                    break
        now = time.monotonic()
        while timers and timers[0][0] <= now:
            _, _, kind, c = heapq.heappop(timers)
            if c.wid not in clients:
                continue
            if kind == 0:
                c.beat.send([P.OP, P.TO_PARENT.pack(pool_id, P.HEARTBEAT, c.wid, 0)])
                if c.streams:  # as _child._watch_parent: a ping of the parent a second, on its own stream
                    seq += 1
                    c.streams[-1].send(REQUEST, [PING, HEADER.pack(0, seq, 0)])
                if (c.beat is not c.chan and c.running is None and not c.units
                        and now - c.quiet >= interval):
                    # as _worker._Loop: an idle worker also says a word on its work channel a second
                    c.chan.send([P.OP, P.TO_PARENT.pack(pool_id, P.HEARTBEAT, c.wid, 0)])
                    c.quiet = now
                seq += 1
                heapq.heappush(timers, (now + interval, seq, 0, c))
            else:
                finish(c, now)


if __name__ == "__main__":
    _host(sys.argv[1], sys.argv[2] == "one", int(sys.argv[3]), sys.argv[4], float(sys.argv[5]))
