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
import time
from typing import Optional

from .. import config as _config
from .server import Server
from .state import Views

__all__ = ["start", "current", "stop", "watch_pipeline", "start_if_configured", "serve_pipeline", "Server",
           "Views"]

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
                            cfg.dashboard_port if port is None else port, tls=tls, hosts=cfg.dashboard_hosts)
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


def serve_pipeline(control: Optional[str], metrics: Optional[str], host: Optional[str] = None,
                   port: Optional[int] = None) -> int:
    """``roving pipeline dashboard``: serve only the pipeline view of the run whose control folder is
    ``control`` (live) and/or metrics file ``metrics`` (finished), until interrupted. Returns the exit
    status (2 with a message when neither exists)."""
    for path, what in ((control, "control folder"), (metrics, "metrics file")):
        if path and not os.path.exists(path):
            print(f"roving: error: no {what} {path}", file=sys.stderr)
            return 2
    if not control and not metrics:
        print("roving: error: give --control DIR (a run's control folder) or --metrics FILE (a finished run's)",
              file=sys.stderr)
        return 2
    server = start(host, port, runtime=False)
    server.views.watch_pipeline(control, metrics)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        stop()
