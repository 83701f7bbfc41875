"""roving: Python's multiprocessing on cluster backends — ``import roving as multiprocessing``.

Process, Queue, SimpleQueue, JoinableQueue and Pipe behave as in :mod:`multiprocessing`; each process
runs as a job of the configured backend (see :func:`init` and :mod:`roving.config`).
"""
from __future__ import annotations

from typing import Any

from multiprocessing import AuthenticationError, BufferTooShort, ProcessError, TimeoutError

from . import config as _config
from . import observe as _observe
from .backends import output as _output
from .config import Config, ConfigError
from .connection import Connection, Pipe
from .context import (Context, get_all_start_methods, get_context, get_start_method,
                      set_start_method)
from .managers import AsyncManager, Manager
from .pool import AsyncResult, MapResult, OutOfMemoryError, Pool, PoolStartError, WorkerLostError, meta
from .environment import EnvironmentMismatchError
from .errors import RovingError
from .process import Process, ProcessStartError, active_children, cpu_count, current_process, parent_process
from .queues import JoinableQueue, Queue, SimpleQueue
from .shared import Shared, shared
from .sharedctypes import Array, RawArray, RawValue, Value
from .synchronize import Barrier, BoundedSemaphore, Condition, Event, Lock, RLock, Semaphore
from .transport.endpoint import ConnectionLost
from .transport.serialize import SerializationError

__version__ = "0.1.0"

__all__ = [
    "Process", "Pool", "AsyncResult", "MapResult", "WorkerLostError", "OutOfMemoryError", "meta", "Queue",
    "SimpleQueue", "JoinableQueue",
    "Pipe", "Connection",
    "current_process", "parent_process", "active_children", "cpu_count",
    "get_context", "set_start_method", "get_start_method", "get_all_start_methods", "Context",
    "init", "Config", "ConfigError", "SerializationError", "ConnectionLost", "ProcessStartError", "PoolStartError",
    "EnvironmentMismatchError", "RovingError",
    "ProcessError", "BufferTooShort", "TimeoutError", "AuthenticationError", "freeze_support",
    "Lock", "RLock", "Semaphore", "BoundedSemaphore", "Event", "Condition", "Barrier",
    "Value", "Array", "RawValue", "RawArray", "Manager", "AsyncManager",
    "shared", "Shared",
]


def init(**options: object) -> Config:
    """Set roving options for this process and the processes it starts from now on (see
    :func:`roving.config.init`); with ``dashboard=True`` the main process also serves the dashboard."""
    cfg = _config.init(**options)
    if cfg.dashboard:
        from . import dashboard

        dashboard.start_if_configured()
    return cfg


# children's printed output lines are kept (bounded) for the dashboard
_output.set_line_observer(_observe.output_lines)


def _dashboard_from_environment() -> None:
    """``ROVING_DASHBOARD=1`` turns the dashboard on without an init() call (``dashboard = true`` in
    roving.toml or ``[tool.roving]`` takes effect at ``roving.init()``: the file is not read at import)."""
    import os

    if os.environ.get("ROVING_CHILD") or not os.environ.get("ROVING_DASHBOARD", "").strip():
        return
    try:
        on = _config.current().dashboard
    except ConfigError:
        return  # said at the first use of the configuration
    if on:
        from . import dashboard

        dashboard.start_if_configured()


def __getattr__(name: str) -> Any:
    # roving.futures and roving.joblib load on first use: joblib is heavy, and only its users need it
    if name in ("futures", "joblib"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def freeze_support() -> None:
    """Accepted for compatibility; roving never needs it."""


_dashboard_from_environment()
