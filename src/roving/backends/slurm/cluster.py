"""The Slurm cluster as this process asks it: running Slurm's commands (:func:`slurm_command`, with an
error that says what to check), and what the cluster says of itself — its controller, its settings and
limits, its CPUs, its partitions, the address its compute nodes reach, and roving's jobs in its queue.

:class:`ClusterQueries` is that part of :class:`roving.backends.slurm.backend.SlurmBackend`; what it
caches (the controller's answer, ``scontrol show config``, the address) is the backend's, declared below.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from typing import Dict, Iterable, List, Optional, Set, Tuple

from ... import config as _config
from ..base import JobInfo
from ..errors import SlurmError, StepError
from . import job_array as slurm_array
from . import step as slurm_step

_COMMAND_TIMEOUT = 30


def slurm_command(args: List[str], timeout: float = _COMMAND_TIMEOUT, env: Optional[Dict[str, str]] = None,
                  check: bool = True, umask: int = -1, script: Optional[str] = None) -> subprocess.CompletedProcess:
    """Run a Slurm command; ``script`` goes to its standard input (sbatch reads its batch script there)."""
    feed = {"input": script} if script is not None else {"stdin": subprocess.DEVNULL}
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, umask=umask,
                                **feed)
    except FileNotFoundError:
        raise SlurmError(f"Slurm's `{args[0]}` command is not on PATH: is Slurm installed on this "
                         "machine? (or choose another roving backend)") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{shlex.join(args[:2])}` did not answer within {timeout:g} s: "
                         "is the Slurm controller reachable?") from None
    if check and result.returncode != 0:
        raise SlurmError(f"`{shlex.join(args[:1])}` failed: {(result.stderr or result.stdout).strip()}")
    return result


class ClusterQueries:
    """What the cluster says of itself (a mixin of ``SlurmBackend``, whose caches it fills)."""

    _controller_ok: bool
    _settings: Optional[Dict[str, str]]
    _towards: Optional[Tuple[str, str]]

    def _check_controller(self) -> None:
        if self._controller_ok:
            return
        result = slurm_command(["scontrol", "ping"], timeout=10, check=False)
        if result.returncode != 0 or "DOWN" in result.stdout or "UP" not in result.stdout:
            raise SlurmError("the Slurm controller is not reachable (`scontrol ping`: "
                             f"{(result.stdout + result.stderr).strip().splitlines()[0:1]}); is slurmctld "
                             "running and SLURM_CONF right?")
        self._controller_ok = True

    def _cluster_settings(self) -> Dict[str, str]:
        """`scontrol show config` as a dict (read once; {} when it cannot be read)."""
        if self._settings is None:
            result = slurm_command(["scontrol", "show", "config"], timeout=10, check=False)
            self._settings = {k.strip(): v.strip() for k, _, v in
                              (line.partition("=") for line in result.stdout.splitlines() if "=" in line)}
        return self._settings

    def _limit(self, name: str, default: int) -> int:
        try:
            return int(self._cluster_settings().get(name, "").split()[0])
        except (ValueError, IndexError):
            return default

    def cpu_count(self) -> int:
        """Inside an allocation, its CPUs (all its nodes'); else the idle CPUs of the partition(s)."""
        if os.environ.get("SLURM_JOB_ID") and os.environ.get("SLURM_JOB_CPUS_PER_NODE"):
            try:
                return max(1, sum(slurm_step.allocation_nodes()))
            except StepError:
                pass
        if os.environ.get("SLURM_CPUS_ON_NODE"):
            return int(os.environ["SLURM_CPUS_ON_NODE"])
        cfg = _config.current()
        args = ["sinfo", "-h", "-o", "%C"] + ([f"--partition={cfg.slurm_partition}"] if cfg.slurm_partition else [])
        try:
            out = slurm_command(args, timeout=10).stdout.split()
            return max(1, sum(int(part.split("/")[3]) for part in out))
        except (SlurmError, IndexError, ValueError):
            return os.cpu_count() or 1

    def describe(self) -> Dict[str, str]:
        info: Dict[str, str] = {}
        ping = slurm_command(["scontrol", "ping"], timeout=10, check=False)
        said = (ping.stdout + ping.stderr).strip()
        info["controller"] = said.splitlines()[0] if said else "?"
        if os.environ.get("SLURM_JOB_ID"):
            info["allocation"] = f"job {os.environ['SLURM_JOB_ID']}: processes are job steps (srun)"
        parts = slurm_command(["sinfo", "-h", "-o", "%P|%D|%C|%m|%G|%a"], timeout=10, check=False)
        for line in parts.stdout.splitlines():
            p, nodes, cpus, mem, gres, avail = (line.split("|") + [""] * 6)[:6]
            info[f"partition {p}"] = (f"{nodes} node(s), CPUs alloc/idle/other/total {cpus}, "
                                      f"{mem} MB per node, gres {gres}, {avail}")
        info["cpus"] = str(self.cpu_count())
        return info

    def towards(self) -> Optional[Tuple[str, str]]:
        """The Slurm controller's address (``SlurmctldAddr``, else ``SlurmctldHost``'s): compute nodes
        reach it, so the interface towards it is one they can reach this process on."""
        if self._towards is None:
            text = slurm_command(["scontrol", "show", "config"], timeout=10).stdout
            addr = re.search(r"^SlurmctldAddr\s*=\s*(\S+)", text, re.M)
            host = re.search(r"^SlurmctldHost(?:\[0\])?\s*=\s*([^\s(]+)(?:\(([^)]+)\))?", text, re.M)
            if addr and addr.group(1) != "(null)":
                where = addr.group(1)
            elif host:
                where = host.group(2) or host.group(1)
            else:
                raise SlurmError("`scontrol show config` names no SlurmctldHost: cannot tell which interface "
                                 "the compute nodes reach; set the roving options host= and advertise=")
            self._towards = (where, f"the Slurm controller at {where}")
        return self._towards

    def list_jobs(self, user: Optional[str] = None) -> List[JobInfo]:
        result = slurm_command(["squeue", "-h", "-r", "-O", "JobArrayID:|,Name:|,State:|,Reason:|,Comment:|,UserName:|",
                         *([f"--user={user}"] if user is not None else [])], timeout=10)
        jobs = []
        for line in result.stdout.splitlines():
            parts = [p.strip() for p in line.split("|")]
            if len(parts) >= 6 and parts[1].startswith("roving-"):
                jobs.append(JobInfo(id=parts[0], name=parts[4], session=parts[1][len("roving-"):],
                                    state=parts[2], reason=parts[3] if parts[3] != "None" else "",
                                    user=parts[5]))
        return jobs

    def unknown_ids(self, job_ids: Iterable[str]) -> List[str]:
        """As :meth:`Backend.unknown_ids`; an array's own id (``1234`` of ``1234_5``) is known too."""
        known: Set[str] = set()
        for j in self.list_jobs():
            known.update((j.id, slurm_array.base_id(j.id)))
        return [i for i in job_ids if i not in known]
