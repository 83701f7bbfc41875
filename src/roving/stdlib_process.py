"""roving's processes where the standard library's multiprocessing meets them: the parent as a child
sees it (what ``roving.parent_process()`` returns, and what the standard library's ``parent_process()``
returns in a roving child), the standard library's own process object standing in for a roving child,
and the refusal to hand a roving object to a process that the standard
library starts (it is no member of the session).
"""
from __future__ import annotations

from typing import Optional, Tuple

from .transport import session as _session


class ParentProcess:
    """The parent, as a child sees it: name, pid and whether it still answers."""

    def __init__(self, name: str, pid: Optional[int], address: str) -> None:
        self.name, self.pid, self.ident, self._address = name, pid, pid, address
        self.daemon = False

    def is_alive(self) -> bool:
        return _session.current().endpoint(self._address).ping(2.0)

    def join(self, timeout: Optional[float] = None) -> None:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.is_alive():
            if deadline is not None and time.monotonic() >= deadline:
                return
            time.sleep(0.2)

    def __repr__(self) -> str:
        return f"<ParentProcess name={self.name!r} parent={self.pid}>"


def refuse_standard_start(what: str) -> None:
    """Raise RuntimeError when ``what`` (a roving object, being pickled) goes with the start of a process of
    the standard library's multiprocessing (its spawn or forkserver ``Process``, as its Pool and
    ``ProcessPoolExecutor`` start them). Such a process is no member of this roving session: it cannot
    authenticate to the process that serves the object, so it would fail there while whoever waits on
    the object here waits until their timeout. Said at once, in this process, instead."""
    import multiprocessing.context as mp_context

    if mp_context.get_spawning_popen() is not None:
        raise RuntimeError(
            f"roving: this {what} cannot be given to a process that the standard library's multiprocessing "
            "starts: that process is not part of this program's roving session and cannot authenticate to "
            "use it. Start the process with roving.Process (or roving.get_context(...).Process), or give it a "
            "multiprocessing object")


def stand_in(name: str, identity: Tuple[int, ...], parent: ParentProcess) -> None:
    """In a roving child: the standard library's ``multiprocessing.current_process()`` takes this
    process's ``name`` and ``identity``, and its ``parent_process()`` is ``parent`` (libraries and
    logging's ``processName`` read them). Its object keeps its own authkey (the session secret must not
    reach what a child starts with the standard library) and ``daemon`` False (so a library may still
    start its own multiprocessing children in a worker)."""
    import multiprocessing.process as mp_process

    # the standard library's private names (typeshed does not declare them), as its own children set them
    mp_process._current_process._name = name  # type: ignore[attr-defined]
    mp_process._current_process._identity = identity  # type: ignore[attr-defined]
    mp_process._parent_process = parent  # type: ignore[attr-defined]
