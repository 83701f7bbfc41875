"""Module-level functions that executor workers (roving's and the standard library's) import by reference
in tests/api/test_futures.py and tests/api/test_joblib.py; cheap to import (no pytest)."""
from __future__ import annotations

import os
import signal
import time

_state = {}


def square(x):
    return x * x


def identity(value):
    return value


class Argument(dict):
    """An argument a weak reference can be made to (a plain dict cannot)."""


def add(a, b):
    return a + b


def sleep_then_return(seconds, value):
    time.sleep(seconds)
    return value


def getpid(_=None):
    return os.getpid()


def wait_for(path, value="done", limit=30.0):
    """Return ``value`` once ``path`` exists (at once for None); at most ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while path is not None and not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    return value


def raise_value_error(message):
    raise ValueError(message)


def kill_self(_=None):
    os.kill(os.getpid(), signal.SIGKILL)


def set_global(value):
    _state["value"] = value


def get_global(_=None):
    return _state.get("value")


def fail_init(message):
    raise ValueError(message)


def logged_square(log_path, i, seconds=0.0):
    """``(i * i, pid)``, after appending ``"i pid"`` to ``log_path`` (one O_APPEND write per call, so
    every execution is counted, also one whose result a killed worker never sent)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{i} {os.getpid()}\n".encode())
    finally:
        os.close(fd)
    if seconds:
        time.sleep(seconds)
    return i * i, os.getpid()


def kill_once(marker, value):
    """Kill this worker the first time any worker runs it (``marker`` does not exist yet); else ``value``."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return value
    os.kill(os.getpid(), signal.SIGKILL)


def fail_on_bad(message):
    if message == "bad":
        raise ValueError(f"{message} item")
    return message


def meet(barrier, timeout=30.0):
    """Wait at ``barrier`` (a roving Barrier), then return this worker's pid."""
    barrier.wait(timeout)
    return os.getpid()


def logged_or_fail(log_path, i, bad=5):
    """Log the call (see logged_square), sleep 50 ms, and fail for item ``bad``."""
    logged_square(log_path, i, 0.05)
    return fail_on_bad("bad" if i == bad else "ok")
