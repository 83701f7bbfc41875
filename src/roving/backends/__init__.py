"""Cluster backends: each turns a :class:`~roving.backends.base.JobSpec` into a running job.

Nothing above this layer imports a backend module directly; it asks :func:`get` for the configured one.
``local`` runs jobs as subprocesses; ``slurm`` as Slurm jobs (sbatch, or srun steps inside an
allocation); ``docker`` as containers; ``kubernetes`` as pods. :func:`detect` picks one when the
``backend`` option is ``auto`` (installed into roving.config as its detector when this package is
imported). Backends sit below the transport: they import only roving.config, and what they need of a
job's session comes in its spec.
"""
from __future__ import annotations

import atexit
import os
import threading
from typing import Dict, Optional, Tuple

from .. import config as _config
from .base import (Backend, Job, JobInfo, JobSession, JobSpec, JobState, JobStatus, ResourceMapping, ResourceRequest,
                   Resources, user_name)
# imported with the package, so that its exit handler runs after roving.process's (see the module)
from . import secret_files  # noqa: F401
from .errors import (BackendError, DockerError, KubernetesError, LocalError, SlurmError, StarterError, StepError,
                     UnknownJobError)

__all__ = ["Backend", "Job", "JobInfo", "JobSession", "JobSpec", "JobState", "JobStatus", "Resources",
           "ResourceMapping", "ResourceRequest",
           "BackendError", "UnknownJobError", "LocalError", "StarterError", "SlurmError", "StepError", "DockerError",
           "KubernetesError", "get", "detect", "towards", "user_name", "NAMES"]

NAMES = ("local", "slurm", "docker", "kubernetes")
_instances: Dict[str, Backend] = {}
_lock = threading.Lock()

_SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


def detect() -> Tuple[str, str]:
    """The backend this process should use when none is configured, and why.

    Only unambiguous signs count: a Slurm allocation's SLURM_JOB_ID, or a Kubernetes pod's service
    environment and account. Anything else is ``local``.
    """
    if os.environ.get("SLURM_JOB_ID"):
        return "slurm", f"inside Slurm allocation {os.environ['SLURM_JOB_ID']} (SLURM_JOB_ID is set)"
    if os.environ.get("KUBERNETES_SERVICE_HOST") and os.path.isdir(_SERVICE_ACCOUNT):
        return "kubernetes", "inside a Kubernetes pod (KUBERNETES_SERVICE_HOST and a service account)"
    return "local", "no Slurm allocation or Kubernetes pod around this process"


def get(name: str) -> Backend:
    """The backend called ``name``; one instance per process. ValueError for an unknown name."""
    with _lock:
        backend = _instances.get(name)
        if backend is None:
            cls: type[Backend]
            if name == "local":
                from .local import LocalBackend as cls
            elif name == "slurm":
                from .slurm import SlurmBackend as cls
            elif name == "docker":
                from .docker import DockerBackend as cls
            elif name == "kubernetes":
                from .kubernetes import KubernetesBackend as cls
            else:
                raise ValueError(f"unknown roving backend {name!r}; available: {', '.join(NAMES)}")
            backend = cls()
            _instances[name] = backend
        return backend


def towards(cfg: Optional[_config.Config]) -> Optional[Tuple[str, str]]:
    """Towards which host the jobs of ``cfg.backend`` run, seen from here; None: on this machine
    (roving.transport.addressing binds the interface that routes there)."""
    if cfg is None or cfg.backend == "local":
        return None
    return get(cfg.backend).towards()


_config.set_backend_detector(lambda: detect()[0])


def _shutdown() -> None:
    """At exit: every backend cancels the jobs this process started that are still there.

    Registered when this package is first imported, which is before roving.process registers its own
    exit handler; handlers run in reverse, so children are joined as multiprocessing does first, and
    only what is left is cancelled here.
    """
    for backend in list(_instances.values()):
        try:
            backend.shutdown()
        except Exception:  # never let one backend stop the others
            pass


atexit.register(_shutdown)
