"""The very call that failed on a worker, run again in the caller's process: ``roving.debug.rerun``.

When an item fails (it raised, or it was running on workers that died: WorkerLostError), the dispatcher
notes, against the exception it delivers, what it sent for that item: the pickled function (with how it
is called: ``f(*args, **kwds)``, ``f(item)``, ``f(*item)``) and the pickled arguments of the item's chunk
with the item's place in it — the bytes the worker got, not the caller's objects, which may have changed
since. :func:`rerun` unpickles them here and calls the function in this thread, so that a debugger
(``pdb=True``, a ``breakpoint()`` in the function, an IDE's) stops in it.

The note is held by the exception itself (an attribute), as long as it lives and no longer: a program that
drops its failed results keeps nothing.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

from . import _protocol as P

__all__ = ["FailedCall", "note", "failed_call", "rerun"]


@dataclasses.dataclass(frozen=True)
class FailedCall:
    """What was sent for one failed item: the function's frames, the chunk's argument frames, the item's
    offset in that chunk, and its index in the call (for messages)."""

    function_frames: List[Any]
    argument_frames: List[Any]
    offset: int
    index: int
    name: str


#: The attribute of a failed item's exception that holds its FailedCall (exceptions take no weak
#: references, so the note travels with the exception itself, and goes when it goes).
_ATTRIBUTE = "__roving_failed_call__"


def note(exc: BaseException, call: FailedCall) -> None:
    """Remember ``call`` for the exception ``exc`` an item failed with (called by the dispatcher)."""
    try:
        setattr(exc, _ATTRIBUTE, call)
    except (AttributeError, TypeError):  # an exception type with no room for it: nothing to rerun
        pass


def failed_call(failure: Any) -> Optional[FailedCall]:
    """The failed call behind ``failure``: an exception a pool or executor call raised (or one that has it
    as its cause or context), an :class:`~roving.pool.AsyncResult` that failed, or a
    ``concurrent.futures.Future`` that did; None when none is known."""
    exc = _exception_of(failure)
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        found = getattr(exc, _ATTRIBUTE, None)
        if isinstance(found, FailedCall):
            return found
        exc = exc.__cause__ or exc.__context__
    return None


def _exception_of(failure: Any) -> Optional[BaseException]:
    if isinstance(failure, BaseException):
        return failure
    if hasattr(failure, "exception") and hasattr(failure, "done"):  # a concurrent.futures.Future
        if not failure.done():
            raise ValueError("the future has not finished: there is no failed call to run again yet")
        return failure.exception()
    if hasattr(failure, "successful") and hasattr(failure, "ready"):  # an AsyncResult
        if not failure.ready():
            raise ValueError("the result is not ready: there is no failed call to run again yet")
        if failure.successful():
            raise ValueError("the call succeeded: there is no failed call to run again")
        try:
            failure.get(0)
        except BaseException as exc:
            return exc
    raise TypeError(f"rerun() takes the exception of a failed pool or executor call, its AsyncResult or its "
                    f"Future, not {type(failure).__name__}")


def rerun(failure: Any, pdb: bool = False) -> Any:
    """Run the call that failed (see :func:`failed_call` for what ``failure`` may be) again in this process,
    with the very function and arguments its worker got; returns what it returns (a failure that does not
    come back), or raises what it raises here, with this process's traceback. ``pdb=True`` runs it under
    the debugger (``pdb.runcall``). LookupError when no failed call is known for ``failure`` (it was not an
    item of a pool call, or the pool could not send it)."""
    found = failed_call(failure)
    if found is None:
        raise LookupError(f"no failed pool call is known for {failure!r}: rerun() takes the exception a pool "
                          "or executor call raised (as it was raised), its AsyncResult or its Future")
    func, mode = P.read_function(found.function_frames)
    item = P.read_list(found.argument_frames)[found.offset]
    kwds: Dict[str, Any]
    if mode == P.MAP:
        args, kwds = (item,), {}
    elif mode == P.STAR:
        args, kwds = tuple(item), {}
    else:
        args, kwds = item
    if pdb:
        import pdb as _pdb

        return _pdb.runcall(func, *args, **kwds)
    return func(*args, **kwds)
