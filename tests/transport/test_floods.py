"""Floods from many sources (issue 31): stream handshakes held open from 8 addresses, and ZeroMQ
connections opened faster than libzmq's handshake interval closes them, leave a node serving its own.

The attacker's connections come from 127.0.0.2-127.0.0.9 (all loopback on Linux): a per-source cap
alone lets 8 addresses take every place of a global one.
"""
from __future__ import annotations

import os
import selectors
import socket
import subprocess
import sys
import threading
import time

import pytest

import roving
from helpers_core import SUPPORT_DIR, TIMEOUT, wait_until
from roving.transport import endpoint as _endpoint
from roving.transport import guard
from roving.transport import session as _session
from roving.transport import stream as _stream

SOURCES = [f"127.0.0.{i}" for i in range(2, 10)]


def _port(address: str) -> int:
    return int(address.partition("#")[0].rsplit(":", 1)[1])  # (a node's address names its key after '#')


class Flood:
    """Keeps ``per_source`` silent connections open from each of ``sources`` to ``port``, opening a new
    one whenever the listener closes one, until stopped."""

    def __init__(self, port: int, sources, per_source: int, greeting: bytes = b"", rate: float = 0) -> None:
        self.port, self.sources, self.per_source, self.greeting = port, sources, per_source, greeting
        self._gap = 1 / rate if rate else 0.0  # at most ``rate`` new connections a second (0: no limit)
        self._next = 0.0
        self.opened = self.closed_by_peer = 0
        self.most_open = 0
        self._stop = threading.Event()
        self._full = threading.Event()
        self._sel = selectors.DefaultSelector()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Flood":
        self._thread.start()
        assert self._full.wait(TIMEOUT), f"the flood could open only {self.opened} connections"
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(TIMEOUT)

    def _open(self, source: str) -> None:
        if self._gap:
            now = time.monotonic()
            if self._next > now:
                time.sleep(self._next - now)
            self._next = max(now, self._next) + self._gap
        s = socket.socket()
        s.bind((source, 0))
        s.settimeout(5)
        s.connect(("127.0.0.1", self.port))
        if self.greeting:
            s.sendall(self.greeting)
        s.setblocking(False)
        self._sel.register(s, selectors.EVENT_READ, source)
        self.opened += 1

    def _run(self) -> None:
        for source in self.sources:
            for _ in range(self.per_source):
                self._open(source)
        self.most_open = len(self._sel.get_map())
        self._full.set()
        while not self._stop.is_set():
            for key, _ in self._sel.select(0.05):
                try:
                    data = key.fileobj.recv(4096)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if data:
                    continue  # ZeroMQ's greeting: read and ignored
                self._sel.unregister(key.fileobj)
                key.fileobj.close()
                self.closed_by_peer += 1
                self._open(key.data)  # straight back in
        for key in list(self._sel.get_map().values()):
            key.fileobj.close()
        self._sel.close()


def test_a_fair_share_admits_a_newcomer_in_place_of_the_oldest_handshake_of_the_biggest_source():
    evicted = []
    admission = guard.Admission(total=4, per_source=3, reserve=0)
    tickets = [admission.enter("127.0.0.2", lambda i=i: evicted.append(i)) for i in range(3)]
    tickets.append(admission.enter("127.0.0.3", lambda: evicted.append("3")))
    assert [t.refused for t in tickets] == [""] * 4
    newcomer = admission.enter("127.0.0.4", lambda: evicted.append("4"))
    assert newcomer.refused == "" and evicted == [0]  # the oldest of the source that held 3
    # now 2, 1, 1: a source holding 1 cannot evict one holding 2 (it would hold as many after)
    assert admission.enter("127.0.0.3", lambda: None).refused.startswith("4 handshakes in progress")
    assert admission.enter("127.0.0.5", lambda: evicted.append("5")).refused == ""
    assert evicted == [0, 1]
    admission.leave(tickets[0])  # evicted ones leave too: nothing is counted twice
    assert admission.enter("127.0.0.6", lambda: None).refused  # 1, 1, 1, 1: no share to take


def test_a_source_that_proved_the_secret_has_a_reserve_when_every_place_is_taken():
    admission = guard.Admission(total=2, per_source=2, reserve=1)
    first = admission.enter("127.0.0.1", lambda: None)
    admission.leave(first, succeeded=True)
    assert [admission.enter(a, lambda: None).refused for a in ("127.0.0.2", "127.0.0.3")] == ["", ""]
    assert admission.enter("127.0.0.4", lambda: None).refused  # one each: no share to take
    assert admission.enter("127.0.0.1", lambda: None).refused == ""  # trusted: the reserve
    assert admission.evictions == 0
    assert admission.enter("127.0.0.1", lambda: None).refused  # the reserve is full too


def test_ipv6_peers_count_by_their_64_and_ipv4_mapped_ones_as_ipv4():
    assert guard.source_of("2001:db8::1") == guard.source_of("2001:db8::ffff:2") == "2001:db8::/64"
    assert guard.source_of("2001:db8:0:1::1") != guard.source_of("2001:db8::1")
    assert guard.source_of("::ffff:10.0.0.7") == "10.0.0.7"
    assert guard.source_of("10.0.0.7") == "10.0.0.7"


def test_a_handshake_flood_from_8_addresses_neither_refuses_nor_delays_a_pool_starting_beside_it(capfd):
    node = _session.current().node()
    listener = node.streams()
    per_source = _stream._MAX_HANDSHAKES_PER_SOURCE
    assert len(SOURCES) * per_source >= _stream._MAX_HANDSHAKES  # the flood can take every place
    with Flood(_port(listener.address), SOURCES, per_source) as flood:
        assert flood.most_open == len(SOURCES) * per_source
        admission = listener._admission
        assert wait_until(lambda: len(admission._running) == _stream._MAX_HANDSHAKES, TIMEOUT)  # every place
        admission._trusted.clear()  # as a first start: no earlier handshake of this test process's reserve
        before = node.known_channels()
        started = time.monotonic()
        with roving.Pool(3) as pool:
            assert pool.map(abs, range(-200, 200)) == [abs(i) for i in range(-200, 200)]
            elapsed = time.monotonic() - started
            # each worker's work and heartbeat channels are streams: none fell back to ZeroMQ
            assert wait_until(lambda: node.known_channels() - before >= 6, TIMEOUT), node.known_channels()
        evicted = listener._admission.evictions
    err = capfd.readouterr().err
    assert "using ZeroMQ" not in err
    assert evicted > 0  # the pool's handshakes got in by taking the flood's places
    assert flood.closed_by_peer >= evicted
    # the channels' fallback waits STREAM_OPEN_TIMEOUT; no channel waited for it
    assert elapsed < _endpoint.STREAM_OPEN_TIMEOUT, elapsed


_DESCRIPTOR_TARGET = r"""
import os, resource, sys, tempfile
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))  # the hard limit too: raising it cannot help here
import roving
from roving.transport import session as _session
q = roving.Queue()
node = _session.current().node()
# One process started before the flood: the first start scans every installed distribution (the
# environment check), a long pure-Python pass that keeps the node's thread from ending connections over
# its cap meanwhile (the limit in docs/guides/security.md: "a process whose other threads keep Python busy"); under a
# flood that scan alone can meet the descriptor limit. What follows tests the node, not that limit.
first = roving.Process(target=int)  # prints nothing: stdout is the test's
first.start(); first.join(60)
print(node.address, flush=True)
sys.stdin.readline()  # the test floods the node now, and goes on flooding
opened = [open(os.devnull) for _ in range(64)]  # open() works
for f in opened:
    f.close()
p = roving.Process(target=print, args=("child ran",))
p.start(); p.join(60)
q.put("still serving")
print("FDS", len(os.listdir("/proc/self/fd")), "CAP", node.router.unauthenticated.cap,
      "ENDED", node.router.unauthenticated.ended_for_cap, "EXIT", p.exitcode, q.get(timeout=30), flush=True)
sys.stdin.readline()
"""


def _zmtp_greeting(mechanism: bytes) -> bytes:
    return b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + mechanism.ljust(20, b"\x00") + b"\x00" + b"\x00" * 31


def test_a_flood_of_zeromq_connections_at_a_node_with_256_descriptors_leaves_it_serving(tmp_path):
    script = tmp_path / "target.py"
    script.write_text(_DESCRIPTOR_TARGET)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SUPPORT_DIR), os.environ.get("PYTHONPATH", "")]))
    env.pop("ROVING_CHILD", None)
    errors = open(tmp_path / "stderr", "w")
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=errors, text=True, env=env)
    try:
        address = proc.stdout.readline().strip()
        # 8 x 64 connections held open (twice the descriptors the target has, far more than its cap),
        # each one the node ends opened again, at up to 1,000 a second (the flood: 200 a second)
        with Flood(_port(address), SOURCES, 64, greeting=_zmtp_greeting(b"CURVE"), rate=1000) as flood:
            proc.stdin.write("go\n")
            proc.stdin.flush()
            lines = [proc.stdout.readline() for _ in range(2)]  # the child's line, prefixed, and the result
        out = next((line.split() for line in lines if line.startswith("FDS")), lines)
        assert out[:1] == ["FDS"], (lines, (tmp_path / "stderr").read_text()[-4000:])
        fds, cap, ended = int(out[1]), int(out[3]), int(out[5])
        assert cap == 32  # 256 / 8
        assert ended >= flood.opened - 8 * 64 and ended > 0
        assert fds < 256 - 32
        assert out[7] == "0" and " ".join(out[8:]) == "still serving"
        assert flood.opened > 8 * 64  # the node ended connections, and the flood came straight back
    finally:
        proc.kill()
        proc.wait(10)
        errors.close()


def test_over_the_cap_the_oldest_unauthenticated_connection_of_the_biggest_source_is_ended():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    port = server.getsockname()[1]
    conns = guard.Unauthenticated(cap=4)
    clients, accepted = [], []
    try:
        for source in ["127.0.0.2", "127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.4"]:
            c = socket.socket()
            c.bind((source, 0))
            c.connect(("127.0.0.1", port))
            a, _ = server.accept()
            clients.append(c)
            accepted.append(a)
            if source == "127.0.0.3":
                conns.opened(a.fileno())
                conns.settled(a.fileno())  # it authenticated: never ended for the cap
            else:
                conns.opened(a.fileno())
        # unauthenticated: three from .2, one from .4 (.3's settled): the cap; one more ends .2's oldest
        assert conns.ended_for_cap == 0 and len(conns) == 4
        c = socket.socket()
        c.bind(("127.0.0.4", 0))
        c.connect(("127.0.0.1", port))
        a, _ = server.accept()
        clients.append(c)
        accepted.append(a)
        conns.opened(a.fileno())
        assert conns.ended_for_cap == 1 and len(conns) == 4
        clients[0].settimeout(5)
        assert clients[0].recv(1) == b""  # the oldest of 127.0.0.2 was ended
        for other in clients[1:]:
            other.setblocking(False)
            with pytest.raises(BlockingIOError):  # still open: nothing to read, no end
                other.recv(1)
    finally:
        for s in clients + accepted + [server]:
            s.close()


_LIMITS_TARGET = r"""
import resource
def report(out):
    out.put(resource.getrlimit(resource.RLIMIT_NOFILE))
"""

_LIMITS_PROGRAM = r"""
import resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # a login's low soft limit
import roving, limits_target
before = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
out = roving.Queue()  # the first use of the transport
after = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # what the child inherits
p = roving.Process(target=limits_target.report, args=(out,))
p.start()
child = out.get(timeout=60)
p.join(60)
print(before, after, hard, child[0], child[1], p.exitcode)
"""


def test_a_program_raises_its_soft_limit_on_open_files_at_first_use_of_the_transport_and_a_child_at_boot(
        tmp_path):
    (tmp_path / "limits_target.py").write_text(_LIMITS_TARGET)
    (tmp_path / "program.py").write_text(_LIMITS_PROGRAM)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    env.pop("ROVING_CHILD", None)
    r = subprocess.run([sys.executable, str(tmp_path / "program.py")], capture_output=True, text=True,
                       timeout=TIMEOUT * 3, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    before, after, hard, child_soft, child_hard, exitcode = (int(x) for x in r.stdout.split()[-6:])
    assert hard > 256, "the test needs a hard limit above 256"
    assert before == 256 and after == hard
    assert (child_soft, child_hard, exitcode) == (hard, hard, 0)  # it started with 256
