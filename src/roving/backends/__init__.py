"""Cluster backends: each turns a :class:`~roving.backends.base.JobSpec` into a running job.

Nothing above this layer imports a backend module directly; it asks :func:`get` for the configured one.
"""
from __future__ import annotations

import threading
from typing import Dict

from .base import Backend, Job, JobSpec, JobState, JobStatus, Resources

__all__ = ["Backend", "Job", "JobSpec", "JobState", "JobStatus", "Resources", "get"]

_instances: Dict[str, Backend] = {}
_lock = threading.Lock()


def get(name: str) -> Backend:
    """The backend called ``name``; one instance per process."""
    with _lock:
        backend = _instances.get(name)
        if backend is None:
            if name == "local":
                from .local import LocalBackend

                backend = LocalBackend()
            else:
                raise ValueError(f"unknown roving backend {name!r}; available: local")
            _instances[name] = backend
        return backend
