"""The backends' errors: one base, :class:`BackendError`, an :class:`OSError` (a cluster that refuses or
cannot be reached is the operating system's kind of failure, as a failed ``fork`` is), and one kind per
backend. Each message says what was asked and has the cluster's own words; each kind is importable from
its backend's module too (``roving.backends.slurm.SlurmError``)."""
from __future__ import annotations

from ..errors import NotPrivateError, RovingError

__all__ = ["BackendError", "UnknownJobError", "LocalError", "SlurmError", "StepError", "DockerError",
           "KubernetesError", "NotPrivateError"]


class BackendError(RovingError, OSError):
    """A backend could not do what was asked of it; the message names the job and the cluster's words."""


class UnknownJobError(BackendError, LookupError):
    """No job of that id is known to the backend (`roving logs`, `roving cancel`); the message names it.
    Also a :class:`LookupError`, as it was before the backends had one base."""


class LocalError(BackendError):
    """A local job could not be started (its command is not there, or not executable)."""


class StarterError(LocalError):
    """The local backend's starter (``local_preload``) could not be started, could not import what it
    preloads (the message names the modules and the error), or went away."""


class SlurmError(BackendError):
    """Slurm refused or could not be asked; the message has Slurm's own words."""


class StepError(SlurmError):
    """A step inside an allocation cannot be started: it does not fit the allocation, or srun refused (its
    words)."""


class DockerError(BackendError):
    """The Docker engine refused or could not be reached; the message has the engine's words."""


class KubernetesError(BackendError):
    """The Kubernetes API refused or could not be reached; the message has its words."""
