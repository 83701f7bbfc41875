"""How a pool worker learns that it is about to be ended, so that it can leave well rather than die.

A worker on a real cluster is ended by things that say so first: Slurm's time limit (SIGTERM, or the
``--signal`` warning roving asks for, some seconds before), ``scancel``, a Kubernetes pod's termination
(SIGTERM, then SIGKILL after its grace period), a spot or preemptible machine's notice (a file a node
agent writes, ``preemption_file``, or the cloud's metadata URL, ``preemption_url``), or its own planned
lifetime (``worker_lifetime``, replaced ahead of a time limit). :class:`Ending` gathers them into one
event with a reason and a deadline: from the moment it is set the worker takes no more work, hands back
what it has not started, finishes what it runs within ``worker_grace`` seconds, and leaves; at the
deadline it goes whatever it runs. The pool counts none of this against ``max_task_retries``.

Signals are caught only in the main thread (Python runs handlers there); the handler only sets the
event (nothing that could deadlock in the middle of the task it interrupts).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable, List, Optional, Sequence

__all__ = ["Ending", "signals_named", "lifetime_for", "slurm_seconds"]

#: Seconds between a Slurm job's start and its worker's: the job's clock starts first.
_SLURM_MARGIN_S = 10.0


def signals_named(names: str) -> List[signal.Signals]:
    """``"TERM,USR1"`` as signals; ValueError naming an unknown one."""
    found = []
    for name in (n.strip().upper() for n in names.split(",") if n.strip()):
        try:
            found.append(signal.Signals[name if name.startswith("SIG") else f"SIG{name}"])
        except KeyError:
            raise ValueError(f"no signal named {name!r} (end_signals: e.g. 'TERM,USR1')") from None
    return found


def slurm_seconds(value: str) -> float:
    """Slurm's time format (``--time``): minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS, as
    seconds; ValueError for anything else (and for "UNLIMITED"/"INFINITE", which have none)."""
    text = str(value).strip()
    days = 0
    if "-" in text:
        head, text = text.split("-", 1)
        days = int(head)
        parts = [int(p) for p in text.split(":")]
        hours, minutes, seconds = (parts + [0, 0])[:3]
    else:
        parts = [int(p) for p in text.split(":")]
        if len(parts) == 1:
            hours, minutes, seconds = 0, parts[0], 0
        elif len(parts) == 2:
            hours, (minutes, seconds) = 0, parts
        elif len(parts) == 3:
            hours, minutes, seconds = parts
        else:
            raise ValueError(f"not a Slurm time: {value!r}")
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def lifetime_for(cfg: object) -> Optional[float]:
    """How long a worker of this configuration lives: ``worker_lifetime`` when set (0 or less: unlimited);
    else, on Slurm with ``slurm_time``, that less a margin for the job's own start; else unlimited (None)."""
    own = getattr(cfg, "worker_lifetime", None)
    if own is not None:
        return float(own) if float(own) > 0 else None
    if getattr(cfg, "backend", "") == "slurm" and getattr(cfg, "slurm_time", None):
        try:
            return max(1.0, slurm_seconds(cfg.slurm_time) - _SLURM_MARGIN_S)  # type: ignore[attr-defined]
        except ValueError:
            return None
    return None


def _notice_at(url: str) -> bool:
    """Whether the cloud's metadata service at ``url`` gives notice: an answer 200 whose body is not
    ``FALSE`` (AWS's spot ``instance-action`` answers 404 until a notice; GCE's ``preempted`` says
    ``FALSE``/``TRUE`` and wants its ``Metadata-Flavor`` header). Anything else, an error included: no."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=1.0) as answer:
            return answer.status == 200 and answer.read(4096).strip().upper() != b"FALSE"
    except (OSError, ValueError, urllib.error.URLError):
        return False


class Ending:
    """Set once the worker is to end: :attr:`reason` says why, :attr:`deadline` (``time.monotonic()``)
    is when it must be gone. Watches ``signals``, the file ``preemption_file`` (its appearance), and the
    worker's ``lifetime`` (seconds from now, its grace included)."""

    def __init__(self, grace: float, signals: Sequence[signal.Signals] = (), lifetime: Optional[float] = None,
                 preemption_file: Optional[str] = None, poll_s: float = 1.0,
                 preemption_url: Optional[str] = None, url_every_s: float = 5.0) -> None:
        self.grace = grace
        self.event = threading.Event()
        self.reason = ""
        self.deadline = float("inf")
        self._listeners: List[Callable[["Ending"], None]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._previous = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._signalled: Optional[int] = None
        if threading.current_thread() is threading.main_thread():
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        self._born = time.monotonic()
        self._lifetime = lifetime
        self._file = preemption_file
        self._url, self._url_every_s, self._url_next = preemption_url, url_every_s, 0.0
        self._poll_s = poll_s
        threading.Thread(target=self._watch, name="roving-worker-ending", daemon=True).start()

    def on_set(self, listener: Callable[["Ending"], None]) -> None:
        """Call ``listener(self)`` once it is set (at once if it already is), on the thread that sets it."""
        with self._lock:
            if not self.event.is_set():
                self._listeners.append(listener)
                return
        listener(self)

    def set(self, reason: str, within: Optional[float] = None) -> None:
        """The worker is to end, for ``reason``, within ``within`` seconds (default: its grace). The first
        call counts; later ones only bring the deadline nearer."""
        deadline = time.monotonic() + (self.grace if within is None else max(0.0, within))
        with self._lock:
            first = not self.event.is_set()
            if first:
                self.reason = reason
            self.deadline = min(self.deadline, deadline)
            self.event.set()
            listeners, self._listeners = (self._listeners, []) if first else ([], [])
        for listener in listeners:
            listener(self)

    def left(self) -> float:
        """Seconds until the deadline (inf while not set)."""
        return self.deadline - time.monotonic()

    def _on_signal(self, signum: int, frame: object) -> None:
        # In the main thread, between two bytecodes of whatever it runs (perhaps holding a lock): only
        # note it and write a byte to a pipe, which the watching thread reads.
        self._signalled = signum
        try:
            os.write(self._wake_w, b"!")
        except OSError:  # the pipe is full of earlier wake-ups, or closed: the thread knows already
            pass

    def _watch(self) -> None:
        import select

        while not self._stop.is_set():
            # woken by a signal's byte; else, only where something is to be looked at: the lifetime's
            # end, the preemption file or URL (an idle worker of a thousand costs nothing here)
            timeout: Optional[float] = None
            if self._file or self._url:
                timeout = self._poll_s
            if self._lifetime is not None and not self.event.is_set():
                due = self._born + self._lifetime - self.grace - time.monotonic()
                timeout = max(0.0, due) if timeout is None else min(timeout, max(0.0, due))
            ready, _, _ = select.select([self._wake_r], [], [], timeout)
            if self._stop.is_set():
                return
            if ready:
                os.read(self._wake_r, 64)
                if self._signalled is not None:
                    self.set(f"signal {signal.Signals(self._signalled).name}")
            if self.event.is_set():
                continue  # a later signal brings nothing new; lifetime and file are moot
            if self._lifetime is not None:
                left = self._born + self._lifetime - time.monotonic()
                if left <= self.grace:
                    self.set(f"its lifetime of {self._lifetime:g} s (worker_lifetime) is nearly over", left)
            if self._file and os.path.exists(self._file):
                self.set(f"the preemption notice {self._file} appeared")
            elif self._url and time.monotonic() >= self._url_next:
                self._url_next = time.monotonic() + self._url_every_s
                if _notice_at(self._url):
                    self.set(f"the preemption notice at {self._url}")

    def close(self) -> None:
        """Stop watching; signal handlers as they were."""
        self._stop.set()
        try:
            os.write(self._wake_w, b"!")
        except OSError:
            pass
        for sig, previous in self._previous.items():
            try:
                signal.signal(sig, previous)
            except (ValueError, TypeError):
                pass
        self._previous.clear()
