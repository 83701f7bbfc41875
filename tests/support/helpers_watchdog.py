"""Watches the roving threads of the test process itself, so that a suite cannot go on for an hour of
timeouts after one of them stopped (every child of every later test talks to them).

After each test: the session's node I/O thread, its stream listener and the local backend's output
copier are still alive. After each test file: a fresh thread reaches the node as a child would (ZeroMQ
handshake, then a stream) and gets an answer. On trouble the suite stops at once and says after which
test, with every thread's stack. Errors the roving threads logged or raised are listed at the end.
"""
from __future__ import annotations

import logging
import sys
import threading
import traceback
from typing import List, Optional

from roving import backends
from roving.transport import session as _session
from roving.transport.endpoint import Endpoint

PROBE_TIMEOUT = 20.0

#: What roving's own threads raised or logged at ERROR (log.exception) during the run.
reported: List[str] = []


class _Collect(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        text = f"[{record.threadName}] {record.name}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + "".join(traceback.format_exception(*record.exc_info))
        reported.append(text)


def install() -> None:
    logging.getLogger("roving").addHandler(_Collect(logging.ERROR))
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.thread is not None and args.thread.name.startswith("roving"):
            reported.append(f"[{args.thread.name}] died: " + "".join(
                traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)))
        previous(args)

    threading.excepthook = hook


def _threads() -> dict:
    """The long-lived roving threads of this process, by role."""
    found = {}
    current = _session._session
    node = current._node if current is not None else None
    if node is not None and node.loop.running:
        found["node I/O"] = node.loop.thread
        listener = node._services.get("streams")
        if listener is not None and listener._running:
            found["stream listener"] = listener._thread
    local = backends._instances.get("local")
    if local is not None and local._pump is not None:
        found["output copier"] = local._pump._thread
    return found


def _probe() -> Optional[str]:
    """None when a new connection to this process's node is answered; else what went wrong."""
    current = _session._session
    node = current._node if current is not None else None
    if node is None or not node.loop.running:
        return None
    result: List[object] = []

    def run() -> None:
        try:
            result.append(Endpoint(node.address, current.secret, None, PROBE_TIMEOUT).ping(PROBE_TIMEOUT))
        except Exception as exc:
            result.append(exc)

    thread = threading.Thread(target=run, name="watchdog-probe", daemon=True)
    thread.start()
    thread.join(2 * PROBE_TIMEOUT + 5)
    if not result:
        return "a new connection to the test process's node hung"
    if result[0] is not True:
        return f"the test process's node did not answer a new connection: {result[0]!r}"
    return None


def stacks() -> str:
    frames = sys._current_frames()
    return "\n".join(f"--- thread {t.name}\n" + "".join(traceback.format_stack(frames[t.ident]))
                     for t in threading.enumerate() if t.ident in frames)


def check(probe: bool) -> Optional[str]:
    """What is wrong with the test process's roving threads, or None."""
    dead = [role for role, thread in _threads().items() if not thread.is_alive()]
    if dead:
        return "these roving threads of the test process have stopped: " + ", ".join(dead)
    return _probe() if probe else None
