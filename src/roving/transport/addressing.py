"""Which address a process binds its endpoint to, and which it tells its peers: chosen by itself.

Every roving process picks its own address; none inherits another's. With the ``host`` and
``advertise`` options at ``auto`` (the default):

* a child binds the interface that routes to its parent's address, and advertises that interface's
  address: a child on another machine is reached at its own address, one on the parent's machine at
  the address the parent uses (loopback when the parent is on loopback);
* a process without a parent (the program the user started) binds the interface that routes towards
  the machines its backend starts jobs on (:func:`set_cluster_route` — the Slurm controller, the Docker
  network's gateway or engine host, the Kubernetes API server), or loopback when every job runs on this
  machine (the local backend, a single-node Slurm on 127.0.0.1).

Which interface routes to an address is asked of the kernel (a UDP socket is connected, which sends
nothing, and its local address read), so it is the one the kernel itself would use.

Explicit options win: ``host`` binds exactly that address (``0.0.0.0`` or ``::``: every interface, and
the auto choice is advertised); ``advertise`` is what peers are told (NAT, a load balancer). An explicit
``host`` or ``advertise`` holds for the process whose configuration sets it; a child chooses afresh
(a wildcard ``host`` is kept). ``port_range`` ("50000-50100") confines every port roving listens on.
"""
from __future__ import annotations

import dataclasses
import functools
import ipaddress
import random
import socket
from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple

from ..config import parse_port_range  # the option's own parser; named here too, as before
from .errors import AddressError

if TYPE_CHECKING:
    from ..config import Config

__all__ = ["Choice", "AddressError", "choose", "route_to", "is_loopback", "parse_port_range", "bind_in_range",
           "set_cluster_route", "cluster_route", "host_of"]

AUTO = "auto"
_WILDCARDS = ("0.0.0.0", "::")


@dataclasses.dataclass(frozen=True)
class Choice:
    """Where a process listens (``bind``), what it tells peers (``advertise``), and why, in words."""

    bind: str
    advertise: str
    why: str
    port_range: Optional[Tuple[int, int]] = None


@functools.lru_cache(maxsize=1024)
def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, ``[v6]``, or a name every address of which is loopback) is this
    machine's loopback; False when unknown (a name that does not resolve leaves loopback)."""
    host = host.strip("[]")
    try:
        address = ipaddress.ip_address(host)
        mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1, as a dual-stack socket shows it
        return (mapped or address).is_loopback
    except ValueError:
        pass
    if host == "localhost":
        return True
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(is_loopback(str(info[4][0])) for info in infos)


def host_of(address: str) -> str:
    """The host part of ``tcp://HOST:PORT``, ``HOST:PORT`` or ``[V6]:PORT`` (brackets removed)."""
    if "://" in address:
        address = address.split("://", 1)[1]
    address = address.partition("#")[0]
    host = address.rpartition(":")[0] if ":" in address else address
    return host.strip("[]")


def route_to(host: str) -> str:
    """This machine's address on the interface that routes to ``host`` (asked of the kernel; nothing is
    sent). AddressError when there is no route or the name does not resolve."""
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise AddressError(f"cannot resolve {host!r} to find the interface towards it: {exc}") from None
    last: Optional[OSError] = None
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect(sockaddr)
                return probe.getsockname()[0]
            except OSError as exc:
                last = exc
    raise AddressError(f"no interface of this machine routes to {host}: {last}")


# -- the backend's part: where its jobs run, seen from here -----------------------------------------

#: ``(config) -> (host, why)`` of a machine on the cluster's side, or None when every job of the
#: configured backend runs on this machine. Set by roving.transport.session (to roving.backends.towards);
#: loopback until then.
_cluster_route: Callable[[Any], Optional[Tuple[str, str]]] = lambda cfg: None


def set_cluster_route(fn: Callable[[Optional[Config]], Optional[Tuple[str, str]]]) -> None:
    """Install the function that says towards which host the jobs of a configuration's backend run."""
    global _cluster_route
    _cluster_route = fn


def cluster_route(cfg: object) -> Optional[Tuple[str, str]]:
    return _cluster_route(cfg)


# -- the choice --------------------------------------------------------------------------------------

def choose(host: str, advertise: Optional[str], parent: Optional[str] = None, cfg: object = None,
           port_range: Optional[str] = None) -> Choice:
    """The address of this process: ``host``/``advertise`` as configured (``auto`` or None: chosen),
    ``parent`` the address of this process's parent (None for the program itself), ``cfg`` the
    configuration whose backend says where jobs run. Raises AddressError, naming the options, when
    the interface cannot be found."""
    ports = parse_port_range(port_range)
    explicit_host = host not in (None, "", AUTO)
    explicit_adv = advertise not in (None, "", AUTO)
    if explicit_host and host not in _WILDCARDS:
        return Choice(host, advertise if explicit_adv and advertise else host,
                      f"host={host} (set){'' if not explicit_adv else f', advertise={advertise} (set)'}", ports)
    try:
        if parent is not None:
            towards, reason = host_of(parent), f"the interface towards its parent at {host_of(parent)}"
        else:
            towards, reason = None, ""
            route = cluster_route(cfg)
            if route is not None:
                towards, reason = route[0], f"the interface towards {route[1]}"
        if towards is None or is_loopback(towards):
            auto, why = "127.0.0.1", ("loopback: " + (reason if towards is not None else
                                                     "every process of this backend runs on this machine"))
        else:
            auto, why = route_to(towards), reason
    except AddressError as exc:
        raise AddressError(f"{exc} (roving options host=auto, advertise=auto chose to look there; set "
                           "host= and advertise= to this machine's address that the others can reach)") from None
    if explicit_host:  # a wildcard: every interface, the chosen one advertised
        if towards is None:  # nothing to route to: this machine's address on its default route
            auto, why = _primary_address(), "this machine's address on its default route"
        return Choice(host, advertise if explicit_adv and advertise else auto, f"host={host} (set); advertises {why}",
                      ports)
    if explicit_adv and advertise:
        return Choice(auto, advertise, f"binds {why}; advertise={advertise} (set)", ports)
    return Choice(auto, auto, f"host=auto: {why}", ports)


def _primary_address() -> str:
    """The address of the interface of this machine's default route (no packet is sent), else the
    host name's address, else loopback."""
    try:
        return route_to("192.0.2.1")  # TEST-NET-1: only the routing table is consulted
    except AddressError:
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def bind_in_range(bind: Callable[[int], None], port_range: Optional[Tuple[int, int]], where: str) -> int:
    """Call ``bind(port)`` with port 0 (any), or with ports of ``port_range`` in random order until one
    binds; returns the port given (0 for any). AddressError naming the range when none is free."""
    if port_range is None:
        bind(0)
        return 0
    lo, hi = port_range
    ports = list(range(lo, hi + 1))
    random.shuffle(ports)
    for port in ports:
        try:
            bind(port)
            return port
        except OSError:
            continue
    raise AddressError(f"no free port in port_range={lo}-{hi} on {where}: widen the range")
