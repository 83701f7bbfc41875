"""The live dashboard: what this program's processes and pools, and pipeline trainings, are doing.

Turned on by the ``dashboard`` option (``roving.init(dashboard=True)``, ``ROVING_DASHBOARD=1``, ``--dashboard``
on ``roving run`` and ``roving pipeline train``); ``roving pipeline dashboard --control DIR`` shows a run
started elsewhere. Only the main process of a session serves one (its children publish nothing of it).
The URL, with its token, is printed once on stderr. See :mod:`roving.dashboard.server` for access.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Optional

from .. import config as _config
from .server import Server
from .state import Views

__all__ = ["start", "current", "stop", "watch_pipeline", "start_if_configured", "Server", "Views"]

_lock = threading.Lock()
_server: Optional[Server] = None


def start(host: Optional[str] = None, port: Optional[int] = None, runtime: bool = True,
          announce: bool = True) -> Server:
    """This process's dashboard, started on first call (later calls return it). ``host``/``port``
    default to the ``dashboard_host``/``dashboard_port`` options. OSError naming the address if it
    cannot listen there."""
    global _server
    with _lock:
        if _server is None:
            cfg = _config.current()
            tls = {"auto": None, "on": True, "off": False}[cfg.dashboard_tls]
            server = Server(Views(runtime=runtime), cfg.dashboard_host if host is None else host,
                            cfg.dashboard_port if port is None else port, tls=tls)
            _server = server.start()
            if announce:
                # said once, where the user looks (as Jupyter prints its URL)
                extra = f" (self-signed certificate, SHA-256 {server.fingerprint})" if server.fingerprint else ""
                print(f"roving: dashboard at {server.url}{extra}", file=sys.stderr, flush=True)
        return _server


def current() -> Optional[Server]:
    """The dashboard of this process, if one was started."""
    return _server


def stop() -> None:
    """Stop this process's dashboard (a later :func:`start` makes a new one, with a new token)."""
    global _server
    with _lock:
        server, _server = _server, None
    if server is not None:
        server.stop()


def watch_pipeline(control: Optional[str] = None, metrics: Optional[str] = None) -> None:
    """Show the pipeline training of control folder ``control`` / metrics file ``metrics`` on this
    process's dashboard (if one runs)."""
    if _server is not None:
        _server.views.watch_pipeline(control, metrics)


def start_if_configured() -> Optional[Server]:
    """Start the dashboard when the ``dashboard`` option is on and this is a session's main process."""
    if os.environ.get("ROVING_CHILD") or not _config.current().dashboard:
        return None
    return start()
