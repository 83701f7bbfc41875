"""The local backend: each job is a subprocess of this one, running a fresh Python interpreter."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import tempfile
import threading
from typing import Any, Dict, Optional

from .base import Backend, Job, JobSpec, JobState, JobStatus, SecretFiles
from .errors import LocalError, UnknownJobError
from .output import OutputPump
from .private import open_private

log = logging.getLogger(__name__)

#: Where local children find the session secret: a private folder under the system's temporary one.
_SECRETS = SecretFiles(tempfile.gettempdir())


def _has_exited(pid: int) -> bool:
    """Whether child ``pid`` has ended (without reaping it)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # already reaped by another thread
        return True


class LocalBackend(Backend):
    """Jobs are subprocesses. ``terminate_job`` sends SIGTERM, with ``force`` SIGKILL."""

    name = "local"

    def __init__(self) -> None:
        self._procs: Dict[str, subprocess.Popen] = {}
        self._pump: Optional[OutputPump] = None
        self._lock = threading.Lock()

    def create_job(self, spec: JobSpec) -> Job:
        env = dict(_SECRETS.moved(spec).env)  # the secret in a private file, not the environment
        stdout: Any = None
        stderr: Any = None
        log_file = None
        if spec.output == "prefix":
            stdout = stderr = subprocess.PIPE
            env.setdefault("PYTHONUNBUFFERED", "1")
        elif spec.output == "off":
            stdout = stderr = subprocess.DEVNULL
        elif spec.output == "files":
            log_file = open_private(spec.log_file())
            stdout, stderr = log_file, subprocess.STDOUT
        try:
            proc = subprocess.Popen(spec.command, env=env, cwd=spec.cwd, stdin=subprocess.DEVNULL,
                                    stdout=stdout, stderr=stderr, close_fds=True)
        except OSError as exc:
            err = LocalError(f"cannot start {spec.name} ({spec.command[0]!r} in {spec.cwd!r}): {exc}")
            err.errno = exc.errno  # a caller can still tell a missing command (ENOENT) from EACCES
            raise err from exc
        finally:
            if log_file is not None:
                log_file.close()
        if spec.output == "prefix":
            with self._lock:
                if self._pump is None:
                    self._pump = OutputPump()
            prefix = f"[{spec.name}] "
            assert proc.stdout is not None and proc.stderr is not None, "started with stdout=stderr=PIPE"
            self._pump.add(proc.stdout, prefix, False)
            self._pump.add(proc.stderr, prefix, True)
        job = Job(self, str(proc.pid))
        with self._lock:
            self._procs[job.id] = proc
        return job

    def _proc(self, job: Job) -> subprocess.Popen:
        return self._procs[job.id]

    def job_status(self, job: Job) -> JobStatus:
        proc = self._proc(job)
        code = proc.poll()
        if code is None and _has_exited(proc.pid):
            # poll() answers None while another thread (the reaper) is inside wait(): that wait is
            # about to return, so wait too rather than report a finished process as running.
            code = proc.wait()
        if code is None:
            return JobStatus(JobState.RUNNING)
        return JobStatus(JobState.EXITED, code)

    def wait(self, job: Job, timeout: Optional[float] = None) -> Optional[int]:
        try:
            return self._proc(job).wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def terminate_job(self, job: Job, force: bool = False) -> None:
        proc = self._proc(job)
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGKILL if force else signal.SIGTERM)
            except ProcessLookupError:
                pass

    def logs(self, job: Job) -> str:
        """Local jobs are child processes of the program that started them, whose output goes to that
        program (or to its log files): no other process knows them."""
        if job.id not in self._procs:
            raise UnknownJobError(f"no local job {job.id}: local jobs are child processes of the program that "
                                  "started them, known to that program only")
        return ""

    def pid(self, job: Job) -> Optional[int]:
        return int(job.id)  # the job id is the pid

    def sentinel(self, job: Job) -> int:
        try:
            return os.pidfd_open(self._proc(job).pid)
        except (AttributeError, OSError):  # no pidfd on this system
            return super().sentinel(job)

    def forget(self, job: Job) -> None:
        """Drop the handle of a job that has ended and been reaped."""
        with self._lock:
            self._procs.pop(job.id, None)
