"""Many processes as one Slurm job step inside the allocation this program runs in: ``srun --ntasks=N``,
each task one process, told apart by ``$SLURM_PROCID`` (the slurm backend's jobs inside an allocation).

What a :class:`Step` guarantees:

* One ``srun`` for the N processes: ``squeue --steps`` shows one step of N tasks named ``roving-<session>``.
  srun runs with ``--overlap`` (the step shares the allocation's CPUs with the batch script and with
  roving's other steps: a step's CPUs are only given back when the whole step ends, so without it a
  replacement for one lost task could never start), ``--kill-on-bad-exit=0`` and ``--wait=0`` (a task
  that dies or leaves does not end the others, whatever the cluster's KillOnBadExit and WaitTime say),
  and ``--no-kill`` (in an allocation that survives a node's failure, sbatch --no-kill, the step's tasks
  on the other nodes go on: the pool notices the lost ones by their heartbeats and replaces them).
* Each task runs a small sh script (:func:`task_script`): it exports its process's own variables, then
  writes to srun's stdout a line with its host and the pid of its process before that process starts, and
  one with the exit status after it ended. The lines carry a random token of the step, so that a
  process's own output is not taken for them. So each task has a state of its own (pending, running,
  exited with its code) although Slurm keeps none per task, and one task can be signalled alone (its
  pid, on its host).
* With ``child_output = "prefix"`` srun labels every line with its task (``--label``); each line is
  printed with its process's name. srun's own words are logged, not printed.
* Every call that waits has a timeout; a task whose step ended without its exit line counts as killed.
"""
from __future__ import annotations

import logging
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import threading
import time
import math
from typing import Callable, Dict, IO, List, Optional, Sequence, Tuple, Union

from ... import config as _config
from . import job_array as slurm_array
from ..base import Backend, Job, JobSpec, JobState, JobStatus
from ..errors import StepError
from ..output import write_prefixed
from ...system.private import private_dir

log = logging.getLogger(__name__)

__all__ = ["Steps", "Step", "StepError", "task_script", "allocation_cpus", "fit_error", "step_chunks"]

_LABEL = re.compile(rb"^\s*(\d+): ?(.*)$")
# srun's words about a task that ended (logged, not printed: the pool's own kills end tasks)
_TASK_END = re.compile(r"srun: error: \S+: tasks? [\d,\-]+: (?:Exited with exit code \d+|[A-Z][a-z].*)$")
_KILL_TIMEOUT = 30
_BATCH_S = 0.05  # how long a signal for a task on another node waits for others to go with it
# an argument (the script) must stay under the kernel's MAX_ARG_STRLEN (128 KiB)
MAX_SCRIPT = 100_000
# how long starting a step waits for srun to launch it (or to refuse, in its words); a step still
# waiting for resources then is pending
LAUNCH_WAIT_S = 10
# srun's input variables (the batch script's own request) that would override a step's layout
_LAYOUT_ENV = ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NNODES", "SLURM_CPUS_PER_TASK", "SLURM_MEM_PER_",
               "SLURM_GPUS_PER_", "SLURM_CPUS_PER_GPU")


def srun_env(env: Dict[str, str]) -> Dict[str, str]:
    """``env`` without the variables by which srun would take the batch script's own layout (ntasks,
    memory per node...) over the options a step gives."""
    return {k: v for k, v in env.items() if not k.startswith(_LAYOUT_ENV)}


def this_host() -> str:
    """This machine's name as a task's ``uname -n`` says it: a task of that host is signalled directly."""
    return socket.gethostname()


def allocation_cpus(value: str) -> List[int]:
    """The CPUs of each node of an allocation from ``SLURM_JOB_CPUS_PER_NODE`` (``"4(x2),2"`` -> [4, 4, 2]).
    ValueError naming the value when it is not of that form."""
    out: List[int] = []
    for part in value.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ValueError(f"SLURM_JOB_CPUS_PER_NODE={value!r} is not of Slurm's form (like '4(x2),2')")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def fit_error(job_id: str, nodes: List[int], cpus_per_task: int, asked: int, in_use: int) -> Optional[str]:
    """Why ``asked`` more tasks of ``cpus_per_task`` CPUs each do not fit allocation ``job_id`` (its
    ``nodes``' CPUs) next to ``in_use`` CPUs its running roving tasks hold, or None when they fit."""
    total = sum(nodes)
    slots = sum(n // cpus_per_task for n in nodes)
    where = f"allocation {job_id} ({total} CPU(s) on {len(nodes)} node(s), SLURM_JOB_CPUS_PER_NODE)"
    if slots == 0:
        return (f"a process asks for {cpus_per_task} CPU(s), more than any node of {where} has (at most "
                f"{max(nodes)}); ask for fewer CPUs per process, or for bigger nodes in sbatch/salloc")
    free = max(0, min(slots, (total - in_use) // cpus_per_task))
    if asked <= free:
        return None
    return (f"{asked} process(es) of {cpus_per_task} CPU(s) each do not fit {where}: it has room for {slots} "
            f"such task(s), {in_use} CPU(s) are held by this program's running roving processes, so "
            f"{free} more fit; use fewer workers, or ask sbatch/salloc for more (--ntasks, --cpus-per-task)")


def task_script(token: str, per_task: Sequence[Dict[str, str]], umask: int,
                log_files: Optional[Sequence[str]], mode: str) -> str:
    """The sh script each task of a step runs, with the process's command as its arguments ("$@"): task i
    exports ``per_task[i]``; its output goes to srun (``mode`` "prefix"), /dev/null ("off") or appends to
    ``log_files[i]`` ("files"). Before the process starts it writes ``<token> start <step> <host> <pid>``
    to srun's stdout, after it ended ``<token> end <status>`` (sh's: 128+N for signal N)."""
    lines = ["umask 0077", "exec 3>&1", 'case "$SLURM_PROCID" in']
    for i, extra in enumerate(per_task):
        body = [f"export {k}={shlex.quote(v)}" for k, v in sorted(extra.items())]
        if mode == "files" and log_files is not None:
            body.append(f"exec >>{shlex.quote(log_files[i])} 2>&1")
        lines.append(f"{i}) " + "; ".join(body or [":"]) + " ;;")
    lines.append('*) echo "roving: no task $SLURM_PROCID in this step" >&2; exit 70 ;;')
    lines.append("esac")
    if mode == "off":
        lines.append("exec >/dev/null 2>&1")
    lines.append(f"umask {umask:04o}")
    # the inner sh says its own pid, which exec gives to the process: the line is out before the
    # process writes anything
    lines.append(f"sh -c 'echo \"{token} start $SLURM_JOB_ID.$SLURM_STEP_ID $(uname -n) $$\" >&3; "
                 "exec 3>&-; exec \"$@\"' sh \"$@\" &")
    lines.append("wait $! 2>/dev/null; rc=$?")  # without sh's own "Killed" line
    lines.append(f'echo "{token} end $rc" >&3')
    lines.append("exit $rc")
    return "\n".join(lines) + "\n"


def step_chunks(n: int, script_size: Callable[[int, int], int]) -> List[range]:
    """``range(n)`` cut into runs whose script (``script_size(start, stop)`` characters) stays under
    :data:`MAX_SCRIPT`, halving a run until it does (a run of one is kept whatever its size)."""
    out: List[range] = []
    start = 0
    while start < n:
        stop = n
        while stop - start > 1 and script_size(start, stop) > MAX_SCRIPT:
            stop = start + (stop - start) // 2
        out.append(range(start, stop))
        start = stop
    return out


class _Task:
    def __init__(self, name: str) -> None:
        self.name = name
        self.host: Optional[str] = None
        self.pid: Optional[int] = None
        self.code: Optional[int] = None
        self.signalled: Optional[str] = None  # "TERM" or "KILL", when this program asked it to stop
        self.ended = threading.Event()


class Step:
    """One srun job step of ``len(names)`` tasks, started at once (:meth:`start`); task i is process
    ``names[i]``. Thread-safe."""

    def __init__(self, names: Sequence[str], step_name: str,
                 watch: Optional[Callable[[str, bool], None]] = None) -> None:
        self._watch = watch
        self.token = "@roving-step-" + secrets.token_hex(8) + "@"
        self.step_name = step_name
        self.tasks = [_Task(n) for n in names]
        self.step_id = ""  # <job>.<step>, once a task said it
        self.proc: Optional[subprocess.Popen] = None
        self.words: List[str] = []  # srun's own last lines
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._readers = 0
        self._over = False  # srun ended and its output was read to the end
        self._prefix = False
        self._outbox: List[Tuple[_Task, str]] = []  # signals for tasks on other nodes, not sent yet
        self._sender: Optional[threading.Thread] = None

    # -- starting --------------------------------------------------------------------------------
    def start(self, args: List[str], env: Dict[str, str], cwd: str, prefix: bool) -> None:
        """Run srun (``args``); OSError when it cannot be run."""
        self._prefix = prefix
        self.proc = subprocess.Popen(args, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, close_fds=True)
        self._readers = 2
        for stream, to_stderr in ((self.proc.stdout, False), (self.proc.stderr, True)):
            threading.Thread(target=self._read, args=(stream, to_stderr), daemon=True,
                             name=f"roving-srun-{self.step_name}").start()

    def wait_launched(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until a task has started or srun has ended; True when a task started."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not self._over and not any(t.pid for t in self.tasks):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            return any(t.pid for t in self.tasks)

    def failure(self) -> str:
        """srun's own words (its last lines), for an error message."""
        with self._lock:
            return " / ".join(self.words[-4:]) or f"srun exited with code {self.proc.poll() if self.proc else '?'}"

    # -- srun's output ---------------------------------------------------------------------------
    def _read(self, stream: IO[bytes], to_stderr: bool) -> None:
        token = self.token.encode()
        partial = b""
        try:
            for chunk in iter(lambda: stream.read1(65536), b""):  # type: ignore[attr-defined]  # a BufferedReader
                lines = (partial + chunk).split(b"\n")
                partial = lines.pop()
                for line in lines:
                    self._line(line, token, to_stderr)
            if partial:
                self._line(partial, token, to_stderr)
        finally:
            stream.close()
            if self.proc is not None:
                try:
                    self.proc.wait(_KILL_TIMEOUT)
                except subprocess.TimeoutExpired:  # its pipes closed but srun lingers: stop it
                    self.proc.kill()
                    self.proc.wait(_KILL_TIMEOUT)
            with self._changed:
                self._readers -= 1
                over = self._readers == 0
                if over:
                    self._ended_all()
                self._changed.notify_all()
            if over and self.step_id and self._watch is not None:
                self._watch(self.step_id, False)

    def _line(self, line: bytes, token: bytes, to_stderr: bool) -> None:
        m = _LABEL.match(line)
        index = int(m.group(1)) if m is not None else -1
        if m is None or not 0 <= index < len(self.tasks):
            self._srun_said(line.decode(errors="replace"))
            return
        text = m.group(2)
        at = text.find(token)
        if at >= 0 and not to_stderr:
            if at:  # the process's last line had no newline
                self._output(index, [text[:at]], to_stderr)
            self._marker(index, text[at + len(token):].decode(errors="replace").split())
            return
        self._output(index, [text], to_stderr)

    def _output(self, index: int, lines: List[bytes], to_stderr: bool) -> None:
        if self._prefix:
            write_prefixed(f"[{self.tasks[index].name}] ", lines, to_stderr)

    def _srun_said(self, text: str) -> None:
        text = text.strip()
        if not text:
            return
        with self._lock:
            self.words.append(text)
            del self.words[:-20]
        if "error" in text and not _TASK_END.match(text) and "CANCELLED" not in text:
            log.warning("roving: srun (step %s of %s): %s", self.step_id or "?", self.step_name, text)
        else:
            log.debug("roving: srun (step %s of %s): %s", self.step_id or "?", self.step_name, text)

    def _marker(self, index: int, words: List[str]) -> None:
        task = self.tasks[index]
        signal_now = None
        first = False
        with self._changed:
            if words[:1] == ["start"] and len(words) == 4 and words[3].isdigit():
                first = not self.step_id
                self.step_id = self.step_id or words[1]
                task.host, task.pid = words[2], int(words[3])
                signal_now = task.signalled
            elif words[:1] == ["end"] and len(words) == 2 and task.code is None and words[1].isdigit():
                rc = int(words[1])
                task.code = -(rc - 128) if 128 < rc < 160 else rc
                task.ended.set()
            self._changed.notify_all()
        if first and self._watch is not None:
            self._watch(self.step_id, True)
        if signal_now:  # asked to stop before it had started
            self._deliver(task, signal_now)

    def _ended_all(self) -> None:
        """srun is gone (called with the lock held): a task that said no end was ended with the step."""
        self._over = True
        code = self.proc.poll() if self.proc is not None else None
        for task in self.tasks:
            if task.code is None:
                if task.signalled:
                    task.code = -9 if task.signalled == "KILL" else -15
                elif task.pid is None:
                    task.code = code if code else -15  # never started: srun's own failure
                else:
                    task.code = -9  # ended with its step (scancel of the step, a node lost)
                task.ended.set()

    # -- the state of a task ---------------------------------------------------------------------
    def status(self, index: int) -> JobStatus:
        task = self.tasks[index]
        with self._lock:
            if task.code is not None:
                reason = "" if not self.words or task.pid is not None else self.words[-1]
                return JobStatus(JobState.EXITED, task.code, reason)
            if task.pid is None:
                return JobStatus(JobState.PENDING, reason=self.words[-1] if self.words else "step starting")
            return JobStatus(JobState.RUNNING)

    def wait(self, index: int, timeout: Optional[float]) -> Optional[int]:
        task = self.tasks[index]
        return task.code if task.ended.wait(timeout) else None

    def pid(self, index: int) -> Optional[int]:
        """The task's process id when it runs on this machine."""
        task = self.tasks[index]
        return task.pid if task.host == this_host() else None

    def holds(self, index: int) -> bool:
        """Whether task ``index`` still counts against the allocation: not ended, not told to stop."""
        task = self.tasks[index]
        return task.code is None and task.signalled is None

    # -- stopping --------------------------------------------------------------------------------
    def signal(self, index: int, name: str) -> None:
        """Send SIGTERM or SIGKILL (``name`` "TERM"/"KILL") to task ``index``'s process alone; a task not
        started yet gets it when it starts, and when no task of the step is left running srun is stopped.
        Returns at once for a task on another node: its signal goes within a moment, with the others asked
        for meanwhile (one ``scancel --signal`` of the step when all of its tasks were)."""
        task = self.tasks[index]
        with self._lock:
            if task.code is not None:
                return
            if task.signalled != "KILL":
                task.signalled = name
            started = task.pid is not None
            nobody_left = all(t.code is not None or (t.signalled and t.pid is None) for t in self.tasks)
        if started:
            self._deliver(task, name)
        elif nobody_left:
            self.stop(name == "KILL")

    def _deliver(self, task: _Task, name: str) -> None:
        assert task.pid is not None  # delivered only to a task that said it started
        if task.host == this_host():
            try:
                os.kill(task.pid, getattr(signal, f"SIG{name}"))
            except ProcessLookupError:
                pass
            return
        # on another node: sent a moment later, together with the others asked for meanwhile (a pool that
        # ends signals all of its workers one after another)
        with self._lock:
            self._outbox.append((task, name))
            if self._sender is not None:
                return
            self._sender = threading.Thread(target=self._send_remote, daemon=True,
                                            name=f"roving-srun-signal-{self.step_name}")
        self._sender.start()

    def _send_remote(self) -> None:
        """Deliver the signals waiting for tasks on other nodes: one ``scancel --signal`` of the step when
        every task still running was asked (with one signal), else one ``srun ... kill`` per host."""
        time.sleep(_BATCH_S)
        with self._lock:
            batch, self._outbox, self._sender = self._outbox, [], None
            names = {t.signalled for t in self.tasks if t.code is None}
            whole = bool(self.step_id) and len(names) == 1 and None not in names
        if whole:
            self._run(["scancel", f"--signal={names.pop()}", self.step_id])
            return
        by_host: Dict[Tuple[str, str], List[str]] = {}
        for task, name in batch:
            by_host.setdefault((task.host or "", name), []).append(str(task.pid))
        job = self.step_id.split(".")[0] or os.environ.get("SLURM_JOB_ID", "")
        for (host, name), pids in by_host.items():
            self._run(["srun", "--overlap", f"--jobid={job}", f"--nodelist={host}", "--nodes=1", "--ntasks=1",
                       "--quiet", "kill", f"-{name}", *pids])

    @staticmethod
    def _run(args: List[str]) -> None:
        try:
            done = subprocess.run(args, env=srun_env(dict(os.environ)), stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=_KILL_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("roving: could not signal tasks with `%s`: %s", shlex.join(args), exc)
            return
        if done.returncode != 0 and "No such process" not in done.stderr:
            log.debug("roving: `%s`: %s", shlex.join(args), done.stderr.strip())

    def stop(self, force: bool) -> None:
        """End the whole step: ``scancel`` of it once its id is known, and srun itself."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with self._lock:
            for task in self.tasks:
                if task.code is None and task.signalled != "KILL":
                    task.signalled = "KILL" if force else "TERM"
        if self.step_id:
            self._run(["scancel", f"--signal={'KILL' if force else 'TERM'}", self.step_id])
        if force:
            self.proc.kill()
        else:
            self.proc.terminate()

    def over(self) -> bool:
        """Whether srun has ended and every task's state is final."""
        with self._lock:
            return self._over


class Steps:
    """The job steps this process started inside its allocation (``$SLURM_JOB_ID``), and their tasks by
    job id (``roving-<session>-<pid>-<n>.<task>``). ``watch(step_id, running)`` is told when a step's id
    is known and when it ended (the Reaper's add and done)."""

    def __init__(self, watch: Callable[[str, bool], None]) -> None:
        self._lock = threading.Lock()  # the bookkeeping
        self._start_lock = threading.Lock()  # the fit check and the start together: two pools do not
        self._tasks: Dict[str, Tuple[Step, int, int]] = {}  # job id -> (step, task, CPUs)
        self._logs: Dict[str, str] = {}
        self._counter = 0
        self._watch = watch

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._tasks

    def start(self, specs: Sequence[JobSpec], backend: Backend, umask: int) -> List[Union[Job, Exception]]:
        """``specs`` as steps of the allocation: one step of many tasks per group of equal specs (cut where
        its script would be too long for one argument). One entry per spec: its Job, or the exception
        (StepError when it does not fit or srun refused) that kept it from starting."""
        cfg = _config.current()
        out: List[Union[Job, Exception]] = [StepError("not started")] * len(specs)
        for group in slurm_array.groups(specs):
            try:
                jobs: List[Union[Job, Exception]] = list(self._start_group([specs[i] for i in group], backend,
                                                                           umask, cfg))
            except Exception as exc:
                jobs = [exc] * len(group)
            for i, job in zip(group, jobs):
                out[i] = job
        return out

    def _start_group(self, specs: List[JobSpec], backend: Backend, umask: int, cfg: _config.Config) -> List[Job]:
        alloc = os.environ["SLURM_JOB_ID"]
        cpt = max(1, math.ceil(specs[0].resources.cpu))
        with self._start_lock:
            nodes = allocation_nodes()
            if nodes:
                with self._lock:
                    in_use = sum(c for step, i, c in self._tasks.values() if step.holds(i))
                why = fit_error(alloc, nodes, cpt, len(specs), in_use)
                if why:
                    raise StepError(why)
            common, per_task = slurm_array.split_env(specs)
            log_files = None
            if specs[0].output == "files":
                log_files = [os.path.abspath(os.path.join(s.cwd, s.log_file())) for s in specs]
                for path in {os.path.dirname(p) for p in log_files}:
                    private_dir(path)
            parts = step_chunks(len(specs), lambda a, b: len(task_script(
                "@roving-step-0000000000000000@", per_task[a:b], umask, log_files and log_files[a:b], "files")))
            jobs: List[Job] = []
            for part in parts:
                jobs += self._start_step(specs[part.start:part.stop], common, per_task[part.start:part.stop],
                                         None if log_files is None else log_files[part.start:part.stop],
                                         umask, cpt, len(nodes) or 1, backend, cfg)
            return jobs

    def _start_step(self, specs: List[JobSpec], common: Dict[str, str], per_task: List[Dict[str, str]],
                    log_files: Optional[List[str]], umask: int, cpt: int, nnodes: int, backend: Backend,
                    cfg: _config.Config) -> List[Job]:
        first, n = specs[0], len(specs)
        tag, alloc = first.session.tag, os.environ["SLURM_JOB_ID"]
        env = srun_env(common)
        env.setdefault("PYTHONUNBUFFERED", "1")
        with self._lock:
            self._counter += 1
            key = f"roving-{tag}-{os.getpid()}-{self._counter}"
        step = Step([s.name for s in specs], f"roving-{tag}", self._watch)
        script = task_script(step.token, per_task, umask, log_files, first.output)
        args = ["srun", "--overlap", f"--ntasks={n}", f"--nodes=1-{min(n, nnodes)}", "--kill-on-bad-exit=0",
                "--wait=0", "--no-kill", "--label", "--export=ALL", f"--job-name=roving-{tag}",
                f"--chdir={first.cwd}", *step_options(first, cpt, cfg), "sh", "-c", script, "sh", *first.command]
        what = f"a step of {n} ({slurm_array.label(specs)}) in allocation {alloc}"
        try:
            step.start(args, env, first.cwd, prefix=first.output == "prefix")
        except FileNotFoundError:
            raise StepError(f"Slurm's `srun` command is not on PATH inside allocation {alloc}") from None
        if not step.wait_launched(LAUNCH_WAIT_S) and step.over():
            raise StepError(f"srun could not start {what}: {step.failure()}")
        log.info("roving: Slurm job step %s: %s", step.step_id or "(not started yet)", what)
        jobs = []
        with self._lock:
            for i in range(n):
                job_id = f"{key}.{i}"
                self._tasks[job_id] = (step, i, cpt)
                if log_files is not None:
                    self._logs[job_id] = log_files[i]
                jobs.append(Job(backend, job_id))
        return jobs

    # -- one task, by its job id -----------------------------------------------------------------
    def status(self, job_id: str) -> JobStatus:
        step, i, _ = self._tasks[job_id]
        return step.status(i)

    def wait(self, job_id: str, timeout: Optional[float]) -> Optional[int]:
        step, i, _ = self._tasks[job_id]
        return step.wait(i, timeout)

    def signal(self, job_id: str, name: str) -> None:
        step, i, _ = self._tasks[job_id]
        step.signal(i, name)

    def pid(self, job_id: str) -> Optional[int]:
        step, i, _ = self._tasks[job_id]
        return step.pid(i)

    def logs(self, job_id: str) -> str:
        """What the task wrote, where it was kept (its log file with ``child_output = "files"``)."""
        path = self._logs.get(job_id, "")
        if not path or not os.path.exists(path):
            return ""
        with open(path, errors="replace") as f:
            return f.read()

    def forget(self, job_id: str) -> None:
        """Drop an ended task (its step goes once all of its tasks are forgotten)."""
        with self._lock:
            entry = self._tasks.get(job_id)
            if entry is not None and entry[0].status(entry[1]).state is JobState.EXITED:
                del self._tasks[job_id]
                self._logs.pop(job_id, None)

    def stop_all(self) -> None:
        """At this process's exit: every step still running is cancelled."""
        with self._lock:
            steps = {id(step): step for step, _, _ in self._tasks.values()}.values()
        for step in steps:
            step.stop(force=True)


def allocation_nodes() -> List[int]:
    """The CPUs of each node of this process's allocation; [] when Slurm did not say (no fit check then).
    StepError when ``SLURM_JOB_CPUS_PER_NODE`` cannot be read."""
    value = os.environ.get("SLURM_JOB_CPUS_PER_NODE", "")
    if not value:
        return []
    try:
        return allocation_cpus(value)
    except ValueError as exc:
        raise StepError(str(exc)) from None


def step_options(spec: JobSpec, cpt: int, cfg: _config.Config) -> List[str]:
    """What each task of a step asks for: per task (a step's --mem and --gres would be per node); the
    time limit and the further options of the configuration. Partition and account are the allocation's."""
    res = spec.resources
    opts = [f"--cpus-per-task={cpt}"]
    if res.memory:
        opts.append(f"--mem-per-cpu={max(1, math.ceil(res.memory / 2 ** 20 / cpt))}M")
    if res.gpu:
        opts.append(f"--gpus-per-task={res.gpu}")
    if cfg.slurm_time:
        opts.append(f"--time={cfg.slurm_time}")
    return opts + shlex.split(cfg.slurm_options)
