"""The small interface every backend implements, and the plain data it speaks in."""
from __future__ import annotations

import abc
import dataclasses
import enum
import hashlib
import json
import os
import pwd
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Tuple


class UnknownJobError(LookupError):
    """No job of that id is known to the backend (`roving logs`, `roving cancel`); the message names it."""


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


def session_tag() -> str:
    """A short name for this process's roving session, the same in every process of it.

    Derived from the session secret by a one-way hash, so that it can be shown in job names and labels.
    """
    from ..transport import session as _session

    return hashlib.sha256(b"roving-session:" + _session.current().secret).hexdigest()[:12]


def user_name() -> str:
    """This process's user, from its uid (not from the environment): the jobs it started carry it, and
    `roving cancel --all` touches only jobs that carry it."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:  # a uid without a name (a container's, say)
        return f"uid{os.getuid()}"


def private_dir(path: str) -> None:
    """Make ``path`` and its missing parents, each readable by this user only (0700); folders that
    exist already are left as they are."""
    path = os.path.abspath(path)
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
        os.chmod(folder, 0o700)  # mkdir's mode is cut by the umask


def open_private(path: str, mode: str = "ab"):
    """Open ``path`` for appending (binary with ``"ab"``, text with ``"a"``), creating it readable by
    this user only (0600), in a folder made by :func:`private_dir`."""
    private_dir(os.path.dirname(os.path.abspath(path)))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0), 0o600)
    return os.fdopen(fd, mode)


def container_env(env: Mapping[str, str], forward: Iterable[str]) -> Tuple[Dict[str, str], str]:
    """What of a job's environment a container or pod may see, and the session secret (hex) apart.

    A container is another machine: it gets what roving needs (ROVING_CHILD without the secret,
    PYTHONPATH, PYTHONUNBUFFERED, the ROVING_<option> variables) and the variables ``forward`` names
    (the ``forward_env`` option), never the rest of the parent's environment. The secret must reach
    it another way (a file, a Kubernetes Secret); it is "" when ``env`` holds none.
    """
    from ..transport import session as _session

    wanted = set(forward)
    out = {k: v for k, v in env.items()
           if k in wanted or k in ("PYTHONPATH", "PYTHONUNBUFFERED", _session.CHILD_ENV)
           or (k.startswith("ROVING_") and k not in (_session.SECRET_ENV, _session.SECRET_FILE_ENV))}
    secret = ""
    if _session.CHILD_ENV in out:
        info = json.loads(out[_session.CHILD_ENV])
        secret = info.pop("secret", None) or ""
        out[_session.CHILD_ENV] = json.dumps(info)
    out.setdefault("PYTHONUNBUFFERED", "1")
    return out, secret


def write_prefixed(prefix: str, lines: Iterable[bytes], to_stderr: bool = False) -> None:
    """Write a child's output lines to this process's terminal, ``prefix`` before each."""
    out = sys.stderr if to_stderr else sys.stdout
    text = "".join(f"{prefix}{line.decode(errors='replace')}\n" for line in lines)
    if not text:
        return
    try:
        out.write(text)
        out.flush()
    except (ValueError, OSError):  # the parent's stream was closed (interpreter shutdown)
        pass


class LineSplitter:
    """Turns chunks of output into whole lines for :func:`write_prefixed`; with ``keep``, only the lines
    for which ``keep(line)`` is true are written."""

    def __init__(self, prefix: str, to_stderr: bool = False,
                 keep: Optional[Callable[[bytes], bool]] = None) -> None:
        self.prefix, self.to_stderr, self._partial, self._keep = prefix, to_stderr, b"", keep

    def _write(self, lines: List[bytes]) -> None:
        if self._keep is not None:
            lines = [line for line in lines if self._keep(line)]
        write_prefixed(self.prefix, lines, self.to_stderr)

    def feed(self, chunk: bytes) -> None:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        self._write(lines)

    def close(self) -> None:
        if self._partial:
            self._write([self._partial])
            self._partial = b""


class Reaper:
    """A small watcher process that cancels this process's jobs once this process is gone.

    It learns each job id through a pipe; the kernel closes the pipe whatever way this process ends,
    ``kill -9`` included, and the watcher then cancels every job it was told of and not told was done.
    The watcher runs in its own session so that a Ctrl-C to the terminal does not stop it first.
    """

    def __init__(self, backend_name: str) -> None:
        self._backend_name = backend_name
        self._proc: Optional[subprocess.Popen] = None
        self._lock = threading.Lock()

    def _send(self, line: str) -> None:
        with self._lock:
            if self._proc is None:
                from .. import config as _config

                env = dict(os.environ)
                env.pop("ROVING_CHILD", None)
                env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "roving.backends._reaper", self._backend_name],
                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, start_new_session=True,
                    close_fds=True)
                cfg = dataclasses.asdict(_config.current())
                self._proc.stdin.write((json.dumps(cfg) + "\n").encode())
            try:
                self._proc.stdin.write((line + "\n").encode())
                self._proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                pass

    def add(self, job_id: str) -> None:
        self._send("+" + job_id)

    def done(self, job_id: str) -> None:
        if self._proc is not None:
            self._send("-" + job_id)


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
