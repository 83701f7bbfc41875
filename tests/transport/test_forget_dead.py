"""A node forgets the identities of peers that are gone, also of those killed before their goodbye (issue 22).

Over 200 kills (kill -9 of processes each holding authenticated connections, 20 per process) the node's
count of remembered peers stays bounded by those alive; a live peer that reconnects is remembered.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from helpers_core import TIMEOUT, wait_until
from roving.transport import node as _node
from roving.transport.endpoint import Channel

PER_PROCESS = 20
ROUNDS = 10  # 200 identities killed

_CLIENT = """
import os, sys, time
from roving.transport.endpoint import Channel
chans = [Channel(sys.argv[1], bytes.fromhex(os.environ["FORGET_TEST_SECRET"]), 30.0) for _ in range(int(sys.argv[2]))]
for c in chans:
    c.send([b"ping-test"])
print("ready", flush=True)
time.sleep(600)
"""


def test_identities_of_killed_peers_are_forgotten_and_live_ones_kept():
    secret = os.urandom(32)
    node = _node.Node(secret)
    seen = []
    node.register_handler(b"ping-test", lambda ident, frames: seen.append(ident))
    env = dict(os.environ, FORGET_TEST_SECRET=secret.hex())
    try:
        live = Channel(node.address, secret, TIMEOUT)
        live.send([b"ping-test"])
        assert wait_until(lambda: node.known_peers() == 1, TIMEOUT), node.known_peers()
        most = 0
        for _ in range(ROUNDS):
            proc = subprocess.Popen([sys.executable, "-c", _CLIENT, node.address, str(PER_PROCESS)], env=env,
                                    stdout=subprocess.PIPE)
            try:
                assert proc.stdout.readline().strip() == b"ready"
                assert wait_until(lambda: node.known_peers() == 1 + PER_PROCESS, TIMEOUT), node.known_peers()
            finally:
                proc.send_signal(signal.SIGKILL)  # no goodbye
                proc.wait(TIMEOUT)
            most = max(most, node.known_peers())
            assert wait_until(lambda: node.known_peers() == 1, TIMEOUT), \
                f"{node.known_peers()} peers remembered after a kill; 1 is alive"
        assert most <= 1 + PER_PROCESS
        # the live peer was never forgotten: it still talks
        before = len(seen)
        live.send([b"ping-test"])
        assert wait_until(lambda: len(seen) == before + 1, TIMEOUT)
        # a peer that reconnects (its old connection cut without a word) is remembered under its new one
        live._sock.close(0)
        again = Channel(node.address, secret, TIMEOUT)
        again.send([b"ping-test"])
        assert wait_until(lambda: len(seen) == before + 2, TIMEOUT)
        assert wait_until(lambda: node.known_peers() == 1, TIMEOUT), node.known_peers()
        again.close()
        assert wait_until(lambda: node.known_peers() == 0, TIMEOUT), node.known_peers()
    finally:
        node.close()
