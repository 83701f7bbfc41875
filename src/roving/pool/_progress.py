"""A progress bar for map, imap and imap_unordered: items done of the total, rate and time left, on stderr.

It counts results as the pool's I/O thread delivers them (a failed item counts as done) and a thread of
its own redraws it at most every ``interval`` seconds, so a slow terminal never slows the pool. On a
terminal the bar is redrawn in place; otherwise (a log file, a CI job) a line is written at most every
``LINE_S`` seconds. The last line, with the final count, is always written.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Any, Optional

LINE_S = 1.0


def _clock(seconds: float) -> str:
    seconds = int(seconds + 0.5)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    def __init__(self, total: Optional[int], desc: str, stream: Any = None, interval: float = 0.1) -> None:
        self.total, self.desc, self.done = total, desc, 0
        self._stream = stream
        self._start = time.monotonic()
        self._finished = threading.Event()
        tty = getattr(self._out(), "isatty", lambda: False)()
        self._tty = bool(tty)
        self._interval = interval if self._tty else LINE_S
        self._thread = threading.Thread(target=self._run, name="roving-pool-progress", daemon=True)
        self._thread.start()

    def _out(self) -> Any:
        return self._stream if self._stream is not None else sys.stderr  # as it is now (tests swap it)

    # -- called by the pool (its I/O thread, its feeder thread) --------------------------------
    def update(self, n: int) -> None:
        self.done += n
        if self.total is not None and self.done >= self.total:
            self.finish()

    def set_total(self, total: int) -> None:
        self.total = total
        if self.done >= total:
            self.finish()

    def finish(self) -> None:
        self._finished.set()

    # -- the drawing thread ------------------------------------------------------------------
    def line(self) -> str:
        done, total = self.done, self.total
        took = max(1e-9, time.monotonic() - self._start)
        rate = done / took
        text = f"{self.desc}: {done}"
        if total is not None:
            pct = 100.0 * done / total if total else 100.0
            text += f"/{total} {pct:3.0f}%"
        text += f" | {rate:,.1f} items/s | {_clock(took)} elapsed"
        if total is not None and done < total and rate > 0:
            text += f" | {_clock((total - done) / rate)} left"
        return text

    def _draw(self, final: bool = False) -> None:
        try:
            out = self._out()
            if self._tty:
                out.write("\r" + self.line() + ("\n" if final else "\x1b[K"))
            else:
                out.write(self.line() + "\n")
            out.flush()
        except Exception:  # a closed or broken stream must not break the pool
            pass

    def _run(self) -> None:
        shown = -1
        while not self._finished.wait(self._interval):
            if self.done != shown:  # redraw only when results arrived (the tty line keeps its time)
                shown = self.done
                self._draw()
        self._draw(final=True)

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait until the last line is written."""
        self._thread.join(timeout)
