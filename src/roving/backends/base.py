"""The small interface every backend implements (:class:`Backend`, :class:`Job`), and the plain data it
speaks in (:class:`JobSpec` and what it holds, :class:`JobStatus`, :class:`JobInfo`).

A backend knows nothing of the transport: what it needs of the roving session a job belongs to comes in
the job's spec (:class:`JobSession`). Where a job's output goes is :mod:`roving.backends.output`; the
watcher that cancels a dead parent's jobs is :mod:`roving.backends.reaper`.
"""
from __future__ import annotations

import abc
import atexit
import dataclasses
import enum
import functools
import hashlib
import hmac
import os
import pwd
import secrets
import shutil
import tempfile
import threading
import time
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

from .errors import UnknownJobError  # noqa: F401  (importable from here, where it was defined)
from .private import create_private, private_dir, private_key
from .reaper import Reaper


@dataclasses.dataclass(frozen=True)
class Resources:
    """What one job asks the cluster for."""

    cpu: float = 1
    memory: Optional[int] = None  # bytes
    gpu: int = 0


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


#: Where this user's key for :func:`owner_label` is kept (made on first use, 0600).
OWNER_KEY_FILE = "~/.roving/owner.key"


@functools.lru_cache(maxsize=None)
def _owner_key(path: str) -> bytes:
    return private_key(path)


def owner_label(user: Optional[str] = None) -> str:
    """The ``roving.owner`` label of the containers and pods that ``user`` (default: this user)
    starts: a keyed hash (HMAC-SHA256, 32 hex digits) of the user name with this user's own key
    (:data:`OWNER_KEY_FILE`). `roving cancel --all` matches it, not the ``roving.user`` label, which
    anyone can set to any name: a job started by someone else (another machine's "alice", a
    hand-made container) does not carry it, whatever its other labels say. Only a process with this
    user's key file makes it (the label is visible to whoever can list the jobs: copying it onto a
    job of one's own makes that job cancelled by this user's --all, nothing more)."""
    key = _owner_key(os.path.expanduser(OWNER_KEY_FILE))
    name = user_name() if user is None else user
    return hmac.new(key, b"roving-owner:" + name.encode(), hashlib.sha256).hexdigest()[:32]


def container_env(spec: JobSpec, forward: Iterable[str]) -> Tuple[Dict[str, str], str]:
    """What of a job's environment a container or pod may see, and the session secret (hex) apart.

    A container is another machine: it gets what roving needs (ROVING_CHILD, PYTHONPATH,
    PYTHONUNBUFFERED, the ROVING_<option> variables) and the variables ``forward`` names (the
    ``forward_env`` option), never the rest of the parent's environment, and never the secret's variables
    (``spec.session``), even when ``forward`` names them. The secret must reach it another way (a file, a
    Kubernetes Secret); it is "" when the environment holds none.
    """
    secret_vars = (spec.session.secret_env, spec.session.secret_file_env)
    wanted = set(forward)
    out = {k: v for k, v in spec.env.items()
           if k not in secret_vars and (k in wanted or k in ("PYTHONPATH", "PYTHONUNBUFFERED")
                                        or k.startswith("ROVING_"))}
    out.setdefault("PYTHONUNBUFFERED", "1")
    return out, spec.env.get(spec.session.secret_env, "")


_secret_folders: List[str] = []
_secret_folders_lock = threading.Lock()


def _remove_secret_folders() -> None:
    """At exit: remove the folders of :class:`SecretFiles`, with the files of jobs that never ran.

    Registered when this module is first imported, before roving.process registers the handler that
    joins a program's unjoined children (handlers run in reverse), so a child started just before its
    parent's end still finds its file. Registering a handler when a folder is made would run it first,
    and such a child would die before it ran.
    """
    with _secret_folders_lock:
        folders = list(_secret_folders)
        _secret_folders.clear()
    for folder in folders:
        shutil.rmtree(folder, True)


atexit.register(_remove_secret_folders)


class SecretFiles:
    """Hands the session secret to jobs in private files, never in their environment.

    :meth:`moved` gives a copy of a job's spec whose environment no longer holds the secret
    (``spec.session.secret_env``) but names, in ``spec.session.secret_file_env``, a new file that
    does: 0600, created without following links, in a private folder (0700) made on first use under
    ``base``. So neither the job's ``/proc/PID/environ`` (the kernel's copy of the environment it
    started with, which removing the variable from ``os.environ`` does not clear) nor a cluster's
    record of the job's environment (Slurm's ``--export``) carries it. The child reads the file and
    removes it (:func:`roving.backends.private.take_private`); the files of jobs that never ran go with
    the folder at this process's exit, after its children were joined (:func:`_remove_secret_folders`), or,
    when this process is killed (SIGKILL), by ``reaper``'s watcher (:meth:`roving.backends.reaper.Reaper.folder`).
    ``base`` must be a folder the job's machine sees (a shared home for a cluster). Thread-safe.
    """

    def __init__(self, base: str, reaper: Optional[Reaper] = None) -> None:
        self._base = base
        self._reaper = reaper
        self._folder: Optional[str] = None
        self._lock = threading.Lock()

    def _made(self) -> str:
        with self._lock:
            if self._folder is None or not os.path.isdir(self._folder):
                if not os.path.isdir(self._base):
                    private_dir(self._base)  # made 0700; one that exists (/tmp) holds a folder of ours
                self._folder = tempfile.mkdtemp(prefix="roving-secrets-", dir=self._base)  # 0700
                with _secret_folders_lock:
                    _secret_folders.append(self._folder)
                if self._reaper is not None:  # named before any secret is in it
                    self._reaper.folder(self._folder)
            return self._folder

    def moved(self, spec: JobSpec) -> JobSpec:
        """``spec`` with its secret in a file (``spec`` itself when its environment holds none)."""
        secret = spec.env.get(spec.session.secret_env)
        if not secret:
            return spec
        path = os.path.join(self._made(), f"{secrets.token_hex(8)}.secret")
        with create_private(path, "w") as f:
            f.write(secret)
        env = {k: v for k, v in spec.env.items() if k != spec.session.secret_env}
        env[spec.session.secret_file_env] = path
        return dataclasses.replace(spec, env=env)


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

    def logs(self, job: Job) -> str:
        """What the job wrote, when the backend keeps it. Raises :class:`UnknownJobError` when no job of
        that id is known."""
        return ""

    def pid(self, job: Job) -> Optional[int]:
        """The job's process id where that means something to this machine."""
        return None

    def cpu_count(self) -> int:
        return os.cpu_count() or 1

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
