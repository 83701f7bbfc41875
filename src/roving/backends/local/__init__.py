"""The local backend, a folder of its own: :class:`LocalBackend` (``backend.py``: each job a subprocess
of this one) and its starter (``starter.py``: children forked from a process that imported
``local_preload`` once). Nothing outside this folder imports its modules but through
:func:`roving.backends.get` and the names below."""
from __future__ import annotations

from ..errors import LocalError, StarterError
from .backend import LocalBackend

__all__ = ["LocalBackend", "LocalError", "StarterError"]
