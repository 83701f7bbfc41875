"""Timeouts made fit for the clock, wherever a caller's or a peer's value meets it.

A wait longer than :data:`LONGEST` (about 31 years; ``float("inf")`` included) is no timeout at all:
such values would overflow the clock's and the poller's integers (an ``OverflowError`` on every turn
of a node's I/O loop, once). A negative timeout means "do not wait", as in multiprocessing; NaN is a
ValueError. On the wire (the node's request header) -1 means forever and 0 "do not wait".
"""
from __future__ import annotations

import math
import time
from typing import Optional, SupportsFloat, Union

__all__ = ["LONGEST", "FOREVER", "limit", "to_wire", "from_wire", "deadline"]

LONGEST = 1e9  # seconds; below threading.TIMEOUT_MAX, so every wait of the standard library takes it
FOREVER = -1.0  # the wire's "no timeout"


def limit(timeout: Optional[float], name: str = "timeout") -> Optional[float]:
    """A caller's timeout in seconds for the clock: None (wait as long as it takes) for None, ``inf``
    and anything above LONGEST; 0.0 for a negative value. Raises ValueError for NaN and TypeError for
    what is not a number, naming ``name``."""
    if timeout is None:
        return None
    try:
        seconds = float(timeout)
    except (TypeError, ValueError):
        raise TypeError(f"'{name}' must be a number of seconds or None, not {timeout!r}") from None
    if math.isnan(seconds):
        raise ValueError(f"'{name}' must be a number of seconds or None, not NaN")
    if seconds > LONGEST:
        return None
    return max(0.0, seconds)


def to_wire(block: bool, timeout: Optional[float], name: str = "timeout") -> float:
    """multiprocessing's (block, timeout) as the wire's timeout: FOREVER, 0 (no wait) or seconds."""
    if not block:
        return 0.0
    seconds = limit(timeout, name)
    return FOREVER if seconds is None else seconds


def from_wire(value: Union[SupportsFloat, str]) -> float:
    """A timeout as a peer sent it, fit for the clock: FOREVER for a negative value, ``inf`` and
    anything above LONGEST; 0 (no wait) for NaN or what is not a number; else the seconds."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return 0.0
    if math.isnan(seconds):
        return 0.0
    if seconds < 0 or seconds > LONGEST:
        return FOREVER
    return seconds


def deadline(timeout: Optional[float], name: str = "timeout") -> Optional[float]:
    """The ``time.monotonic()`` by which a wait of ``timeout`` ends; None when it never does."""
    seconds = limit(timeout, name)
    return None if seconds is None else time.monotonic() + seconds
