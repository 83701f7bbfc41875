"""Bounds on what strangers can make a listener do before they authenticate, and how refusals are told.

* :class:`Refusals` logs a refused peer once per source address and interval, with how many refusals
  of it were not logged since: a flood of bad connections neither fills the log nor goes unseen.
* :class:`Admission` caps the handshakes in progress at once, in all and per source address.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Dict

_INTERVAL_S = 60.0
_REMEMBERED = 4096  # source addresses whose last refusal is remembered


class Refusals:
    """Throttled warnings about refused peers: one per source address per ``interval`` seconds."""

    def __init__(self, logger: logging.Logger, where: str, interval: float = _INTERVAL_S) -> None:
        self._log, self._where, self._interval = logger, where, interval
        self._last: "collections.OrderedDict[str, list]" = collections.OrderedDict()  # source -> [time, unlogged]
        self._lock = threading.Lock()
        #: Refusals counted, logged or not (tests read it).
        self.count = 0

    def refuse(self, source: str, why: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.count += 1
            seen = self._last.get(source)
            if seen is not None and now - seen[0] < self._interval:
                seen[1] += 1
                return
            unlogged = seen[1] if seen is not None else 0
            self._last[source] = [now, 0]
            self._last.move_to_end(source)
            while len(self._last) > _REMEMBERED:
                self._last.popitem(last=False)
        more = f" ({unlogged} more refusal(s) of it since the last warning)" if unlogged else ""
        self._log.warning("roving %s: refused a connection from %s: %s%s; further refusals of it are "
                          "logged at most once a minute", self._where, source, why, more)


class Admission:
    """Handshakes in progress: at most ``total`` at once, and ``per_source`` from one source address."""

    def __init__(self, total: int, per_source: int) -> None:
        self.total, self.per_source = total, per_source
        self._by_source: Dict[str, int] = {}
        self._count = 0
        self._lock = threading.Lock()

    def enter(self, source: str) -> str:
        """"" when admitted (call :meth:`leave` after), else why not."""
        with self._lock:
            if self._count >= self.total:
                return f"{self.total} handshakes in progress already"
            held = self._by_source.get(source, 0)
            if held >= self.per_source:
                return f"{self.per_source} handshakes from this address in progress already"
            self._by_source[source] = held + 1
            self._count += 1
            return ""

    def leave(self, source: str) -> None:
        with self._lock:
            self._count -= 1
            held = self._by_source.get(source, 1) - 1
            if held:
                self._by_source[source] = held
            else:
                self._by_source.pop(source, None)
