"""Where a job's output goes: this process's terminal, each line prefixed with the process name, or a
log file that only this user can read.

Every backend that copies a child's output uses these, so that the ``child_output`` option means the
same on each: "prefix" (:class:`LineSplitter` to :func:`write_prefixed`), "files" (a log file opened
with :func:`roving.system.private.open_private`: no link followed, 0600, refused when not private)
or "off".
"""
from __future__ import annotations

import functools
import logging
import os
import sys
from typing import IO, Callable, Iterable, List, Optional

from ..system.selector_thread import SelectorThread

log = logging.getLogger(__name__)

__all__ = ["write_prefixed", "LineSplitter", "OutputPump", "set_line_observer"]

#: Called with (process name, lines) for every child's output printed here (roving.observe installs it
#: when roving is imported: the backends import nothing above the configuration).
_observer: Optional[Callable[[str, List[str]], None]] = None


def set_line_observer(observer: Optional[Callable[[str, List[str]], None]]) -> None:
    """Install the function that also sees each child's printed output lines (None: none)."""
    global _observer
    _observer = observer


def write_prefixed(prefix: str, lines: Iterable[bytes], to_stderr: bool = False) -> None:
    """Write a child's output lines to this process's terminal, ``prefix`` before each. Never raises
    for a closed stream (the interpreter is shutting down): the lines are dropped."""
    out = sys.stderr if to_stderr else sys.stdout
    decoded = [line.decode(errors="replace") for line in lines]
    if not decoded:
        return
    text = "".join(f"{prefix}{line}\n" for line in decoded)
    if _observer is not None:
        try:
            _observer(prefix.strip().strip("[]:").strip(), decoded)
        except Exception:  # publishing never stops the output
            pass
    try:
        out.write(text)
        out.flush()
    except (ValueError, OSError):  # the parent's stream was closed (interpreter shutdown)
        pass


class LineSplitter:
    """Turns chunks of output into whole lines for :func:`write_prefixed`; with ``keep``, only the lines
    for which ``keep(line)`` is true are written. :meth:`close` writes a last line without its newline."""

    def __init__(self, prefix: str, to_stderr: bool = False,
                 keep: Optional[Callable[[bytes], bool]] = None) -> None:
        self.prefix, self.to_stderr, self._partial, self._keep = prefix, to_stderr, b"", keep

    def _write(self, lines: List[bytes]) -> None:
        if self._keep is not None:
            lines = [line for line in lines if self._keep(line)]
        write_prefixed(self.prefix, lines, self.to_stderr)

    def feed(self, chunk: bytes) -> None:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        self._write(lines)

    def close(self) -> None:
        if self._partial:
            self._write([self._partial])
            self._partial = b""


class OutputPump:
    """One thread that copies the output of many streams (children's pipes) to this process's terminal,
    a prefix on each line. Each stream is closed at its end, or once it cannot be read (with a warning:
    the others go on, since a child whose output nobody reads would block once its pipe is full)."""

    def __init__(self) -> None:
        self._watch = SelectorThread("roving-output")
        self._thread = self._watch.thread

    def add(self, stream: IO[bytes], prefix: str, to_stderr: bool,
            on_end: Optional[Callable[[], None]] = None) -> None:
        """Copy ``stream`` until its end, to stderr with ``to_stderr``, else to stdout. Returns at once;
        ``on_end()`` is called (in the pump's thread) once every line of it has been written and it is closed."""
        self._watch.watch(stream, functools.partial(self._copy, stream, LineSplitter(prefix, to_stderr), on_end))

    def _copy(self, stream: IO[bytes], splitter: LineSplitter, on_end: Optional[Callable[[], None]]) -> None:
        """``stream`` is readable (in the pump's thread): copy what came, or end at its end."""
        try:
            chunk = os.read(stream.fileno(), 65536)
            if chunk:
                splitter.feed(chunk)
                return
            splitter.close()  # end of output: flush what is left, stop watching
        except Exception as exc:
            log.warning("roving: stopped copying the output of %s: %s", splitter.prefix.strip(), exc)
        self._watch.forget(stream, functools.partial(_close, stream, on_end))


def _close(stream: IO[bytes], on_end: Optional[Callable[[], None]]) -> None:
    try:
        stream.close()
    except OSError:
        pass
    if on_end is not None:
        on_end()
