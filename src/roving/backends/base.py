"""The small interface every backend implements, and the plain data it speaks in."""
from __future__ import annotations

import abc
import dataclasses
import enum
import os
import threading
import time
from typing import Dict, List, Optional


@dataclasses.dataclass(frozen=True)
class Resources:
    """What one job asks the cluster for."""

    cpu: float = 1
    memory: Optional[int] = None  # bytes
    gpu: int = 0


@dataclasses.dataclass
class JobSpec:
    """Everything a backend needs to start one roving process."""

    name: str
    command: List[str]
    env: Dict[str, str]
    cwd: str
    resources: Resources = dataclasses.field(default_factory=Resources)
    #: "prefix", "off" or "files" (see :class:`roving.config.Config`).
    output: str = "prefix"
    log_path: Optional[str] = None


class JobState(enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    EXITED = "exited"


@dataclasses.dataclass(frozen=True)
class JobStatus:
    state: JobState
    exitcode: Optional[int] = None
    #: Why a job is pending or how it ended, in the cluster's words, when it says.
    reason: str = ""


class Job:
    """A backend's handle on one job; ``id`` is the cluster's name for it."""

    def __init__(self, backend: "Backend", job_id: str) -> None:
        self.backend = backend
        self.id = job_id

    def __repr__(self) -> str:
        return f"<Job {self.backend.name}:{self.id}>"


class Backend(abc.ABC):
    name = "base"

    @abc.abstractmethod
    def create_job(self, spec: JobSpec) -> Job:
        """Submit the job; returns at once (it may still be pending). Raises OSError if refused."""

    @abc.abstractmethod
    def job_status(self, job: Job) -> JobStatus:
        """The job's state now."""

    @abc.abstractmethod
    def terminate_job(self, job: Job, force: bool = False) -> None:
        """Ask the job to stop (SIGTERM), or stop it at once (``force``: SIGKILL). Idempotent."""

    def logs(self, job: Job) -> str:
        """What the job wrote, when the backend keeps it."""
        return ""

    def pid(self, job: Job) -> Optional[int]:
        """The job's process id where that means something to this machine."""
        return None

    def cpu_count(self) -> int:
        return os.cpu_count() or 1

    def wait(self, job: Job, timeout: Optional[float] = None) -> Optional[int]:
        """Block until the job ends or ``timeout`` passes; the exit code, or None if still running."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.01
        while True:
            status = self.job_status(job)
            if status.state is JobState.EXITED:
                return status.exitcode
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(delay if deadline is None else max(0.0, min(delay, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)

    def sentinel(self, job: Job) -> int:
        """A file descriptor that becomes readable when the job ends. The caller closes it."""
        read_fd, write_fd = os.pipe()

        def watch() -> None:
            self.wait(job)
            os.close(write_fd)

        threading.Thread(target=watch, name=f"roving-watch-{job.id}", daemon=True).start()
        return read_fd
