"""Bounds on what strangers can make a listener do before they authenticate, and how refusals are told.

* :class:`Refusals` logs a refused peer once per source address and interval, with how many refusals
  of it were not logged since: a flood of bad connections neither fills the log nor goes unseen.
* :class:`Admission` caps the handshakes in progress at once, in all and per source, and shares the
  cap fairly between sources: a flood from many addresses cannot hold out a peer from another one.
* :class:`Unauthenticated` caps the connections open and not yet authenticated (a node's ZeroMQ
  connections, which libzmq accepts), ending the oldest of the source that holds most when a new one
  would exceed it (:func:`cap_for_open_files`: a share of the limit on open files).
* :func:`raise_open_files` lifts this process's soft limit on open files to the hard one.

A *source* is the peer's IPv4 address, or its IPv6 address's /64 (one host's share of a network: an
IPv6 host holds a whole /64, so counting its addresses one by one would give it as many shares as it
likes).
"""
from __future__ import annotations

import collections
import dataclasses
import ipaddress
import logging
import os
import socket
import threading
import time
from typing import Callable, Dict, Iterable, List, Optional, Protocol, TypeVar

try:
    import resource
except ImportError:  # not a POSIX system
    resource = None  # type: ignore[assignment]

_INTERVAL_S = 60.0
_REMEMBERED = 4096  # source addresses whose last refusal (or success) is remembered
#: A source whose peer completed a handshake within this many seconds is trusted (Admission's reserve).
TRUST_S = 3600.0


def source_of(address: str) -> str:
    """The source a peer address counts under: an IPv4 address itself, an IPv6 address's /64."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class Refusals:
    """Throttled warnings about refused peers: one per source address per ``interval`` seconds."""

    def __init__(self, logger: logging.Logger, where: str, interval: float = _INTERVAL_S) -> None:
        self._log, self._where, self._interval = logger, where, interval
        self._last: "collections.OrderedDict[str, list]" = collections.OrderedDict()  # source -> [time, unlogged]
        self._lock = threading.Lock()
        #: Refusals counted, logged or not (tests read it).
        self.count = 0

    def refuse(self, source: str, why: str, quiet: bool = False) -> None:
        """Count a refused connection from ``source``; warn of it unless one was warned of within the
        interval, or ``quiet`` (the peer left on its own: only logged at debug level)."""
        now = time.monotonic()
        if quiet:
            with self._lock:
                self.count += 1
            self._log.debug("roving %s: a connection from %s ended during its handshake: %s", self._where, source, why)
            return
        with self._lock:
            self.count += 1
            seen = self._last.get(source)
            if seen is not None and now - seen[0] < self._interval:
                seen[1] += 1
                return
            unlogged = seen[1] if seen is not None else 0
            self._last[source] = [now, 0]
            self._last.move_to_end(source)
            while len(self._last) > _REMEMBERED:
                self._last.popitem(last=False)
        more = f" ({unlogged} more refusal(s) of it since the last warning)" if unlogged else ""
        self._log.warning("roving %s: refused a connection from %s: %s%s; further refusals of it are "
                          "logged at most once a minute", self._where, source, why, more)


@dataclasses.dataclass(eq=False)
class Handshake:
    """One handshake that asked :meth:`Admission.enter` to run."""

    #: The peer's address, and the source it counts under (:func:`source_of`).
    address: str
    source: str
    #: Closes the handshake's connection (its thread then fails and leaves); run at most once.
    evict: Callable[[], None]
    started: float
    #: Why it was refused ("" when admitted); a refused handshake is never entered.
    refused: str = ""
    #: Set when it was evicted to make room for another source's.
    evicted: bool = False


class _Held(Protocol):  # what the fair choice reads of an entry (Handshake, _Connection)
    source: str
    started: float


_E = TypeVar("_E", bound=_Held)


def _fair_victim(entries: Iterable[_E], newcomer: str) -> Optional[_E]:
    """The entry to drop so that ``newcomer``'s source gets a share: the oldest of the source that holds
    most, when that source holds at least two more than the newcomer's (after the drop, the newcomer's
    source then holds no more than it); else None. Shares even out without two equal sources taking
    turns at evicting each other."""
    held: Dict[str, List[_E]] = {}
    for entry in entries:
        held.setdefault(entry.source, []).append(entry)
    if not held:
        return None
    biggest = max(held.values(), key=lambda group: (len(group), -min(e.started for e in group)))
    mine = len(held.get(newcomer, ()))
    if biggest[0].source == newcomer or len(biggest) < mine + 2:
        return None
    return min(biggest, key=lambda e: e.started)


class Admission:
    """Handshakes in progress: at most ``total`` at once and ``per_source`` from one source, shared fairly.

    While fewer than ``total`` run, a source is admitted up to ``per_source``. At ``total``, a source
    that completed a handshake within :data:`TRUST_S` (a peer that proved the secret) still gets up to
    ``reserve`` more; and a newcomer from a source that holds at least two fewer than the source
    holding most is admitted in place of the oldest handshake of that source, which is evicted (its
    ``evict`` runs, outside the lock). So sources that flood from many addresses hold at most their shares between
    them, and a peer from another address is admitted at once, not after their handshakes' deadline.
    What it does not bound: a flood from more sources than the cap, each holding one handshake, keeps
    a peer from an untrusted source waiting for a free place (each is freed by its deadline).
    """

    def __init__(self, total: int, per_source: int, reserve: int = 32) -> None:
        self.total, self.per_source, self.reserve = total, per_source, reserve
        self._running: List[Handshake] = []
        self._by_source: Dict[str, int] = {}
        self._trusted: "collections.OrderedDict[str, float]" = collections.OrderedDict()
        self._lock = threading.Lock()
        #: Handshakes evicted to make room for another source's (tests read it).
        self.evictions = 0

    def enter(self, address: str, evict: Callable[[], None]) -> Handshake:
        """A :class:`Handshake` for a connection from ``address``: admitted (``refused`` is "", call
        :meth:`leave` when it ends) or refused (``refused`` says why; nothing to leave)."""
        now = time.monotonic()
        source = source_of(address)
        ticket = Handshake(address, source, evict, now)
        victim: Optional[Handshake] = None
        with self._lock:
            held = self._by_source.get(source, 0)
            if held >= self.per_source:
                ticket.refused = f"{self.per_source} handshakes from this address in progress already"
                return ticket
            room = len(self._running) < self.total
            if not room and self._is_trusted(source, now):
                room = len(self._running) < self.total + self.reserve
            if not room:
                victim = _fair_victim(self._running, source)
                if victim is None:
                    ticket.refused = f"{len(self._running)} handshakes in progress already"
                    return ticket
                self._remove(victim)
                victim.evicted = True
                self.evictions += 1
            self._running.append(ticket)
            self._by_source[source] = held + 1
        if victim is not None:
            try:
                victim.evict()
            except OSError:  # its connection had ended already
                pass
        return ticket

    def leave(self, ticket: Handshake, succeeded: bool = False) -> None:
        """The handshake ended; ``succeeded``: its peer proved the secret (its source is trusted)."""
        with self._lock:
            if not ticket.evicted:
                self._remove(ticket)
            if succeeded:
                self._trusted[ticket.source] = time.monotonic()
                self._trusted.move_to_end(ticket.source)
                while len(self._trusted) > _REMEMBERED:
                    self._trusted.popitem(last=False)

    def _is_trusted(self, source: str, now: float) -> bool:
        seen = self._trusted.get(source)
        return seen is not None and now - seen < TRUST_S

    def _remove(self, ticket: Handshake) -> None:
        try:
            self._running.remove(ticket)
        except ValueError:
            return
        held = self._by_source.get(ticket.source, 1) - 1
        if held:
            self._by_source[ticket.source] = held
        else:
            self._by_source.pop(ticket.source, None)


@dataclasses.dataclass(eq=False)
class _Connection:
    fd: int
    source: str
    started: float
    #: The connection's own and its peer's socket addresses: what makes a descriptor this connection.
    names: tuple


def _names(fd: int) -> Optional[tuple]:
    """(own address, peer address) of the TCP connection on descriptor ``fd``, or None (not one now)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        return sock.getsockname(), sock.getpeername()
    except OSError:
        return None
    finally:
        sock.close()


def _shut(conn: _Connection) -> bool:
    """End the connection ``conn`` names, if its descriptor still holds it (never another that took
    the number since: its addresses are checked); whether it was ended."""
    try:
        sock = socket.socket(fileno=os.dup(conn.fd))
    except OSError:
        return False
    try:
        if (sock.getsockname(), sock.getpeername()) != conn.names:
            return False
        sock.shutdown(socket.SHUT_RDWR)  # the connection, for every descriptor of it: its owner sees its end
        return True
    except OSError:
        return False
    finally:
        sock.close()


class Unauthenticated:
    """Connections that another library accepted (libzmq, for a node's ROUTER) and that have not
    authenticated yet: at most ``cap`` open at once, shared fairly by source.

    :meth:`opened` records a connection by its file descriptor (as ZeroMQ's monitor names it); when
    that makes more than ``cap``, the oldest connection of the source that holds most is ended (the
    new one's source included, so a flood from one address ends its own; among sources that hold one
    each, the oldest of all): shut down, so that its owner sees it end and closes it. The descriptor is
    checked to hold the same connection (its two addresses) first. :meth:`settled` (it authenticated)
    and :meth:`closed` forget one. Not thread-safe: one thread (the node's I/O thread) calls it.
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._open: "collections.OrderedDict[int, _Connection]" = collections.OrderedDict()
        self._early: "collections.OrderedDict[int, tuple]" = collections.OrderedDict()  # settled, not yet opened
        #: Connections ended to keep the cap (tests read it).
        self.ended_for_cap = 0

    def __len__(self) -> int:
        return len(self._open)

    def opened(self, fd: int) -> None:
        self._open.pop(fd, None)  # a number reused before the old connection's end was read
        names = _names(fd)
        if names is None:  # gone already
            return
        if self._early.pop(fd, None) == names:  # it authenticated before its opening was read
            return
        address = names[1][0] if isinstance(names[1], tuple) else str(names[1])
        self._open[fd] = _Connection(fd, source_of(str(address)), time.monotonic(), names)
        while len(self._open) > self.cap:
            conns = list(self._open.values())
            victim = _fair_victim(conns, "") or min(conns, key=lambda c: c.started)
            del self._open[victim.fd]
            if _shut(victim):
                self.ended_for_cap += 1

    def settled(self, fd: Optional[int]) -> None:
        """The connection on ``fd`` authenticated (None: not known which; nothing is done)."""
        if fd is None or self._open.pop(fd, None) is not None:
            return
        names = _names(fd)
        if names is not None:
            self._early[fd] = names
            while len(self._early) > self.cap:
                self._early.popitem(last=False)

    def closed(self, fd: int) -> None:
        """The connection on ``fd`` ended."""
        self._open.pop(fd, None)
        self._early.pop(fd, None)


def cap_for_open_files(share: int = 8, floor: int = 32, ceiling: int = 1024) -> int:
    """A cap on connections that may be open unauthenticated: 1/``share`` of this process's limit on
    open files, between ``floor`` and ``ceiling``."""
    if resource is None:
        return ceiling
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return ceiling
    return max(floor, min(ceiling, soft // share))


def raise_open_files() -> int:
    """Lift this process's soft limit on open files (RLIMIT_NOFILE) to its hard limit, where the system
    allows; the soft limit now. Done once at start by every roving process, so that a limit set low by
    the login (1024 is common) is not what a flood of connections runs into first."""
    if resource is None:
        return -1
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            target = hard
            if hard == resource.RLIM_INFINITY:  # macOS refuses infinity; a large finite number works
                target = 1 << 20
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
