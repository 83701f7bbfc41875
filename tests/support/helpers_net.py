"""A TCP forwarder on 127.0.0.1 whose connections the test can cut, as a network blip would; the TCP
payloads of a packet capture."""
from __future__ import annotations

import random
import socket
import struct
import threading
from typing import List, Optional, Tuple


class CuttingProxy:
    """Forwards every connection made to ``address`` to ``target`` (``tcp://127.0.0.1:PORT`` or
    ``127.0.0.1:PORT``; ``address`` takes the same form), byte for byte. :meth:`cut` closes every connection
    open now, on both
    sides (each side sees the connection end, as after a dropped link); new connections are forwarded
    as before, so a client that reconnects reaches the target again, over a new TCP connection. A node
    address's key (``#KEY``) is kept: a client through the forwarder still expects that node.

    ``spoil``: the first ``spoil`` connections have one byte changed of what their client sends (or,
    with ``spoil_replies``, of what the target answers), at :data:`SPOIL_AT`: for a TLS stream, inside
    the encrypted handshake records (past the client's greeting and hello, or the server's hello), as a
    stray write into the connection would. Later connections are forwarded as they are."""

    #: The offset, in the bytes of the spoiled direction (what the client sends, or what the target
    #: answers), of the byte that is changed.
    SPOIL_AT = 400

    def __init__(self, target: str, spoil: int = 0, spoil_replies: bool = False) -> None:
        scheme = "tcp://" if target.startswith("tcp://") else ""  # ZeroMQ's form, or a stream's host:port
        target, mark, key = target.partition("#")
        host, _, port = target[len(scheme):].rpartition(":")
        assert host == "127.0.0.1", "tests talk to 127.0.0.1 only"
        self.target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"{scheme}127.0.0.1:{self._listener.getsockname()[1]}{mark}{key}"
        self._pairs: List[Tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self.accepted = 0
        self._spoil, self._spoil_replies = spoil, spoil_replies
        #: Connections whose byte was changed.
        self.spoiled = 0
        self._closed = False
        threading.Thread(target=self._accept, name="cutting-proxy", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._pairs.append((client, server))
                self.accepted += 1
                spoil = self.accepted <= self._spoil
            threading.Thread(target=self._pump, args=(client, server, spoil and not self._spoil_replies),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, spoil and self._spoil_replies),
                             daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, spoil: bool = False) -> None:
        seen = 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if spoil and seen <= self.SPOIL_AT < seen + len(data):
                    changed = bytearray(data)
                    changed[self.SPOIL_AT - seen] ^= 0x01
                    data = bytes(changed)
                    with self._lock:
                        self.spoiled += 1
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def open_connections(self) -> int:
        with self._lock:
            return sum(1 for c, _ in self._pairs if c.fileno() != -1)

    def cut(self, count: Optional[int] = None, rng: Optional[random.Random] = None) -> int:
        """Close every connection forwarded now, or ``count`` of them chosen by ``rng``; returns how
        many were cut."""
        with self._lock:
            live = [p for p in self._pairs if p[0].fileno() != -1]
            if count is None or count >= len(live):
                pairs = live
            else:
                pairs = (rng or random).sample(live, count)
            self._pairs = [p for p in live if p not in pairs]
        for pair in pairs:
            for s in pair:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        return len(pairs)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.cut()


class NodeVia:
    """A pool dispatcher's node, except that the workers it starts from now on are given ``address``
    (a forwarder's) to reach it: ``pool._disp.node = NodeVia(pool._disp.node, proxy.address)``."""

    def __init__(self, node, address: str) -> None:
        self._node, self.address = node, address

    def __getattr__(self, name: str):
        return getattr(self._node, name)


def tcp_payloads(pcap: bytes, ports: set) -> bytes:
    """The TCP payloads of a pcap file (Ethernet-framed, as tcpdump writes loopback and veth) to or from
    ``ports``."""
    out = bytearray()
    magic = struct.unpack("<I", pcap[:4])[0]
    assert magic == 0xA1B2C3D4, "not a little-endian microsecond pcap file"
    at = 24
    while at + 16 <= len(pcap):
        incl = struct.unpack_from("<I", pcap, at + 8)[0]
        packet = pcap[at + 16:at + 16 + incl]
        at += 16 + incl
        if len(packet) < 14 + 20 or packet[12:14] != b"\x08\x00":
            continue
        ip = packet[14:]
        ihl = (ip[0] & 15) * 4
        if ip[9] != 6:
            continue
        total = struct.unpack_from(">H", ip, 2)[0]
        tcp = ip[ihl:total]
        sport, dport = struct.unpack_from(">HH", tcp, 0)
        if sport in ports or dport in ports:
            out += tcp[(tcp[12] >> 4) * 4:]
    return bytes(out)
