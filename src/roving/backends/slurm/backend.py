"""The slurm backend: each job is a Slurm batch job (sbatch), or a job step (srun) inside an allocation.

* Outside an allocation a process is ``sbatch --export=ALL --wrap 'exec python -m roving._child'``: it gets
  the parent's environment without the session secret, which it reads from a private file and removes
  (:class:`~roving.backends.secret_files.SecretFiles`, under ``~/.roving/secrets``: the job's machine must see
  this user's home; neither the job's environment nor Slurm's record of it holds the secret),
  ``--cpus-per-task``, ``--mem`` and ``--gres=gpu:N`` from
  the process resources, partition, account, time limit and extra options from the configuration.
  Its job name is ``roving-<session>`` and its comment the process name, so ``squeue`` shows both.
* A pool's workers (:meth:`SlurmBackend.submit_many`) are one job array: ``sbatch --array=0-N``, the
  same job name, the comment ``<first name>..<last name>``; each task's own variables are chosen in the
  batch script by its index (:mod:`roving.backends.slurm.job_array`). A task's id is ``<array>_<index>``,
  used as any job id here (state, cancel, output, the Reaper, `roving ps/logs/cancel`). Arrays are cut at
  the cluster's MaxArraySize; more jobs than its MaxJobCount are refused at once, naming it.
  ``slurm_array = False`` submits one job each. sbatch is retried with back-off while Slurm says it is
  busy (:mod:`roving.backends.throttle`), its words logged.
* Inside an allocation (SLURM_JOB_ID set) a process is a task of an ``srun`` job step of that allocation
  (:mod:`roving.backends.slurm.step`): a pool's workers are one step of N tasks, a lone process (a
  replacement for a lost worker) a step of one; a pool larger than the allocation's CPUs is refused,
  naming both.
* State comes from one ``squeue`` call for all of this process's jobs (at most every 0.2 s), exit codes
  from the job's exit status: a job killed by signal N is ``-N`` as in multiprocessing.
* ``terminate_job`` sends SIGTERM (``scancel --signal=TERM --full``), ``force`` SIGKILL.
* A job's output goes to a file (``--output``): the process's log file with ``child_output = "files"``,
  else ``~/.roving/slurm/<session>/``, which is followed and printed with the process name as prefix.
  slurmstepd's ``*** JOB N ... CANCELLED ***`` line is not printed for a job this process cancelled itself
  (a Pool's workers at its end); for a job cancelled by anyone else it is.
* When this process exits, normally or killed, every job it started and that is still there is
  cancelled (:class:`~roving.backends.reaper.Reaper`).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import shlex
import threading
import time
from typing import IO, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

from ... import config as _config
from .. import throttle
from . import job_array as slurm_array
from . import step as slurm_step
from ..base import Backend, Job, JobSpec, JobState, JobStatus
from ..errors import SlurmError, StepError, UnknownJobError
from ..output import LineSplitter
from ...system.private import private_dir
from ..reaper import Reaper
from .cluster import ClusterQueries
from .cluster import slurm_command as _slurm
from ..secret_files import SecretFiles

log = logging.getLogger(__name__)

#: Where Slurm jobs find the session secret: a private folder in this user's home (which a cluster's
#: nodes share), one file per job.

_PENDING = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING", "SUSPENDED",
            "STOPPED", "RESV_DEL_HOLD", "SIGNALING"}
# COMPLETING: the job's processes ended, but the final state (and, after a cancel, the exit status)
# is not settled yet
_RUNNING = {"RUNNING", "COMPLETING"}
_REFRESH_S = 0.2
#: How long shutdown waits for the output followers of jobs to print their last lines.
_OUTPUT_WAIT_S = 5.0
# What slurmstepd writes into a job's error file when the job is cancelled:
# "slurmstepd-HOST: error: *** JOB 208 ON HOST CANCELLED AT 2026-12-01T10:06:48 ***" (STEP 208.0 for a step)
_CANCELLED_LINE = re.compile(rb"^slurmstepd(?:-\S+)?: error: \*\*\* (?:JOB|STEP) (\d+)[.\w]* ON \S+ "
                             rb"CANCELLED AT .*\*\*\*\s*$")


def _umask() -> int:
    """This process's umask, read without setting it (which other threads would see meanwhile)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def _exitcode(raw: str, forced: bool, state: str) -> int:
    """multiprocessing's exit code from Slurm's raw wait status (squeue's exit_code)."""
    try:
        status = int(raw)
    except ValueError:
        status = 0
    if state == "CANCELLED":
        return -9 if forced else -15
    if status & 0x7F:
        return -(status & 0x7F)
    code = status >> 8
    if code == 0 and state != "COMPLETED":
        return -9 if state in ("OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL") else -15
    return code


@dataclasses.dataclass
class _Followed:
    """One output file of a job being followed: its path, the file once it exists, its splitter."""

    path: str
    splitter: LineSplitter
    file: Optional[IO[bytes]] = None


class SlurmBackend(ClusterQueries, Backend):
    name = "slurm"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._followers: List[threading.Thread] = []  # the output followers of "prefix" jobs
        self._refresh_lock = threading.Lock()
        self._status: Dict[str, JobStatus] = {}
        self._checked_at: Dict[str, float] = {}
        self._own: Dict[str, str] = {}  # job id -> output file ("" when none)
        self._names: Dict[str, str] = {}
        self._forced: Set[str] = set()
        self._cancelled: Set[str] = set()  # jobs this process cancelled or signalled itself
        self._pending_since: Dict[str, float] = {}
        self._warned: Set[str] = set()
        self._controller_ok = False
        self._reaper = Reaper(self.name)
        self._secrets = SecretFiles(os.path.expanduser("~/.roving/secrets"), self._reaper)
        self._steps = slurm_step.Steps(self._watch_step)
        self._towards: Optional[Tuple[str, str]] = None
        self._settings: Optional[Dict[str, str]] = None
        self._task_of_raw: Dict[str, str] = {}  # an array task's own job id (slurmstepd's) -> its task id

    # -- submission ------------------------------------------------------------------------------
    @staticmethod
    def _resource_options(spec: JobSpec, cfg: _config.Config) -> List[str]:
        res = spec.resources
        opts = [f"--cpus-per-task={max(1, math.ceil(res.cpu))}"]
        if res.memory:
            opts.append(f"--mem={max(1, math.ceil(res.memory / 2 ** 20))}M")
        if res.gpu:
            opts.append(f"--gres=gpu:{res.gpu}")
        if cfg.slurm_partition:
            opts.append(f"--partition={cfg.slurm_partition}")
        if cfg.slurm_account:
            opts.append(f"--account={cfg.slurm_account}")
        if cfg.slurm_time:
            opts.append(f"--time={cfg.slurm_time}")
        # the warning before the time limit (the job's shell is its Python: `exec`), taken by roving
        # children as the sign to leave well (pool workers) or to say so (roving.pool._ending)
        opts.append(f"--signal=B:USR1@{int(cfg.worker_grace) + 10}")
        return opts + shlex.split(cfg.slurm_options)

    def create_job(self, spec: JobSpec) -> Job:
        # the secret in a private file: neither in the job's environment nor in Slurm's record of it
        spec = self._secrets.moved(spec)
        if os.environ.get("SLURM_JOB_ID"):
            (job,) = self._start_steps([spec])
            if isinstance(job, Exception):
                raise job
            return job
        cfg = _config.current()
        env = dict(spec.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self._check_controller()
        tag = spec.session.tag
        if spec.output == "off":
            output = "/dev/null"
        elif spec.output == "files":
            output = os.path.abspath(os.path.join(spec.cwd, spec.log_file()))
        else:
            output = os.path.join(os.path.expanduser("~/.roving/slurm"), tag, f"{spec.name}-%j.out")
        if output != "/dev/null":
            private_dir(os.path.dirname(output))
        error = output[:-len(".out")] + ".err" if spec.output == "prefix" else output
        # Slurm creates the output files under the umask sbatch ran with: 077 makes them 0600; the job
        # itself runs under this process's own umask again.
        args = ["sbatch", "--parsable", f"--job-name=roving-{tag}", f"--comment={spec.name}",
                # never requeued after a node failure: a process runs once (its parent decides what is
                # run again), and a requeued copy would find its work already taken
                "--export=ALL", f"--chdir={spec.cwd}", "--ntasks=1", "--open-mode=append", "--no-requeue",
                f"--output={output}", f"--error={error}", *self._resource_options(spec, cfg),
                "--wrap", f"umask {_umask():04o}; exec " + shlex.join(spec.command)]
        env.pop("SLURM_UMASK", None)  # it would win over sbatch's own umask
        job_id = self._sbatch(args, env, spec.name)
        return self._register(job_id, spec.name, output.replace("%j", job_id), error.replace("%j", job_id),
                              spec.output)

    def _sbatch(self, args: List[str], env: Dict[str, str], what: str, tasks: int = 0,
                script: Optional[str] = None) -> str:
        """Run sbatch, retried while Slurm says it is busy (:func:`throttle.retry_busy`); the job id.
        SlurmError with Slurm's words (and the limit met, for an array of ``tasks``) when refused.
        ``script``: the batch script, given on sbatch's standard input."""
        def attempt() -> str:
            result = _slurm(args, env=env, check=False, umask=0o077, script=script)
            if result.returncode != 0:
                words = (result.stderr or result.stdout).strip()
                if tasks:
                    raise SlurmError(f"{what}: " + slurm_array.refusal(words, tasks, self._cluster_settings()))
                raise SlurmError(f"Slurm refused to start {what}: {words}")
            return result.stdout.strip().split(";")[0]

        return throttle.retry_busy(attempt, lambda exc: slurm_array.busy_words(str(exc))
                                   if isinstance(exc, SlurmError) else None, f"sbatch of {what}")

    def _register(self, job_id: str, name: str, output: str, error: str, mode: str) -> Job:
        """Bookkeeping of a job (or array task) just submitted; its output followed in "prefix" mode."""
        job = Job(self, job_id)
        with self._lock:
            self._own[job_id] = "" if output == "/dev/null" else output
            self._names[job_id] = name
            self._status[job_id] = JobStatus(JobState.PENDING)
            self._pending_since[job_id] = time.monotonic()
        self._reaper.add(job_id)
        if mode == "prefix":
            follower = threading.Thread(target=self._follow, args=(job, [(output, False), (error, True)],
                                                                    f"[{name}] "),
                                        name=f"roving-slurm-output-{job_id}", daemon=True)
            follower.start()
            with self._lock:
                self._followers = [t for t in self._followers if t.is_alive()] + [follower]
        return job

    # -- many at once: job arrays ----------------------------------------------------------------
    def submit_many(self, specs: Sequence[JobSpec]) -> List[Union[Job, Exception]]:
        """A pool's workers as one job array (``sbatch --array=0-N``) per group of equal specs, each array
        at most MaxArraySize tasks; one job each with ``slurm_array = False``, for a single spec, and
        inside an allocation (job steps). Task ids are ``<array>_<index>``. More specs than the cluster's
        MaxJobCount are refused at once, naming it."""
        specs = [self._secrets.moved(spec) for spec in specs]  # a file each: a task removes its own once read
        if os.environ.get("SLURM_JOB_ID"):
            return self._start_steps(specs)
        cfg = _config.current()
        if len(specs) < 2 or not cfg.slurm_array:
            return super().submit_many(specs)
        try:
            self._check_controller()
            max_jobs = self._limit("MaxJobCount", 10000)
            if len(specs) > max_jobs:
                raise SlurmError(f"{len(specs)} jobs at once are more than this Slurm cluster holds "
                                 f"(MaxJobCount = {max_jobs} in `scontrol show config`); use fewer workers")
        except SlurmError as exc:
            return [exc] * len(specs)
        out: List[Union[Job, Exception]] = [SlurmError("not submitted")] * len(specs)
        size = max(1, self._limit("MaxArraySize", 1001))  # indexes 0 .. MaxArraySize-1
        for group in slurm_array.groups(specs):
            for chunk in slurm_array.chunks(group, size):
                try:
                    jobs: List[Union[Job, Exception]] = list(self._submit_array([specs[i] for i in chunk], cfg))
                except Exception as exc:
                    jobs = [exc] * len(chunk)
                for i, job in zip(chunk, jobs):
                    out[i] = job
        return out

    def _submit_array(self, specs: List[JobSpec], cfg: _config.Config) -> List[Job]:
        first = specs[0]
        tag, mode = first.session.tag, first.output
        log_files = None
        if mode == "prefix":
            output = os.path.join(os.path.expanduser("~/.roving/slurm"), tag, "array-%A_%a.out")
            error = output[:-len(".out")] + ".err"
            private_dir(os.path.dirname(output))
        else:  # "off", or "files": each task appends to its own log file (the script redirects)
            output = error = "/dev/null"
            if mode == "files":
                log_files = [os.path.abspath(os.path.join(s.cwd, s.log_file())) for s in specs]
                for path in {os.path.dirname(p) for p in log_files}:
                    private_dir(path)
        common, per_task = slurm_array.split_env(specs)
        common.setdefault("PYTHONUNBUFFERED", "1")
        common.pop("SLURM_UMASK", None)  # it would win over sbatch's own umask
        what = f"an array of {len(specs)} ({slurm_array.label(specs)})"
        args = ["sbatch", "--parsable", f"--array=0-{len(specs) - 1}", f"--job-name=roving-{tag}",
                f"--comment={slurm_array.label(specs)}", "--export=ALL", f"--chdir={first.cwd}", "--ntasks=1",
                "--open-mode=append", "--no-requeue", f"--output={output}", f"--error={error}",
                *self._resource_options(first, cfg)]
        # on standard input, not as --wrap's argument: an array's script grows with its tasks (about 300
        # bytes each) past the 128 KiB the kernel allows one argument (E2BIG for a pool of ~450)
        script = "#!/bin/sh\n" + slurm_array.task_script(specs, per_task, _umask(), log_files)
        array_id = self._sbatch(args, common, what, tasks=len(specs), script=script)
        log.info("roving: Slurm job array %s: %s", array_id, what)
        jobs = []
        for i, spec in enumerate(specs):
            task_id = f"{array_id}_{i}"
            out_i, err_i = (p.replace("%A", array_id).replace("%a", str(i)) for p in (output, error))
            if log_files is not None:
                out_i = log_files[i]
            jobs.append(self._register(task_id, spec.name, out_i, err_i, mode))
        return jobs

    # -- inside an allocation: job steps (roving.backends.slurm.step) ----------------------------
    def _start_steps(self, specs: Sequence[JobSpec]) -> List[Union[Job, Exception]]:
        jobs = self._steps.start(specs, self, _umask())
        return [SlurmError(str(j)) if isinstance(j, StepError) else j for j in jobs]

    def _watch_step(self, step_id: str, running: bool) -> None:
        """A step's id is known (the Reaper cancels it if this process dies), or it has ended."""
        if running:
            self._reaper.add(step_id)
        else:
            self._reaper.done(step_id)

    def _follow(self, job: Job, paths: List[Tuple[str, bool]], prefix: str) -> None:
        """Print the job's output files as they grow, until the job has ended and they are read."""
        followed = [_Followed(path, LineSplitter(prefix, to_stderr, self._not_our_cancel)) for path, to_stderr in paths]
        delay = 0.05
        while True:
            ended = self.job_status(job).state is JobState.EXITED
            for entry in followed:
                if entry.file is None and os.path.exists(entry.path):
                    entry.file = open(entry.path, "rb")  # kept open across rounds, closed below
                if entry.file is not None:
                    chunk = entry.file.read()
                    if chunk:
                        entry.splitter.feed(chunk)
                        delay = 0.05
            if ended:
                break
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)
        for entry in followed:
            if entry.file is not None:
                entry.file.close()
            entry.splitter.close()

    def _not_our_cancel(self, line: bytes) -> bool:
        """False for slurmstepd's CANCELLED line of a job this process ended itself: that end is roving's
        normal way of stopping a worker, not the child's output (an operator's scancel still shows)."""
        match = _CANCELLED_LINE.match(line)
        raw = match.group(1).decode() if match is not None else ""
        if match is None or self._task_of_raw.get(raw, raw) not in self._cancelled:
            return True
        log.debug("roving: not shown (this process cancelled Slurm job %s): %s", match.group(1).decode(),
                  line.decode(errors="replace"))
        return False

    # -- state -----------------------------------------------------------------------------------
    def _refresh(self, wanted: str) -> None:
        with self._refresh_lock:
            if time.monotonic() - self._checked_at.get(wanted, 0.0) < _REFRESH_S:
                return
            with self._lock:
                ids = {i for i, s in self._status.items() if s.state is not JobState.EXITED}
            ids.add(wanted)
            # one line per array task (-r), named by its task id; an array task is asked for by its array
            bases = sorted({slurm_array.base_id(i) for i in ids})
            result = _slurm(["squeue", "-h", "-r", "-t", "all", "-j", ",".join(bases),
                             "-O", "JobArrayID:|,State:|,Reason:|,exit_code:|,JobID:|"], check=False)
            now = time.monotonic()
            seen = set()
            for line in result.stdout.splitlines():
                parts = [p.strip() for p in line.split("|")]
                if len(parts) < 4 or parts[0] not in ids:
                    continue
                job_id, state, reason, raw = parts[:4]
                seen.add(job_id)
                if len(parts) > 4 and parts[4] != job_id and state not in _PENDING:
                    # a pending array's tasks all show the array's id; a started task has its own
                    self._task_of_raw[parts[4]] = job_id
                if state in _PENDING:
                    status = JobStatus(JobState.PENDING, reason=reason)
                elif state in _RUNNING:
                    status = JobStatus(JobState.RUNNING)
                else:
                    status = JobStatus(JobState.EXITED, _exitcode(raw, job_id in self._forced, state),
                                       reason=f"{state} {reason}".strip(), out_of_memory=state == "OUT_OF_MEMORY")
                self._set(job_id, status, now)
            for job_id in ids - seen:
                # squeue forgets jobs MinJobAge after they end, and names no unknown id
                known = self._status.get(job_id)
                if result.returncode == 0 or "Invalid job id" in result.stderr:
                    if known is None or known.state is not JobState.EXITED:
                        self._set(job_id, JobStatus(JobState.EXITED, -9 if job_id in self._forced else -15,
                                                    reason="no longer known to Slurm"), now)
                self._checked_at[job_id] = now

    def _set(self, job_id: str, status: JobStatus, now: float) -> None:
        with self._lock:
            self._status[job_id] = status
            self._checked_at[job_id] = now
            if status.state is JobState.PENDING:
                since = self._pending_since.setdefault(job_id, now)
                # an array's tasks pend together: one warning for the array, not one per task
                key = slurm_array.base_id(job_id)
                if now - since > _config.current().pending_warning and key not in self._warned:
                    self._warned.add(key)
                    log.warning("roving: Slurm job %s (%s) has been pending for %.0f s; Slurm's reason: %s%s",
                                job_id, self._names.get(job_id, "?"), now - since, status.reason,
                                " (other pending tasks of this array are not logged)" if key != job_id else "")
            else:
                self._pending_since.pop(job_id, None)
        if status.state is JobState.EXITED and job_id in self._own:
            self._reaper.done(job_id)

    def job_status(self, job: Job) -> JobStatus:
        if job.id in self._steps:
            return self._steps.status(job.id)
        status = self._status.get(job.id)
        if status is not None and status.state is JobState.EXITED:
            return status
        self._refresh(job.id)
        return self._status.get(job.id) or JobStatus(JobState.EXITED, -15, "unknown to Slurm")

    def terminate_job(self, job: Job, force: bool = False) -> None:
        signal_name = "KILL" if force else "TERM"
        if job.id in self._steps:
            self._steps.signal(job.id, signal_name)
            return
        status = self._status.get(job.id)
        if status is not None and status.state is JobState.EXITED:
            return
        if force:
            self._forced.add(job.id)
        with self._lock:
            self._cancelled.add(job.id)
            self._checked_at.pop(job.id, None)
        self._refresh(job.id)
        if self._status.get(job.id, JobStatus(JobState.PENDING)).state is JobState.RUNNING:
            result = _slurm(["scancel", f"--signal={signal_name}", "--full", job.id], check=False)
        else:
            result = None
        if result is None or result.returncode != 0:  # a pending job cannot be signalled: cancel it
            _slurm(["scancel", job.id], check=False)
        with self._lock:
            self._checked_at.pop(job.id, None)

    def wait(self, job: Job, timeout: Optional[float] = None) -> Optional[int]:
        if job.id in self._steps:
            return self._steps.wait(job.id, timeout)
        return super().wait(job, timeout)

    # -- information -----------------------------------------------------------------------------
    def logs(self, job: Job) -> str:
        if job.id in self._steps:
            return self._steps.logs(job.id)
        path = self._own.get(job.id)
        if path is None:
            result = _slurm(["scontrol", "show", "job", "-o", job.id], check=False)
            fields = dict(f.split("=", 1) for f in result.stdout.split() if "=" in f)
            if result.returncode != 0:
                if "Invalid job id" in result.stderr:
                    raise UnknownJobError(f"no Slurm job {job.id} (Slurm: {result.stderr.strip()})")
                raise SlurmError(f"no Slurm job {job.id}: {result.stderr.strip()}")
            path = fields.get("StdOut", "")
        if not path or not os.path.exists(path):
            return ""
        with open(path, errors="replace") as f:
            return f.read()

    def pid(self, job: Job) -> Optional[int]:
        """A step task's process id when it runs on this machine; None for a batch job."""
        return self._steps.pid(job.id) if job.id in self._steps else None

    def forget(self, job: Job) -> None:
        if job.id in self._steps:
            self._steps.forget(job.id)

    def cancel_ids(self, job_ids: Iterable[str]) -> None:
        ids = [i for i in job_ids if i]
        with self._lock:
            self._cancelled.update(ids)
        if ids:
            _slurm(["scancel", *ids], check=False)

    def shutdown(self) -> None:
        with self._lock:
            live = [i for i in self._own if self._status.get(i, JobStatus(JobState.PENDING)).state
                    is not JobState.EXITED]
            followers = list(self._followers)
        if live:
            self.cancel_ids(live)
            for job_id in live:
                self._reaper.done(job_id)
        self._steps.stop_all()
        # the last lines of jobs that ended as the program exits (a child its exit joined) are printed
        # before it ends: each follower reads its files to their end once it sees its job ended
        deadline = time.monotonic() + _OUTPUT_WAIT_S
        for follower in followers:
            follower.join(max(0.0, deadline - time.monotonic()))
