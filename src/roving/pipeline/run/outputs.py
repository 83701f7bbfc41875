"""Output paths of the pipeline commands, checked before any work starts: a search or a training run
must not end by failing to write its result."""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import PlanError


def check_output(path: str, option: str, *, make_parents: bool = False, folder: bool = False) -> None:
    """Raise PlanError naming ``option`` and ``path`` unless a file (``folder``: a folder) can be written
    there: not an existing folder (a file), its folder existing and writable, or, with
    ``make_parents``, the nearest existing ancestor a writable folder (the command makes the rest)."""
    target = Path(path)
    if target.exists():
        if folder != target.is_dir():
            raise PlanError(f"{option} {path}: is {'a file' if folder else 'a folder'}, "
                            f"not {'a folder' if folder else 'a file'}")
        if not os.access(target, os.W_OK):
            raise PlanError(f"{option} {path}: not writable")
        return
    parent = target.absolute().parent
    if not make_parents and not parent.exists():
        raise PlanError(f"{option} {path}: folder {parent} does not exist")
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise PlanError(f"{option} {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PlanError(f"{option} {path}: folder {parent} is not writable")
