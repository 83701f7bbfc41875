"""The small interface every backend implements (:class:`Backend`, :class:`Job`), and the plain data it
speaks in (:class:`JobSpec` and what it holds, :class:`JobStatus`, :class:`JobInfo`).

A backend knows nothing of the transport: what it needs of the roving session a job belongs to comes in
the job's spec (:class:`JobSession`). Where a job's output goes is :mod:`roving.backends.output`; the
watcher that cancels a dead parent's jobs is :mod:`roving.backends.reaper`.
"""
from __future__ import annotations

import abc
import dataclasses
import enum
import os
import pwd
import threading
import time
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from .errors import UnknownJobError  # noqa: F401  (importable from here, where it was defined)


@dataclasses.dataclass(frozen=True)
class Resources:
    """What one job asks the cluster for."""

    cpu: float = 1
    memory: Optional[int] = None  # bytes
    gpu: int = 0


#: Some of a job's resources by name (``cpu``: a number, ``memory``: bytes or a size such as ``"4G"``,
#: ``gpu``: a count; None: left out), as ``Process(resources=...)`` takes them.
ResourceMapping = Mapping[str, Union[int, float, str, None]]
#: What ``Pool(resources=...)`` takes: a :class:`Resources`, or some of its fields by name.
ResourceRequest = Union[Resources, ResourceMapping]


@dataclasses.dataclass(frozen=True)
class JobSession:
    """What a backend needs to know of the roving session that starts a job."""

    #: A short public name of the session, the same in all its processes: job names and labels carry it.
    tag: str
    #: The variable of the job's environment that holds the session secret (hex), when it holds one. A
    #: backend whose jobs run on other machines moves the secret out of the environment (into a file, a
    #: Kubernetes Secret) and gives the job it under this name or :attr:`secret_file_env`.
    secret_env: str
    #: The variable that tells a job the path of a file holding the secret instead.
    secret_file_env: str


@dataclasses.dataclass
class JobSpec:
    """Everything a backend needs to start one roving process."""

    name: str
    command: List[str]
    env: Dict[str, str]
    cwd: str
    session: JobSession
    resources: Resources = dataclasses.field(default_factory=Resources)
    #: "prefix", "off" or "files" (see :class:`roving.config.Config`).
    output: str = "prefix"
    log_path: Optional[str] = None

    def log_file(self) -> str:
        """The file ``output="files"`` appends to; ValueError naming the job when it has none."""
        if not self.log_path:
            raise ValueError(f"job {self.name}: output='files' needs a log_path")
        return self.log_path


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
    #: The job ended because it ran out of memory, as its cluster recognised it: its memory cgroup's OOM
    #: kill (local, with ``memory`` set), Slurm's ``OUT_OF_MEMORY``, Docker's ``OOMKilled``, a pod's
    #: ``OOMKilled`` reason.
    out_of_memory: bool = False
    #: The largest memory the job used, in bytes, where its cluster kept it once it ended (a local job's
    #: memory cgroup); None elsewhere.
    memory_peak: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class JobInfo:
    """One line of `roving ps`: a job of some roving session, as the cluster lists it."""

    id: str
    name: str
    session: str
    state: str
    reason: str = ""
    #: The user who started it, where the cluster says.
    user: str = ""


def user_name() -> str:
    """This process's user, from its uid (not from the environment): the jobs it started carry it, and
    `roving cancel --all` touches only jobs that carry it (on Docker and Kubernetes, where anyone can
    label a job with any name, only those that carry its :func:`owner_label`)."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:  # a uid without a name (a container's, say)
        return f"uid{os.getuid()}"


class Job:
    """A backend's handle on one job; ``id`` is the cluster's name for it."""

    def __init__(self, backend: "Backend", job_id: str) -> None:
        self.backend = backend
        self.id = job_id

    def __repr__(self) -> str:
        return f"<Job {self.backend.name}:{self.id}>"


class Backend(abc.ABC):
    """The plug-in interface of a cluster backend.

    A new backend implements four methods, as a submitit executor does: :meth:`create_job`,
    :meth:`job_status`, :meth:`terminate_job` and :meth:`logs`, and sets :attr:`name`; it is then
    usable by every layer above (a Process, a Pool) as it is. Everything else has a default built on
    those four, which a backend overrides only where its cluster does better or knows more:

    * doing better: :meth:`submit_many` (one call for a pool's workers), :meth:`wait` and
      :meth:`sentinel` (without polling :meth:`job_status`), :meth:`cancel_ids`, :meth:`unknown_ids`;
    * knowing more: :meth:`list_jobs` and :meth:`describe` (`roving ps`, `roving info`),
      :meth:`cpu_count`, :meth:`towards`, :meth:`shares_filesystem`, :meth:`pid`, :meth:`start_window`;
    * its own upkeep: :meth:`shutdown` (at exit), :meth:`forget` (a job closed).

    A backend knows nothing of the transport; what it raises of its own is a :class:`.errors.BackendError`.
    """

    #: The backend's name, as the ``backend`` option spells it.
    name = "base"

    @abc.abstractmethod
    def create_job(self, spec: JobSpec) -> Job:
        """Submit the job; returns at once (it may still be pending). Raises OSError if refused."""

    def submit_many(self, specs: Sequence[JobSpec]) -> List[Union[Job, Exception]]:
        """Submit several jobs at once (a pool's workers); one entry per spec, in order: its Job, or the
        exception (OSError when refused) that kept it from starting. Returns once every job was accepted
        or refused. This default submits them one after another; a backend that can do better overrides
        it (Slurm: one job array; Docker and Kubernetes: several creations in flight at once)."""
        out: List[Union[Job, Exception]] = []
        for spec in specs:
            try:
                out.append(self.create_job(spec))
            except Exception as exc:
                out.append(exc)
        return out

    @abc.abstractmethod
    def job_status(self, job: Job) -> JobStatus:
        """The job's state now."""

    @abc.abstractmethod
    def terminate_job(self, job: Job, force: bool = False) -> None:
        """Ask the job to stop (SIGTERM), or stop it at once (``force``: SIGKILL). Idempotent."""

    def shares_filesystem(self) -> bool:
        """Whether this backend's jobs see this machine's files at the same paths (the program's own
        modules, its working directory). True unless a backend knows otherwise; on a cluster without a
        shared filesystem, set ``ship_code="always"``."""
        return True

    @abc.abstractmethod
    def logs(self, job: Job) -> str:
        """What the job wrote, when the backend keeps it ("" when it keeps nothing). Raises
        :class:`UnknownJobError` when no job of that id is known."""

    def pid(self, job: Job) -> Optional[int]:
        """The job's process id where that means something to this machine."""
        return None

    def cpu_count(self) -> int:
        return os.cpu_count() or 1

    def start_window(self) -> Optional[int]:
        """How many of a pool's workers may be starting (submitted, not yet connected) at once, or None
        for no bound: what the machines that start them can bear. None by default: a cluster's scheduler
        paces its own starts (and a pool submits its workers as one job array where it can)."""
        return None

    def job(self, job_id: str) -> Job:
        """A handle on an existing job from its id (as `roving ps` shows it)."""
        return Job(self, job_id)

    def list_jobs(self, user: Optional[str] = None) -> List[JobInfo]:
        """The jobs of every roving session this backend can see (`roving ps`); only ``user``'s when
        given (`roving cancel --all`)."""
        return []

    def describe(self) -> Dict[str, str]:
        """What the backend sees of its cluster, for `roving info`."""
        return {"cpus": str(self.cpu_count())}

    def towards(self) -> Optional[Tuple[str, str]]:
        """A host on the side of the machines this backend's jobs run on, as (address or name, what it
        is), or None when they all run on this machine. A process that starts jobs binds the interface
        that routes there (roving.transport.addressing)."""
        return None

    def unknown_ids(self, job_ids: Iterable[str]) -> List[str]:
        """Those of ``job_ids`` that name no job :meth:`list_jobs` lists (what `roving cancel` refuses)."""
        known = {j.id for j in self.list_jobs()}
        return [i for i in job_ids if i not in known]

    def cancel_ids(self, job_ids: Iterable[str]) -> None:
        """Stop and remove these jobs, whoever started them; ids already gone are ignored."""
        for job_id in job_ids:
            try:
                self.terminate_job(self.job(job_id), force=True)
            except Exception:
                pass

    def shutdown(self) -> None:
        """At this process's exit: cancel the jobs it started that are still there."""

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

    def forget(self, job: Job) -> None:
        """Drop what this backend keeps about a job that has ended and whose Process was closed."""

    def sentinel(self, job: Job) -> int:
        """A file descriptor that becomes readable when the job ends. The caller closes it."""
        read_fd, write_fd = os.pipe()

        def watch() -> None:
            self.wait(job)
            os.close(write_fd)

        threading.Thread(target=watch, name=f"roving-watch-{job.id}", daemon=True).start()
        return read_fd
