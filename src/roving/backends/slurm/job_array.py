"""How the slurm backend puts many jobs into one job array: which specs can share an array
(:func:`groups`), the batch script that gives each array task its own variables (:func:`task_script`),
and how Slurm's refusals read (:func:`busy_words`, :func:`refusal`).

An array task's id is ``<array job id>_<index>`` (what ``squeue -r`` shows as JobArrayID); Slurm accepts it
wherever a job id goes (``squeue -j``, ``scancel``, ``scontrol show job``). The tasks of one array share
everything sbatch is given; what differs between the processes (the variables of the environment that
make each one a particular child, its log file with ``child_output = "files"``) is chosen in the batch
script by ``$SLURM_ARRAY_TASK_ID``.
"""
from __future__ import annotations

import re
import shlex
from typing import Dict, List, Optional, Sequence, Tuple

from ..base import JobSpec

__all__ = ["groups", "chunks", "split_env", "task_script", "base_id", "busy_words", "refusal", "label"]

# sbatch's words when the controller is busy or a submit limit is reached for now (worth a retry)
_BUSY = re.compile(r"Resource temporarily unavailable|Socket timed out|Unable to contact slurm controller|"
                   r"temporarily unable to accept job|Zero Bytes were transmitted|Connection refused|"
                   r"job submit limit|MaxSubmitJob|QOSMaxSubmitJob|AssocMaxSubmitJob", re.I)
_LIMIT_HINTS = (
    (re.compile(r"Invalid job array specification|MaxArraySize", re.I), "MaxArraySize"),
    (re.compile(r"job submit limit|MaxSubmitJob", re.I),
     "a QOS or association submit limit (MaxSubmitJobsPerUser, QOSMaxSubmitJobPerUserLimit)"),
    (re.compile(r"temporarily unable to accept job", re.I), "MaxJobCount"),
)


def groups(specs: Sequence[JobSpec]) -> List[List[int]]:
    """The indexes of ``specs`` in groups that can share one array: same command, working directory,
    resources, output mode and session. Each group keeps the specs' order."""
    out: Dict[Tuple, List[int]] = {}
    for i, s in enumerate(specs):
        key = (tuple(s.command), s.cwd, s.resources, s.output, s.session.tag)
        out.setdefault(key, []).append(i)
    return list(out.values())


def chunks(items: List[int], size: int) -> List[List[int]]:
    """``items`` cut into runs of at most ``size``."""
    return [items[i:i + size] for i in range(0, len(items), max(1, size))]


def split_env(specs: Sequence[JobSpec]) -> Tuple[Dict[str, str], List[Dict[str, str]]]:
    """The variables all of ``specs`` share (sbatch's environment), and per spec the ones that differ."""
    keys = set().union(*(s.env for s in specs))
    common = {k: specs[0].env[k] for k in keys
              if all(k in s.env and s.env[k] == specs[0].env[k] for s in specs)}
    return common, [{k: v for k, v in s.env.items() if k not in common} for s in specs]


def task_script(specs: Sequence[JobSpec], per_task: List[Dict[str, str]], umask: int,
                log_files: Optional[List[str]] = None) -> str:
    """The batch script (sh) of an array of ``specs``: task i exports ``per_task[i]`` (and appends its
    output to ``log_files[i]`` when given), then execs the shared command under ``umask``."""
    # the task's own log file is made private (as Slurm makes its output files under sbatch's umask 077);
    # the process then runs under the caller's umask
    lines = ["umask 0077", 'case "$SLURM_ARRAY_TASK_ID" in']
    for i, extra in enumerate(per_task):
        body = [f"export {k}={shlex.quote(v)}" for k, v in sorted(extra.items())]
        if log_files is not None:
            body.append(f"exec >>{shlex.quote(log_files[i])} 2>&1")
        lines.append(f"{i}) " + "; ".join(body or [":"]) + " ;;")
    lines.append('*) echo "roving: no task $SLURM_ARRAY_TASK_ID in this array" >&2; exit 70 ;;')
    lines.append("esac")
    lines.append(f"umask {umask:04o}")
    lines.append("exec " + shlex.join(specs[0].command))
    return "\n".join(lines) + "\n"


def label(specs: Sequence[JobSpec]) -> str:
    """What an array's comment says (squeue's Comment, `roving ps`): its first and last process names."""
    return specs[0].name if len(specs) == 1 else f"{specs[0].name}..{specs[-1].name}"


def base_id(job_id: str) -> str:
    """The array's job id of an array task id (``1234_5`` -> ``1234``); a plain job id as it is."""
    return job_id.split("_", 1)[0]


def busy_words(message: str) -> Optional[str]:
    """Slurm's words when ``message`` says the cluster is busy for now (try again later), else None."""
    return message.strip() if _BUSY.search(message) else None


def refusal(message: str, tasks: int, settings: Dict[str, str]) -> str:
    """A refusal of an array of ``tasks`` explained: the limit it most likely met, with this cluster's
    value of it (``settings``: `scontrol show config`), and Slurm's own words."""
    for pattern, limit in _LIMIT_HINTS:
        if pattern.search(message):
            value = settings.get(limit)
            named = f"{limit} = {value}" if value else limit
            return (f"Slurm refused an array of {tasks} task(s), a limit of this cluster ({named}) is in the "
                    f"way; use fewer workers per pool, or ask the cluster's admins. Slurm: {message.strip()}")
    return f"Slurm refused an array of {tasks} task(s): {message.strip()}"
