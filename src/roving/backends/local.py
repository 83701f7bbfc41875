"""The local backend: each job is a subprocess of this one, running a fresh Python interpreter."""
from __future__ import annotations

import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, IO, Optional

from .base import Backend, Job, JobSpec, JobState, JobStatus, UnknownJobError
from .output import open_private

log = logging.getLogger(__name__)


class _OutputPump:
    """One thread that copies every child's output to this process's terminal, a prefix on each line."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._pending: list = []
        self._thread = threading.Thread(target=self._run, name="roving-output", daemon=True)
        self._thread.start()

    def add(self, stream: IO[bytes], prefix: str, to_stderr: bool) -> None:
        with self._lock:
            self._pending.append((stream, prefix, to_stderr))
        os.write(self._wake_w, b"x")

    def _run(self) -> None:
        """Copy output until the process ends. A stream that cannot be read is closed (with a warning)
        and the others go on: a child whose output nobody reads would block once its pipe is full."""
        partial: Dict[int, bytes] = {}
        while True:
            try:
                events = self._selector.select()
            except OSError as exc:
                log.warning("roving: copying children's output: %s", exc)
                time.sleep(0.05)
                continue
            for key, _ in events:
                if key.data is None:
                    self._take_pending()
                    continue
                try:
                    self._copy(key, partial)
                except Exception as exc:
                    log.warning("roving: stopped copying the output of %s: %s", key.data[0].strip(), exc)
                    self._stop_watching(key.fileobj)

    def _take_pending(self) -> None:
        os.read(self._wake_r, 4096)  # select() found it readable
        with self._lock:
            pending, self._pending = self._pending, []
        for stream, prefix, to_stderr in pending:
            try:
                self._selector.register(stream, selectors.EVENT_READ, (prefix, to_stderr))
            except (ValueError, KeyError, OSError) as exc:  # closed already
                log.warning("roving: cannot copy the output of %s: %s", prefix.strip(), exc)

    def _copy(self, key: selectors.SelectorKey, partial: Dict[int, bytes]) -> None:
        stream, (prefix, to_stderr) = key.fileobj, key.data
        fd = stream.fileno()
        chunk = os.read(fd, 65536)
        data = partial.pop(fd, b"") + chunk
        lines = data.split(b"\n")
        if chunk:
            if lines[-1]:
                partial[fd] = lines[-1]
            lines = lines[:-1]
        else:  # end of output: flush what is left, stop watching
            self._stop_watching(stream)
            lines = [line for line in lines if line]
        if lines:
            self._write(prefix, lines, to_stderr)

    def _stop_watching(self, stream: IO[bytes]) -> None:
        try:
            self._selector.unregister(stream)
        except (KeyError, ValueError):
            pass
        try:
            stream.close()
        except OSError:
            pass

    @staticmethod
    def _write(prefix: str, lines: list, to_stderr: bool) -> None:
        out = sys.stderr if to_stderr else sys.stdout
        text = "".join(f"{prefix}{line.decode(errors='replace')}\n" for line in lines)
        try:
            out.write(text)
            out.flush()
        except (ValueError, OSError):  # the parent's stream was closed (interpreter shutdown)
            pass


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
        self._pump: Optional[_OutputPump] = None
        self._lock = threading.Lock()

    def create_job(self, spec: JobSpec) -> Job:
        env = dict(spec.env)
        stdout = stderr = None
        log_file = None
        if spec.output == "prefix":
            stdout = stderr = subprocess.PIPE
            env.setdefault("PYTHONUNBUFFERED", "1")
        elif spec.output == "off":
            stdout = stderr = subprocess.DEVNULL
        elif spec.output == "files":
            log_file = open_private(spec.log_path)
            stdout, stderr = log_file, subprocess.STDOUT
        try:
            proc = subprocess.Popen(spec.command, env=env, cwd=spec.cwd, stdin=subprocess.DEVNULL,
                                    stdout=stdout, stderr=stderr, close_fds=True)
        finally:
            if log_file is not None:
                log_file.close()
        if spec.output == "prefix":
            with self._lock:
                if self._pump is None:
                    self._pump = _OutputPump()
            prefix = f"[{spec.name}] "
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
