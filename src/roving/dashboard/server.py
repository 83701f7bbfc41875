"""The dashboard's HTTP server: a page, JSON endpoints, ``/metrics``, every request behind a token.

It serves from its own thread (an event loop, :mod:`roving.dashboard.serving`: a bounded number of
connections, each under deadlines, answers made by two worker threads), reading snapshots of
:mod:`roving.observe` and of a pipeline's control folder when a browser asks; it never runs on the
program's hot path and publishes nothing itself.

Access, checked in this order for every request, whatever the path:

1. The ``Host`` header must name this dashboard: ``localhost``, a loopback address, the address it is
   bound to, this machine's host name (short or full) or one of its own addresses, or a name given in
   ``hosts`` (the ``dashboard_hosts`` option). Any other gets 421: a page under some other site's name
   that now points here, as DNS rebinding does, is refused before the token is looked at.
2. The token: the URL printed once carries ``?token=...``; the first request with it gets a cookie,
   later ones may carry either (or ``Authorization: Bearer TOKEN``, for Prometheus). Without the right
   token: 403. The token is compared in constant time.

The cookie is named after the port and the session (``roving-dashboard-PORT-ID``, where ID is a hash
of the token), so that two dashboards on one host do not overwrite each other's; it is ``HttpOnly``
(the page's script cannot read it), ``SameSite=Strict`` (no other site's page makes the browser send
it), ``Path=/``, for this host only, and over HTTPS ``Secure`` with the ``__Host-`` prefix (the browser
sends it only over HTTPS and lets no plain-HTTP page set one of that name). Browsers do not scope
cookies by port: another HTTPS service under the same host name receives it.

The server binds 127.0.0.1 unless the ``dashboard_host`` option says otherwise. On loopback it speaks
plain HTTP; beyond it (or with ``tls=True``) HTTPS with a self-signed certificate made at start
(:mod:`roving.dashboard.tls`), whose fingerprint the printed line carries, so that the token never
travels in clear (``tls=False`` turns that off, at the user's word: the ``dashboard_tls`` option).
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
import socket
import threading
import urllib.parse
from importlib import resources
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

from . import prometheus
from .serving import Answer, HttpServer, Limits, Request
from .state import Views

log = logging.getLogger(__name__)

__all__ = ["Server", "Limits"]

_STATIC = {"/": ("index.html", "text/html; charset=utf-8"), "/app.js": ("app.js", "text/javascript; charset=utf-8"),
           "/style.css": ("style.css", "text/css; charset=utf-8")}
# on every answer: nothing cached, no type guessed, no script or frame from elsewhere, no Referer sent
_HEADERS = (("Cache-Control", "no-store"), ("X-Content-Type-Options", "nosniff"),
            ("Content-Security-Policy", ("default-src 'self'; img-src 'self' data:; base-uri 'none'; "
                                         "form-action 'none'; frame-ancestors 'none'")),
            ("X-Frame-Options", "DENY"), ("Referrer-Policy", "no-referrer"))
_TEXT = "text/plain; charset=utf-8"


def _static(name: str) -> bytes:
    return resources.files(__package__).joinpath("static").joinpath(name).read_bytes()


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_of(header: str) -> str:
    """The name or address of a Host header (``[::1]:8080`` -> ``::1``; ``Name.:80`` -> ``name``)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    if header.count(":") == 1:
        header = header.split(":", 1)[0]
    return header.rstrip(".")


class _Names:
    """The names and addresses this dashboard answers to (see the module's docstring)."""

    def __init__(self, bound: str, extra: Iterable[str]) -> None:
        hostname = socket.gethostname().lower()
        self._names = {"localhost", hostname, hostname.split(".")[0]} | {_host_of(h) for h in extra}
        if bound not in ("", "0.0.0.0", "::"):
            self._names.add(_host_of(bound))
        self._lock = threading.Lock()
        self._fqdn: Optional[str] = None
        self._local: Dict[str, bool] = {}

    def shown(self) -> str:
        return ", ".join(sorted(self._names)) + ", loopback addresses and this machine's own addresses"

    def allows(self, name: str) -> bool:
        if name in self._names:
            return True
        try:
            address = ipaddress.ip_address(name)
        except ValueError:
            with self._lock:
                if self._fqdn is None:  # asked once, and only when a name is not one of the above
                    self._fqdn = socket.getfqdn().lower().rstrip(".")
            return name == self._fqdn
        if address.is_loopback:
            return True
        with self._lock:
            known = self._local.get(name)
        if known is None:
            known = _is_local(address)
            with self._lock:
                if len(self._local) < 256:  # what strangers send is not kept without bound
                    self._local[name] = known
        return known


def _is_local(address: Any) -> bool:
    """Whether ``address`` is one of this machine's (a socket can be bound to it)."""
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((str(address), 0))
        return True
    except OSError:
        return False


class Server:
    """One dashboard: ``views`` says what it shows; :attr:`url` (with the token) once started.
    ``hosts``: names it answers to besides its own (see the module's docstring); ``limits``: what it
    gives each connection (:class:`~roving.dashboard.serving.Limits`; its defaults if None)."""

    def __init__(self, views: Views, host: str = "127.0.0.1", port: int = 0,
                 token: Optional[str] = None, tls: Optional[bool] = None, hosts: Iterable[str] = (),
                 limits: Optional[Limits] = None) -> None:
        self.views = views
        self.token = token or secrets.token_urlsafe(24)
        if tls is None:
            tls = not _loopback(host)
        #: The SHA-256 fingerprint of the HTTPS certificate ("" for plain HTTP).
        self.fingerprint = ""
        context = None
        if tls:
            from .tls import server_context

            context, self.fingerprint = server_context(host)
        try:
            self._http = HttpServer(self._answer, host, port, context, limits)
        except OSError as exc:
            raise OSError(f"the dashboard cannot listen on {host}:{port} (options dashboard_host, "
                          f"dashboard_port): {exc}") from None
        self.host, self.port = self._http.address
        self._names = _Names(host, hosts)
        session = hashlib.sha256(self.token.encode()).hexdigest()[:12]
        #: The name of its cookie: per port and session.
        self.cookie = f"{'__Host-' if tls else ''}roving-dashboard-{self.port}-{session}"
        self._cookie_attributes = "HttpOnly; SameSite=Strict; Path=/" + ("; Secure" if tls else "")
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else f"[{host}]" if ":" in host else host
        self.url = f"{'https' if tls else 'http'}://{shown}:{self.port}/?token={self.token}"
        self._routes: Dict[str, Callable[[], Tuple[bytes, str]]] = {
            "/api/state": lambda: (json.dumps(self.views.state(), default=str).encode(), "application/json"),
            "/metrics": lambda: (prometheus.text(self.views.state()).encode(),
                                 "text/plain; version=0.0.4; charset=utf-8"),
        }

    @property
    def open_connections(self) -> int:
        """Connections open now (at most ``limits.connections``)."""
        return self._http.open_connections

    def start(self) -> "Server":
        self._http.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving (returns within ``timeout`` seconds)."""
        self._http.stop(timeout)

    def _authorized(self, headers: Any, query: Dict[str, Any]) -> Tuple[bool, bool]:
        """(the request carries the token, it came in the query: set the cookie)."""
        given = query.get("token", [""])[0]
        if given:
            return hmac.compare_digest(given.encode(), self.token.encode()), True
        auth = headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            return hmac.compare_digest(auth[7:].strip().encode(), self.token.encode()), False
        for part in headers.get("Cookie", "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == self.cookie:
                return hmac.compare_digest(value.encode(), self.token.encode()), False
        return False, False

    def _answer(self, request: Request) -> Answer:
        """The answer to ``request`` (called in one of the server's worker threads)."""
        host = request.headers.get("Host")
        if not host:
            return Answer(400, b"400: a request needs a Host header\n", _TEXT, _HEADERS, close=True)
        name = _host_of(host)
        if not self._names.allows(name):
            log.debug("dashboard: refused Host %r from %s", host, request.source)
            return Answer(421, (f"421: this dashboard does not answer to the name {name!r} (the request's Host "
                                f"header); it answers to {self._names.shown()}. Open the URL it printed, or "
                                f"add the name to the dashboard_hosts option.\n").encode(), _TEXT, _HEADERS, close=True)
        if request.method not in ("GET", "HEAD"):
            return Answer(405, f"405: {request.method} is not served here (GET and HEAD are)\n".encode(), _TEXT,
                          _HEADERS + (("Allow", "GET, HEAD"),), close=True)
        url = urllib.parse.urlsplit(request.target)
        if not request.target.startswith("/"):
            return Answer(400, b"400: the request target must be a path\n", _TEXT, _HEADERS, close=True)
        ok, cookie = self._authorized(request.headers, urllib.parse.parse_qs(url.query))
        if not ok:
            return Answer(403, b"403: this dashboard needs the token of the URL it printed (?token=...)\n", _TEXT,
                          _HEADERS)
        headers: Tuple[Tuple[str, str], ...] = _HEADERS
        if cookie:
            headers += (("Set-Cookie", f"{self.cookie}={self.token}; {self._cookie_attributes}"),)
        try:
            if url.path in _STATIC:
                name, ctype = _STATIC[url.path]
                body = _static(name)
            elif url.path in self._routes:
                body, ctype = self._routes[url.path]()
            else:
                return Answer(404, f"404: no page {url.path}\n".encode(), _TEXT, headers)
        except Exception as exc:
            log.exception("dashboard: %s failed", url.path)
            return Answer(500, f"500: {exc!r}\n".encode(), _TEXT, headers)
        return Answer(200, body, ctype, headers)
