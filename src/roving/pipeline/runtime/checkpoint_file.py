"""Reading and writing checkpoint files without running code from them.

A checkpoint written by `roving pipeline train` holds only tensors, dicts, lists, tuples, numbers,
strings, booleans and None: :func:`save` turns anything else that slips in (numpy scalars from a
metric, say) into those, and :func:`read` loads with ``torch.load(weights_only=True)``, which refuses
every other type instead of importing and calling it. So a file someone else put in a checkpoint's
place cannot run code in `pipeline train --resume`, `eval` or `generate`; it is refused with a
CheckpointFileError naming the file and the type.

:func:`load_checkpoint` is the one way in for a checkpoint `roving pipeline train` wrote: it reads
it so and checks what evaluation, generation and `--resume` rely on before any of them uses it.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...system.private import create_private
from ..errors import CheckpointFileError

__all__ = ["CheckpointFileError", "ResumeInto", "load_checkpoint", "read", "save", "plain"]

_REFUSED = re.compile(r"GLOBAL ([\w.]+)")


#: what every checkpoint `roving pipeline train` writes holds, and what of its training config
#: evaluation needs.
CHECKPOINT_KEYS = ("model", "model_config", "config")
CONFIG_KEYS = ("stages", "seq_len", "samples", "corpus", "val_fraction", "eval_batches")


@dataclass(frozen=True)
class ResumeInto:
    """The run a checkpoint is to be resumed into: its model (``LlamaConfig``'s fields), its number of
    stages and of iterations."""

    model_config: dict
    stages: int
    iterations: int


def load_checkpoint(path: str | Path, map_location: str = "cpu", *, into: ResumeInto | None = None) -> dict:
    """The contents of the checkpoint `roving pipeline train --checkpoint` wrote at ``path``, read
    with :func:`read` and checked: a file (not a folder) that is a dict holding the whole model's
    weights, its model config and the training config (with the fields evaluation needs). With
    ``into``, also that the run can be resumed from it: it holds each stage's weights and optimizer
    state (format 2), the same model split into as many stages, and fewer iterations than the run's.

    Raises CheckpointFileError naming the file and what is wrong (with ``into``, the message says it
    cannot be resumed). Nothing in a refused file is run.
    """
    path = Path(path)
    try:
        state = _contents(path, map_location, per_stage=into is not None)
    except CheckpointFileError as exc:
        if into is None:
            raise
        raise CheckpointFileError(f"cannot resume: {exc}") from None
    if into is not None:
        if state["model_config"] != into.model_config:
            raise CheckpointFileError(f"cannot resume from {path}: it holds another model "
                                      f"({state['model_config']})")
        stages = state["config"]["stages"]
        if stages != into.stages:
            raise CheckpointFileError(f"cannot resume from {path}: it splits the model into {stages} stages, "
                                      f"this run into {into.stages}")
        if state["iteration"] >= into.iterations:
            raise CheckpointFileError(f"nothing to resume: {path} is at iteration {state['iteration']} of "
                                      f"{into.iterations}")
    return state


def _contents(path: Path, map_location: str, per_stage: bool) -> dict:
    """The checkpoint at ``path`` if it is one `pipeline train` wrote (``per_stage``: with each stage's
    weights and optimizer state)."""
    if path.is_dir():
        raise CheckpointFileError(f"checkpoint {path} is a folder: give the checkpoint file `roving pipeline "
                                  "train --checkpoint PATH` wrote")
    try:
        state = read(path, map_location=map_location)
    except FileNotFoundError:
        raise CheckpointFileError(f"checkpoint {path} does not exist (write one with `roving pipeline train "
                                  "--checkpoint PATH`)") from None
    if not isinstance(state, dict):
        raise CheckpointFileError(f"{path} is not a roving checkpoint: it holds a {type(state).__name__}, "
                                  "not a dict")
    if per_stage and (state.get("format") != 2 or "stages" not in state or "iteration" not in state):
        raise CheckpointFileError(f"{path} has no per-stage optimizer state (written by an older roving, or "
                                  "not by `roving pipeline train`)")
    missing = [k for k in CHECKPOINT_KEYS if k not in state]
    if missing:
        raise CheckpointFileError(f"{path} lacks key(s) {', '.join(missing)}: not a checkpoint written by "
                                  "`roving pipeline train`")
    lacking = [k for k in CONFIG_KEYS if not isinstance(state["config"], dict) or k not in state["config"]]
    if lacking:
        raise CheckpointFileError(f"{path}: its training config lacks {', '.join(lacking)}")
    return state


#: The first torch whose ``weights_only=True`` loader does not run code from a crafted file (CVE-2025-32434).
_SAFE_TORCH = (2, 6)


def _release(version: str) -> tuple:
    """(major, minor) of a torch version string such as "2.6.0+cpu"."""
    parts = re.findall(r"\d+", version)[:2]
    return tuple(int(p) for p in parts) if len(parts) == 2 else (0, 0)


def read(path: str | Path, map_location: str = "cpu") -> Any:
    """The contents of the checkpoint at ``path``, loaded with ``weights_only=True``.

    Raises FileNotFoundError when there is no such file, CheckpointFileError (naming the file, and the
    refused type when there is one) when torch cannot read it or it holds anything but tensors and
    plain data, and CheckpointFileError on torch older than 2.6, whose loader a crafted file can make
    run code (CVE-2025-32434). Nothing in a refused file is run.
    """
    if _release(torch.__version__) < _SAFE_TORCH:
        raise CheckpointFileError(
            f"refusing to read {path} with torch {torch.__version__}: before torch 2.6, "
            "torch.load(weights_only=True) can be made to run code by a crafted file (CVE-2025-32434); "
            "install torch>=2.6")
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
            return kind(obj)  # type: ignore[arg-type]  # obj is a `kind`; mypy tries each kind with each type
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
    tmp = path.with_name(path.name + ".tmp")
    with create_private(str(tmp)) as f:  # its folder made (0700) if need be; no link followed; 0600
        torch.save(plain(state), f)
    tmp.replace(path)

