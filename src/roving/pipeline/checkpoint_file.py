"""Reading and writing checkpoint files without running code from them.

A checkpoint written by `roving pipeline train` holds only tensors, dicts, lists, tuples, numbers,
strings, booleans and None: :func:`save` turns anything else that slips in (numpy scalars from a
metric, say) into those, and :func:`read` loads with ``torch.load(weights_only=True)``, which refuses
every other type instead of importing and calling it. So a file someone else put in a checkpoint's
place cannot run code in `pipeline train --resume`, `eval` or `generate`; it is refused with a
CheckpointFileError naming the file and the type.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

__all__ = ["CheckpointFileError", "read", "save", "plain"]

_REFUSED = re.compile(r"GLOBAL ([\w.]+)")


class CheckpointFileError(ValueError):
    """A checkpoint file that cannot be read, or that holds a type a checkpoint may not hold."""


def read(path: str | Path, map_location: str = "cpu") -> Any:
    """The contents of the checkpoint at ``path``, loaded with ``weights_only=True``.

    Raises FileNotFoundError when there is no such file, CheckpointFileError (naming the file, and the
    refused type when there is one) when torch cannot read it or it holds anything but tensors and
    plain data. Nothing in a refused file is run.
    """
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as exc:  # torch raises several unrelated types for a file that is not its own
        refused = _REFUSED.search(str(exc))
        if refused:
            raise CheckpointFileError(
                f"{path} holds a {refused.group(1)}, a type a roving checkpoint never holds: refused "
                "without running it (checkpoints hold only tensors, dicts, lists, numbers and strings; "
                "load a file from elsewhere only if you trust it, with torch.load yourself)") from None
        said = " ".join(str(exc).split())
        said = said if len(said) <= 300 else said[:300] + " ..."
        raise CheckpointFileError(f"{path} is not a checkpoint torch can read ({type(exc).__name__}: "
                                  f"{said})") from None


def plain(obj: Any) -> Any:
    """``obj`` with every value turned into what :func:`read` accepts: numpy scalars and arrays to
    numbers and lists, containers rebuilt (tensors kept). Raises TypeError naming any other type."""
    if obj is None or isinstance(obj, (torch.Tensor, torch.dtype, torch.device)):
        return obj
    for kind in (bool, int, float, str, bytes):  # numpy's float64 is a float, but pickles as numpy's
        if isinstance(obj, kind):
            return kind(obj)
    if isinstance(obj, dict):
        out = {plain(k): plain(v) for k, v in obj.items()}
        if isinstance(obj, OrderedDict):  # a state_dict: keep its kind and its version metadata
            out = OrderedDict(out)
            if hasattr(obj, "_metadata"):
                out._metadata = plain(obj._metadata)  # type: ignore[attr-defined]
        return out
    if isinstance(obj, (list, tuple)):
        items = [plain(v) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    if hasattr(obj, "tolist"):  # numpy scalars and arrays
        return obj.tolist()
    raise TypeError(f"a checkpoint cannot hold a {type(obj).__module__}.{type(obj).__qualname__}")


def save(state: dict, path: str | Path) -> None:
    """Write ``state`` (made :func:`plain`) to ``path`` atomically: a reader sees the old file or the
    new one, never part of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(plain(state), tmp)
    tmp.replace(path)

