"""The progress of a long transfer, told in the log: a message of at least :data:`FROM` bytes sent or
received over a stream that has taken :data:`AFTER_S` seconds is logged (INFO, logger
``roving.transport.progress``) with how much is done, the rate and the peer, every :data:`EVERY_S`
seconds until it ends, and once more when it ends. A transfer that ends sooner says nothing. Cheap: a
clock read per socket call on a large message, nothing on others."""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from ..backends.memory import describe

log = logging.getLogger(__name__)

#: Messages at least this large are watched (smaller ones cannot take seconds but on a stalled link).
FROM = 64 * 2**20
#: A transfer is told once it has taken this long ...
AFTER_S = 2.0
#: ... and then every this many seconds.
EVERY_S = 2.0


def peer_of(sock: Any) -> str:
    """``host:port`` of a socket's peer, for the log ("a peer" when the socket cannot say)."""
    sock = getattr(sock, "ssock", sock)  # a TLS stream's socket (roving.transport.tls.TlsSocket)
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except (AttributeError, OSError, ValueError, TypeError):
        return "a peer"


class Progress:
    """One transfer of ``total`` bytes, described as ``what`` ("sending a message to 10.0.0.2:5000")."""

    __slots__ = ("what", "total", "started", "next", "said", "clock")

    def __init__(self, what: str, total: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.what, self.total, self.clock = what, total, clock
        self.started = clock()
        self.next = self.started + AFTER_S
        self.said = False

    def advance(self, done: int) -> None:
        """``done`` bytes of it are through."""
        now = self.clock()
        if now >= self.next:
            self.next = now + EVERY_S
            self.said = True
            log.info("roving: %s of %s: %s done (%d%%) in %.1f s, %s/s", self.what, describe(self.total),
                     describe(done), 100 * done // max(1, self.total), now - self.started,
                     describe(int(done / max(1e-9, now - self.started))))

    def finish(self) -> None:
        """It ended (all of it through): said when its progress was."""
        if self.said:
            took = self.clock() - self.started
            log.info("roving: %s of %s: done (100%%) in %.1f s, %s/s", self.what, describe(self.total), took,
                     describe(int(self.total / max(1e-9, took))))
