"""Contexts and start methods, for programs that use multiprocessing's ``get_context``.

Every roving process starts as a fresh interpreter in a job of the configured backend, so the start
method names multiprocessing accepts all mean the same here:

* ``"spawn"`` — exactly what roving does: a new interpreter that receives the Process object by pickle.
* ``"fork"`` and ``"forkserver"`` — accepted so that existing programs run unchanged, but nothing is
  inherited by forking: module globals changed at run time in the parent are not seen by the child.
  Pass what the child needs as arguments, as a spawn-safe program does.
"""
from __future__ import annotations

from typing import Any, List, Optional

_METHODS = ("spawn", "fork", "forkserver")


class Context:
    """The roving API under one start method name; ``get_context()`` returns one."""

    def __init__(self, method: str) -> None:
        self._method = method

    def get_start_method(self, allow_none: bool = False) -> str:
        return self._method

    def __getattr__(self, name: str) -> Any:  # Process, Queue, Pipe, ... come from the package
        import roving

        if name.startswith("_") or name in ("get_context", "set_start_method"):
            raise AttributeError(name)
        return getattr(roving, name)

    def get_context(self, method: Optional[str] = None) -> "Context":
        return get_context(method)

    def __repr__(self) -> str:
        return f"<roving context {self._method!r}>"


_method: Optional[str] = None


def get_context(method: Optional[str] = None) -> Context:
    """A context for ``method`` (default: the one set, else "spawn"). ValueError for unknown names."""
    if method is None:
        return Context(_method or "spawn")
    if method not in _METHODS:
        raise ValueError(f"cannot find context for {method!r}")
    return Context(method)


def set_start_method(method: Optional[str], force: bool = False) -> None:
    """Record the start method name (see the module docs for what each means with roving)."""
    global _method
    if _method is not None and not force:
        raise RuntimeError("context has already been set")
    if method is not None and method not in _METHODS:
        raise ValueError(f"cannot find context for {method!r}")
    _method = method


def get_start_method(allow_none: bool = False) -> Optional[str]:
    global _method
    if _method is None and not allow_none:
        _method = "spawn"
    return _method


def get_all_start_methods() -> List[str]:
    return list(_METHODS)
