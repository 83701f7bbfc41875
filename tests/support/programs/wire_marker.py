"""Moves a marker through a Queue, a Pipe and a Pool between this process and children, under the
``encrypt`` option given as argv[1]; prints the TCP ports of every listener involved, then OK."""
import sys

import roving
from roving.transport import session as _session

MARKER = sys.argv[2].encode()


def ports():
    node = _session.current().node()
    return [int(node.address.partition("#")[0].rsplit(":", 1)[1]), int(node.streams().address.rsplit(":", 1)[1])]


def child(q, conn):
    q.put({"marker": MARKER, "ports": ports()})
    conn.send([MARKER] * 3)
    conn.recv()


def work(x):
    return MARKER + b"-" + x


if __name__ == "__main__":
    roving.init(encrypt=sys.argv[1])
    q = roving.Queue()
    parent_end, child_end = roving.Pipe()
    p = roving.Process(target=child, args=(q, child_end))
    p.start()
    got = q.get(timeout=60)
    assert got["marker"] == MARKER
    assert parent_end.recv() == [MARKER] * 3
    parent_end.send(MARKER)
    p.join(60)
    assert p.exitcode == 0
    with roving.Pool(2) as pool:
        assert pool.map(work, [b"a", b"b"]) == [MARKER + b"-a", MARKER + b"-b"]
    print("PORTS", " ".join(map(str, ports() + got["ports"])))
    print("OK")
