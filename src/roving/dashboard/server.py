"""The dashboard's HTTP server: a page, JSON endpoints, ``/metrics``, every request behind a token.

It runs in its own daemon thread (a :class:`~http.server.ThreadingHTTPServer`), reading snapshots of
:mod:`roving.observe` and of a pipeline's control folder when a browser asks; it never runs on the
program's hot path and publishes nothing itself.

Access: the URL printed once carries ``?token=...``; the first request with it gets a cookie (HttpOnly,
SameSite=Strict), later ones may carry either (or ``Authorization: Bearer TOKEN``, for Prometheus).
Every request without the right token gets 403, whatever the path. The token is compared in constant
time. The server binds 127.0.0.1 unless the ``dashboard_host`` option says otherwise. On loopback it
speaks plain HTTP; beyond it (or with ``tls=True``) HTTPS with a self-signed certificate made at start
(:mod:`roving.dashboard.tls`), whose fingerprint the printed line carries, so that the token never
travels in clear (``tls=False`` turns that off, at the user's word: the ``dashboard_tls`` option).
"""
from __future__ import annotations

import hmac
import http.server
import json
import logging
import secrets
import threading
import urllib.parse
from importlib import resources
from typing import Any, Callable, Dict, Optional, Tuple

from . import prometheus
from .state import Views

log = logging.getLogger(__name__)

__all__ = ["Server"]

_COOKIE = "roving_dashboard"
_STATIC = {"/": ("index.html", "text/html; charset=utf-8"), "/app.js": ("app.js", "text/javascript; charset=utf-8"),
           "/style.css": ("style.css", "text/css; charset=utf-8")}


def _static(name: str) -> bytes:
    return resources.files(__package__).joinpath("static").joinpath(name).read_bytes()


class Server:
    """One dashboard: ``views`` says what it shows; :attr:`url` (with the token) once started."""

    def __init__(self, views: Views, host: str = "127.0.0.1", port: int = 0,
                 token: Optional[str] = None, tls: Optional[bool] = None) -> None:
        self.views = views
        self.token = token or secrets.token_urlsafe(24)
        handler = _handler(self)
        try:
            self.httpd = http.server.ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise OSError(f"the dashboard cannot listen on {host}:{port} (options dashboard_host, "
                          f"dashboard_port): {exc}") from None
        self.httpd.daemon_threads = True
        self.host, self.port = self.httpd.server_address[:2]
        if tls is None:
            tls = not _loopback(host)
        #: The SHA-256 fingerprint of the HTTPS certificate ("" for plain HTTP).
        self.fingerprint = ""
        if tls:
            from .tls import server_context

            ctx, self.fingerprint = server_context(host)
            self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else f"[{host}]" if ":" in host else host
        self.url = f"{'https' if tls else 'http'}://{shown}:{self.port}/?token={self.token}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.25},
                                        name="roving-dashboard", daemon=True)

    def start(self) -> "Server":
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving (returns within ``timeout`` seconds)."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout)

    def allowed(self, headers: Any, query: Dict[str, Any]) -> Tuple[bool, bool]:
        """(the request carries the token, it came in the query: set the cookie)."""
        given = query.get("token", [""])[0]
        if given:
            return hmac.compare_digest(given.encode(), self.token.encode()), True
        auth = headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            return hmac.compare_digest(auth[7:].strip().encode(), self.token.encode()), False
        for part in headers.get("Cookie", "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == _COOKIE:
                return hmac.compare_digest(value.encode(), self.token.encode()), False
        return False, False


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _handler(server: Server) -> type:
    routes: Dict[str, Callable[[], Tuple[bytes, str]]] = {
        "/api/state": lambda: (json.dumps(server.views.state(), default=str).encode(), "application/json"),
        "/metrics": lambda: (prometheus.text(server.views.state()).encode(),
                             "text/plain; version=0.0.4; charset=utf-8"),
    }

    class Handler(http.server.BaseHTTPRequestHandler):
        server_version = "roving-dashboard"
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:  # no lines on the program's terminal
            log.debug("dashboard: " + fmt, *args)

        def _send(self, code: int, body: bytes, ctype: str, cookie: bool = False) -> None:
            try:
                self._answer(code, body, ctype, cookie)
            except OSError:  # the browser went away mid-answer (a page left, a tab closed)
                self.close_connection = True

        def _answer(self, code: int, body: bytes, ctype: str, cookie: bool) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Security-Policy", "default-src 'self'; img-src 'self' data:")
            if cookie:
                self.send_header("Set-Cookie", f"{_COOKIE}={server.token}; HttpOnly; SameSite=Strict; Path=/")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            ok, cookie = server.allowed(self.headers, urllib.parse.parse_qs(url.query))
            if not ok:
                self._send(403, b"403: this dashboard needs the token of the URL it printed (?token=...)\n",
                           "text/plain; charset=utf-8")
                return
            try:
                if url.path in _STATIC:
                    name, ctype = _STATIC[url.path]
                    body = _static(name)
                elif url.path in routes:
                    body, ctype = routes[url.path]()
                else:
                    self._send(404, f"404: no page {url.path}\n".encode(), "text/plain; charset=utf-8", cookie)
                    return
            except Exception as exc:
                log.exception("dashboard: %s failed", url.path)
                self._send(500, f"500: {exc!r}\n".encode(), "text/plain; charset=utf-8", cookie)
                return
            self._send(200, body, ctype, cookie)

    return Handler
