"""What tests/api/test_futures_stdlib.py hands both executors (the standard library's and roving's):
module-level functions and objects that fail at a chosen step of a call's trip (pickled here, unpickled in
the worker, run, result pickled there, unpickled here); cheap to import (no pytest)."""
from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time


def identity(x):
    return x


def raise_value_error(message):
    raise ValueError(message)


def return_lock(_=None):
    """A result no pickler takes."""
    return threading.Lock()


def return_instance(cls):
    return cls()


def sleep_then_kill(seconds):
    time.sleep(seconds)
    os.kill(os.getpid(), signal.SIGKILL)


def sleep_then_return(seconds, value):
    time.sleep(seconds)
    return value


def wait_for(path, value="done", limit=30.0):
    """Return ``value`` once ``path`` exists; at most ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    return value


def _raise_unpickling(message):
    raise pickle.UnpicklingError(message)


def _exit(*_):
    sys.exit(1)


class ErrorAtUnpickle:
    """Pickles; unpickling it raises UnpicklingError."""

    def __reduce__(self):
        return _raise_unpickling, ("refused on purpose",)


class ExitAtUnpickle:
    """Pickles; unpickling it raises SystemExit (in whichever thread unpickles it)."""

    def __reduce__(self):
        return _exit, ()


class ErrorAtPickle:
    """Pickling it raises PicklingError."""

    def __reduce__(self):
        raise pickle.PicklingError("refused on purpose")


class Argument:
    """An object to hold a weak reference to."""

    def method(self):
        return 1
