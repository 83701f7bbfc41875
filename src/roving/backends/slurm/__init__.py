"""The Slurm backend, a folder of its own: :class:`SlurmBackend` (``backend.py``: sbatch jobs and job
arrays outside an allocation, the jobs' state, output and cancelling), the job arrays' batch scripts
(``job_array.py``) and the srun steps inside an allocation (``step.py``). Nothing outside this folder
imports its modules but through :func:`roving.backends.get` and the names below."""
from __future__ import annotations

from ..errors import SlurmError, StepError
from .backend import SlurmBackend

__all__ = ["SlurmBackend", "SlurmError", "StepError"]
