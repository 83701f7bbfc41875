"""roving: Python's multiprocessing on cluster backends — ``import roving as multiprocessing``.

Process, Queue, SimpleQueue, JoinableQueue and Pipe behave as in :mod:`multiprocessing`; each process
runs as a job of the configured backend (see :func:`init` and :mod:`roving.config`).
"""
from __future__ import annotations

from multiprocessing import AuthenticationError, BufferTooShort, ProcessError, TimeoutError

from .config import Config, ConfigError, init
from .connection import Connection, Pipe
from .context import (Context, get_all_start_methods, get_context, get_start_method,
                      set_start_method)
from .managers import AsyncManager, Manager
from .pool import AsyncResult, MapResult, Pool, PoolStartError, WorkerLostError, meta
from .process import Process, ProcessStartError, active_children, cpu_count, current_process, parent_process
from .queues import JoinableQueue, Queue, SimpleQueue
from .shared import Shared, shared
from .sharedctypes import Array, RawArray, RawValue, Value
from .synchronize import Barrier, BoundedSemaphore, Condition, Event, Lock, RLock, Semaphore
from .transport.endpoint import ConnectionLost
from .transport.serialize import SerializationError

__version__ = "0.1.0"

__all__ = [
    "Process", "Pool", "AsyncResult", "MapResult", "WorkerLostError", "meta", "Queue", "SimpleQueue", "JoinableQueue", "Pipe", "Connection",
    "current_process", "parent_process", "active_children", "cpu_count",
    "get_context", "set_start_method", "get_start_method", "get_all_start_methods", "Context",
    "init", "Config", "ConfigError", "SerializationError", "ConnectionLost", "ProcessStartError", "PoolStartError",
    "ProcessError", "BufferTooShort", "TimeoutError", "AuthenticationError", "freeze_support",
    "Lock", "RLock", "Semaphore", "BoundedSemaphore", "Event", "Condition", "Barrier",
    "Value", "Array", "RawValue", "RawArray", "Manager", "AsyncManager",
    "shared", "Shared",
]


def __getattr__(name: str):
    # roving.futures and roving.joblib load on first use: joblib is heavy, and only its users need it
    if name in ("futures", "joblib"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def freeze_support() -> None:
    """Accepted for compatibility; roving never needs it."""
