"""How a :class:`roving.Process` travels to its child: pickled whole (target, arguments and all) by
``start()``, with an error that names the part that cannot be pickled; without the parent's handles (its
job, backend, sentinel), which the child gets afresh. While a start pickles, :func:`pickling_for` names
the process it is for (pipe ends sent to a child are held in its name).
"""
from __future__ import annotations

import threading
from typing import Any, Dict, Iterable, List, Optional, Tuple

from . import backends
from .transport.serialize import SerializationError, dumps, serialization_error

# The process a pickling of Connections is for: pipe ends sent to a child are held in its name.
_pickling_for = threading.local()


def pickling_for() -> Optional[str]:
    """The session uid of the process whose start() is pickling right now, if any."""
    return getattr(_pickling_for, "uid", None)


class Payload:
    """The pickling of a Process for its child (a mixin of :class:`roving.process.Process`, whose
    attributes it reads: declared here, set by ``Process.__init__``)."""

    _uid: Optional[str]
    _name: str
    _target: Any
    _args: Tuple[Any, ...]
    _kwargs: Dict[str, Any]
    _job: Optional[backends.Job]
    _backend: Optional[backends.Backend]
    _sentinel: Optional[int]
    _finishing: threading.Lock

    def _pickle_self(self) -> List[Any]:
        _pickling_for.uid = self._uid
        try:
            try:
                return dumps(self)
            except SerializationError:
                for what, obj in self._parts():
                    try:
                        dumps(obj)
                    except SerializationError as exc:
                        original = exc.__cause__ or exc
                        raise serialization_error(
                            f"{self._name}: {what} cannot be pickled, so it cannot be sent to the child "
                            f"process ({original})", original) from exc.__cause__
                raise
        finally:
            _pickling_for.uid = None

    def _parts(self) -> Iterable[Any]:
        yield "the target", self._target
        for i, arg in enumerate(self._args):
            yield f"argument {i} ({type(arg).__qualname__})", arg
        for key, arg in self._kwargs.items():
            yield f"keyword argument {key!r} ({type(arg).__qualname__})", arg
        for key, value in self.__dict__.items():
            if key not in ("_target", "_args", "_kwargs"):
                yield f"attribute {key!r}", value

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        for key in ("_job", "_backend", "_sentinel", "_payload_box", "_boot", "_sentinel_finalizer", "_finishing"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._job = self._backend = self._sentinel = None
        self._finishing = threading.Lock()

