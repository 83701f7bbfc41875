"""The shape of a pool's workers: the resources (cpu, memory, gpu) each worker's job asks for.

A pool given ``resources=`` keeps that shape; one without takes what a task function declares with
:func:`meta`, and what neither says comes from the configuration. :func:`covers` decides whether the
workers a pool has can run a function.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from .. import config as _config
from ..backends import Resources

__all__ = ["meta", "resources", "covers", "meta_of"]

_RESOURCE_KEYS = ("cpu", "memory", "gpu")


def meta(*, cpu: Optional[float] = None, memory: Optional[Any] = None,
         gpu: Optional[int] = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare what a worker running the decorated function needs: ``cpu``, ``memory`` (a size with
    its unit: ``"512M"``, ``"1G"``, ``"1.5GiB"``; binary units K, M, G, T), ``gpu``. A pool it is given
    to asks the backend for workers of that shape (see :class:`Pool`); what is left out comes from the
    configuration. ValueError for a bad value, and for a memory without a unit (``memory=1000``: bytes
    to some, megabytes to others), which must say which it means."""
    if memory is not None and _bare_number(memory):
        number = str(memory).strip()
        raise ValueError(f"roving.meta(): memory={memory!r} has no unit: write it with one, "
                         f"memory=\"{number}M\" for megabytes (what some libraries take a bare number for), "
                         f"\"{number}G\", \"{number}K\"; units K, M, G, T (binary: 1M is 2**20 bytes)")
    want = resources({"cpu": cpu, "memory": memory, "gpu": gpu}, "roving.meta()")

    def mark(func: Callable[..., Any]) -> Callable[..., Any]:
        setattr(func, "__roving_meta__", want)  # noqa: B010  (a function's attribute: no type says it has one)
        return func

    return mark


def _bare_number(value: Any) -> bool:
    """Whether ``value`` is a number with no unit (``1000``, ``1.5``, ``"1000"``)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return True
    try:
        float(str(value).strip())
    except ValueError:
        return False
    return True


def resources(given: Any, where: str) -> Dict[str, Any]:
    """Checked resource overrides (a dict or a :class:`Resources`), without the ones left out (None).
    ValueError naming ``where`` for an unknown key or a bad value."""
    if isinstance(given, Resources):
        given = {"cpu": given.cpu, "memory": given.memory, "gpu": given.gpu}
    unknown = set(given) - set(_RESOURCE_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown resources {sorted(unknown)}; use cpu, memory, gpu")
    out = {k: v for k, v in given.items() if v is not None}
    try:
        if "cpu" in out and not float(out["cpu"]) > 0:
            raise ValueError("cpu must be positive")
        if "memory" in out:
            _config.parse_memory(out["memory"])
        if "gpu" in out and (int(out["gpu"]) != out["gpu"] or out["gpu"] < 0):
            raise ValueError("gpu must be a whole number, 0 or more")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: bad resources {given!r}: {exc}") from None
    return out


def covers(have: Dict[str, Any], need: Dict[str, Any]) -> bool:
    """Whether a worker with resources ``have`` can run a function that asks for ``need``."""
    cfg = _config.current()
    base = {"cpu": cfg.cpu, "memory": cfg.memory, "gpu": cfg.gpu}
    full = {**base, **have}
    for key, value in need.items():
        got = full[key]
        if key == "memory":  # none asked: the cluster's default, which may be less
            if got is None or _config.parse_memory(got) < _config.parse_memory(value):
                return False
        elif got < value:
            return False
    return True


def meta_of(func: Any) -> Optional[Dict[str, Any]]:
    """What ``func`` (or the function a ``functools.partial`` wraps) declared with :func:`meta`."""
    return getattr(func, "__roving_meta__", None) or getattr(getattr(func, "func", None), "__roving_meta__",
                                                           None)
