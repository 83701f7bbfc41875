"""The local backend: each job is a subprocess of this one, running a fresh Python interpreter.

A job that asks for memory (the ``memory`` option, a pool's ``resources``) runs in a memory cgroup of its
own with that limit, where this machine lets this process make one (:mod:`roving.backends.memory`; else
a warning says why, once, and the job runs unlimited); its end by the kernel's OOM killer is then
reported as ``out_of_memory`` in its :class:`JobStatus`."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any, Dict, Optional

from ... import config as roving_config
from ..base import Backend, Job, JobSpec, JobState, JobStatus
from ..errors import LocalError, UnknownJobError
from ..memory import MemoryGroup, make_group
from ..output import OutputPump
from ...system.private import open_private
from ..reaper import Reaper
from ..secret_files import SecretFiles
from .starter import CHILD_MODULE, ForkedChild, Starter, interpreter_settings

log = logging.getLogger(__name__)

#: A pool's workers starting at once, per core of this machine (``LocalBackend.start_window``): a start
#: forked from the starter costs about 30 ms of CPU in all (child and parent), so 32 per core start within
#: about a second and none waits long for its handshake.
STARTS_PER_CORE = 32
#: Seconds to wait for the starter's word of a forked child's exit code once its process has ended.
STARTER_WORD_S = 10.0


def _has_exited(pid: int) -> bool:
    """Whether child ``pid`` has ended (without reaping it)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # already reaped by another thread
        return True


class LocalBackend(Backend):
    """Jobs are subprocesses forked from a starter that has roving's child code (and ``local_preload``)
    imported (roving.backends.local.starter), or fresh interpreters (``local_start="fresh"``, or a
    command that is not this interpreter running roving's child). ``terminate_job`` sends SIGTERM, with
    ``force`` SIGKILL."""

    name = "local"

    def __init__(self) -> None:
        self._procs: Dict[str, Any] = {}  # job id -> subprocess.Popen or starter.ForkedChild
        self._pump: Optional[OutputPump] = None
        self._lock = threading.Lock()
        self._starters: Dict[tuple, Starter] = {}  # (preload, interpreter settings) -> its starter
        self._groups: Dict[str, MemoryGroup] = {}  # job id -> the memory cgroup it runs in
        self._no_group_said = False
        # Where local children find the session secret: a private folder under the system's temporary one,
        # which a watcher removes if this process is killed before it can (no jobs of its own to cancel).
        self._secrets = SecretFiles(tempfile.gettempdir(), Reaper(self.name))

    def create_job(self, spec: JobSpec) -> Job:
        env = dict(self._secrets.moved(spec).env)  # the secret in a private file, not the environment
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
            starter = self._starter_for(spec.command, env)
            proc: Any
            if starter is not None:
                proc = self._fork(starter, spec, env, stdout, stderr)
            else:
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
        group = self._group_for(spec, proc.pid)
        with self._lock:
            self._procs[job.id] = proc
            if group is not None:
                self._groups[job.id] = group
        return job

    def _group_for(self, spec: JobSpec, pid: int) -> Optional[MemoryGroup]:
        """A memory cgroup limited to ``spec``'s memory with ``pid`` in it (moved in before its Python has
        started), or None: no memory asked, or none can be made here (said once)."""
        if spec.resources.memory is None:
            return None
        group, why = make_group(spec.resources.memory, spec.name.replace("/", "-"))
        if group is not None:
            try:
                group.add(pid)
                return group
            except OSError as exc:
                group.remove()
                why = f"cannot move the job into its memory cgroup: {exc}"
        if not self._no_group_said:
            self._no_group_said = True
            log.warning("roving: the local backend runs jobs without their memory limit: %s", why)
        return None

    def start_window(self) -> Optional[int]:
        """``STARTS_PER_CORE`` per core of this machine: every start takes CPU here, the child's and the
        parent's side of its handshake; more at once only makes each slower (and, fresh interpreters by
        the hundred, their handshakes time out)."""
        return STARTS_PER_CORE * self.cpu_count()

    def _starter_for(self, command: list, env: Dict[str, str]) -> Optional[Starter]:
        """The starter that forks this command's process (made on first use), or None: started fresh
        (``local_start="fresh"`` and no ``local_preload``), or not this interpreter running roving's child."""
        cfg = roving_config.current()
        preload = cfg.local_preload
        fresh = cfg.local_start == "fresh" and not preload
        if fresh or list(command[:3]) != [sys.executable, "-m", CHILD_MODULE]:
            return None
        key = (preload, interpreter_settings(env))
        with self._lock:
            starter = self._starters.get(key)
            if starter is not None and not starter.alive:
                del self._starters[key]
                starter = None
            if starter is None:
                # the starter's environment: the interpreter's settings of the child, roving's own
                # variables of this process (never the child's secret)
                base = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "ROVING"))}
                starter = self._starters[key] = Starter(preload, {**base, **dict(key[1])})
        return starter

    def _fork(self, starter: Starter, spec: JobSpec, env: Dict[str, str], stdout: Any, stderr: Any) -> ForkedChild:
        """``spec``'s process forked by ``starter``, its streams as ``Popen``'s would be."""
        opened: list = []  # descriptors made here, closed once the starter has its copies

        def fd_for(target: Any, default: int) -> int:
            if target is None:
                return default
            if target == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                opened.append(fd)
                return fd
            return target.fileno()

        ends: Dict[str, Any] = {}
        try:
            fds = [fd_for(subprocess.DEVNULL, 0)]
            for name, target, default in (("stdout", stdout, 1), ("stderr", stderr, 2)):
                if target == subprocess.PIPE:
                    r, w = os.pipe()
                    ends[name] = os.fdopen(r, "rb")
                    opened.append(w)
                    fds.append(w)
                elif target == subprocess.STDOUT:
                    fds.append(fds[1])
                else:
                    fds.append(fd_for(target, default))
            pid = starter.start(spec.command, env, spec.cwd, (fds[0], fds[1], fds[2]))
        except BaseException:
            for f in ends.values():
                f.close()
            raise
        finally:
            for fd in opened:
                os.close(fd)
        child = ForkedChild(pid, ends.get("stdout"), ends.get("stderr"))
        starter.adopt(child)
        return child

    def close_starters(self) -> None:
        """End this backend's starters (``local_preload``), releasing what they hold in memory; the
        children they forked run on, and the next start makes a new one."""
        with self._lock:
            starters, self._starters = list(self._starters.values()), {}
        for starter in starters:
            starter.close()

    def _proc(self, job: Job) -> Any:
        return self._procs[job.id]

    def job_status(self, job: Job) -> JobStatus:
        proc = self._proc(job)
        code = proc.poll()
        if code is None and isinstance(proc, subprocess.Popen) and _has_exited(proc.pid):
            # poll() answers None while another thread (the reaper) is inside wait(): that wait is
            # about to return, so wait too rather than report a finished process as running.
            code = proc.wait()
        elif code is None and isinstance(proc, ForkedChild) and proc.exited():
            # ended (its sentinel fired) but the starter's word of its exit code is still on its way
            try:
                code = proc.wait(STARTER_WORD_S)
            except subprocess.TimeoutExpired:
                code = None
        if code is None:
            return JobStatus(JobState.RUNNING)
        group = self._groups.get(job.id)
        if group is not None and code != 0:
            peak = group.read()[2]
            if group.oom_killed():
                return JobStatus(JobState.EXITED, code, "killed by the kernel for memory (its cgroup's oom_kill)",
                                 out_of_memory=True, memory_peak=peak)
            return JobStatus(JobState.EXITED, code, memory_peak=peak)
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

    def shutdown(self) -> None:
        """At exit: remove the memory cgroups of jobs that have ended (a running job's stays)."""
        with self._lock:
            groups = list(self._groups.values())
        for group in groups:
            group.remove()

    def forget(self, job: Job) -> None:
        """Drop the handle of a job that has ended and been reaped."""
        with self._lock:
            self._procs.pop(job.id, None)
            group = self._groups.pop(job.id, None)
        if group is not None:
            group.remove()
