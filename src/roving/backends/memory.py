"""A process's memory as the kernel counts it, and a memory cgroup of its own for a local job.

What a process reads of itself (:func:`sample`): its resident set (RSS, ``/proc/self/statm``) and its
peak (``VmHWM``), and, where it runs in a memory cgroup (a container, a Slurm job with cgroup
enforcement, a pod, a local job given one), that group's usage, limit and peak: cgroup v2's
``memory.current``, ``memory.max``, ``memory.peak``; cgroup v1's ``memory.usage_in_bytes``,
``memory.limit_in_bytes``, ``memory.max_usage_in_bytes``. Which group is found from
``/proc/self/cgroup`` and the mounts in ``/proc/self/mountinfo``. Linux only: elsewhere every figure is
None. Cheap (a few small reads): a pool worker reads it with each heartbeat.

:class:`MemoryGroup` is a cgroup made for one local job (``memory`` asked of the local backend): its
limit, the job's process moved in at start, the kernel's OOM-kill count read once the job ended (cgroup
v2: ``oom_kill`` of ``memory.events``; v1: of ``memory.oom_control``), removed when the job is forgotten.
It needs a writable memory hierarchy (root, or a delegated v2 subtree); :func:`make_group` says why not
where there is none.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import secrets
from typing import Dict, List, Optional, Tuple

log = logging.getLogger(__name__)

#: cgroup v1 reports "no limit" as a page counter's largest value (about 2**63, rounded to a page).
_V1_UNLIMITED = 1 << 62
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclasses.dataclass(frozen=True)
class MemorySample:
    """One reading of a process's memory, in bytes; None where it is not known (no such file, no
    cgroup, no limit)."""

    rss: Optional[int] = None  #: resident set now
    rss_peak: Optional[int] = None  #: the process's largest resident set so far (VmHWM)
    cgroup_usage: Optional[int] = None  #: its memory cgroup's usage now (page cache included)
    cgroup_limit: Optional[int] = None  #: its memory cgroup's limit (None: none)
    cgroup_peak: Optional[int] = None  #: its memory cgroup's largest usage so far

    def peak(self) -> Optional[int]:
        """The process's own largest resident set (its cgroup may hold other processes too: a machine's
        or a session's group; the group's peak is :attr:`cgroup_peak`)."""
        known = [v for v in (self.rss_peak, self.rss) if v is not None]
        return max(known) if known else None


@dataclasses.dataclass(frozen=True)
class CgroupDir:
    """A memory cgroup's folder and its hierarchy's version (1 or 2)."""

    path: str
    version: int


def _read(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return f.read().decode("ascii", "replace").strip()
    except OSError:
        return None


def _number(text: Optional[str], version: int) -> Optional[int]:
    if text is None or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if version == 1 and value >= _V1_UNLIMITED else value


def rss() -> Optional[int]:
    """This process's resident set in bytes (None off Linux)."""
    text = _read("/proc/self/statm")
    if text is None:
        return None
    try:
        return int(text.split()[1]) * _PAGE
    except (IndexError, ValueError):
        return None


def _rss_peak() -> Optional[int]:
    text = _read("/proc/self/status")
    for line in (text or "").splitlines():
        if line.startswith("VmHWM:"):
            parts = line.split()
            return int(parts[1]) * 1024 if len(parts) > 1 and parts[1].isdigit() else None
    return None


def _mounts(mountinfo: str) -> Dict[str, str]:
    """Where each memory hierarchy is mounted: ``{"v2": path, "v1": path}`` from mountinfo's text."""
    out: Dict[str, str] = {}
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] == "cgroup2":
            out.setdefault("v2", fields[4])
        elif tail[0] == "cgroup" and "memory" in tail[2].split(","):
            out.setdefault("v1", fields[4])
    return out


def find_cgroup(proc_cgroup: str, mountinfo: str) -> Optional[CgroupDir]:
    """The memory cgroup that ``/proc/self/cgroup``'s text ``proc_cgroup`` names, with the mounts of
    ``mountinfo``'s text: the v1 memory controller's group where there is one, else the v2 group when its
    hierarchy has the memory controller. A group's path missing under its mount (a container that
    mounts its own group as the root) is the mount itself. None: no memory cgroup."""
    mounts = _mounts(mountinfo)
    v1 = v2 = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    for version, rel, key, probe in ((1, v1, "v1", "memory.usage_in_bytes"), (2, v2, "v2", "memory.current")):
        if rel is None or key not in mounts:
            continue
        for path in (os.path.join(mounts[key], rel.lstrip("/")), mounts[key]):
            if os.path.exists(os.path.join(path, probe)):
                return CgroupDir(os.path.normpath(path), version)
    return None


_own: Optional[Tuple[Optional[CgroupDir]]] = None  # this process's group, found once


def own_cgroup() -> Optional[CgroupDir]:
    """This process's memory cgroup (found once: a process does not change group)."""
    global _own
    if _own is None:
        text, mounts = _read("/proc/self/cgroup"), _read("/proc/self/mountinfo")
        _own = (find_cgroup(text, mounts) if text is not None and mounts is not None else None,)
    return _own[0]


def read_cgroup(group: CgroupDir) -> Tuple[Optional[int], Optional[int], Optional[int]]:
    """A group's (usage, limit, peak) in bytes (None where not known)."""
    names = (("memory.current", "memory.max", "memory.peak") if group.version == 2 else
             ("memory.usage_in_bytes", "memory.limit_in_bytes", "memory.max_usage_in_bytes"))
    usage, limit, peak = (_number(_read(os.path.join(group.path, n)), group.version) for n in names)
    return usage, limit, peak


def oom_kills(group: CgroupDir) -> Optional[int]:
    """How many processes the kernel's OOM killer ended in ``group`` (None: the kernel does not say)."""
    name = "memory.events" if group.version == 2 else "memory.oom_control"
    for line in (_read(os.path.join(group.path, name)) or "").splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def sample() -> MemorySample:
    """This process's memory now (see the module docstring)."""
    group = own_cgroup()
    usage = limit = peak = None
    if group is not None:
        usage, limit, peak = read_cgroup(group)
    return MemorySample(rss(), _rss_peak(), usage, limit, peak)


def describe(size: Optional[int]) -> str:
    """``size`` bytes for a person: ``"1.5 GiB"``, ``"300 MiB"``; ``"unknown"`` for None."""
    if size is None:
        return "unknown"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" or value >= 100 else f"{value:.3g} {unit}"
        value /= 1024
    return f"{value:.3g} TiB"


class MemoryGroup:
    """A memory cgroup of one local job, a child of this process's own (see the module docstring)."""

    def __init__(self, group: CgroupDir, limit: int) -> None:
        self.group, self.limit = group, limit

    def add(self, pid: int) -> None:
        """Move process ``pid`` (the job, just started) into the group. OSError if the kernel refuses."""
        with open(os.path.join(self.group.path, "cgroup.procs"), "w") as f:
            f.write(str(pid))

    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer ended a process of the group."""
        return bool(oom_kills(self.group))

    def read(self) -> Tuple[Optional[int], Optional[int], Optional[int]]:
        """The group's (usage, limit, peak), as :func:`read_cgroup`."""
        return read_cgroup(self.group)

    def remove(self) -> None:
        """Remove the group (its processes have ended); nothing if it is gone or still busy."""
        try:
            os.rmdir(self.group.path)
        except OSError:
            pass


def make_group(limit: int, name: str = "") -> Tuple[Optional[MemoryGroup], str]:
    """A new memory cgroup limited to ``limit`` bytes (swap included, so that the limit is the job's
    memory), under this process's own: (the group, "") or (None, why there is none)."""
    parent = own_cgroup()
    if parent is None:
        return None, "this process is in no memory cgroup that it can see (/proc/self/cgroup)"
    path = os.path.join(parent.path, f"roving-{name or 'job'}-{secrets.token_hex(4)}")
    try:
        if parent.version == 2:
            _enable_v2_memory(parent.path)
        os.mkdir(path, 0o755)
    except OSError as exc:
        return None, f"cannot make a memory cgroup under {parent.path}: {exc}"
    group = CgroupDir(path, parent.version)
    files: List[Tuple[str, str]] = ([("memory.max", str(limit)), ("memory.swap.max", "0")] if parent.version == 2
                                    else [("memory.limit_in_bytes", str(limit)),
                                          ("memory.memsw.limit_in_bytes", str(limit))])
    for i, (fname, value) in enumerate(files):
        try:
            with open(os.path.join(path, fname), "w") as f:
                f.write(value)
        except OSError as exc:
            if i == 0:  # the limit itself: without it the group is no use
                os.rmdir(path)
                return None, f"cannot set {fname} of {path}: {exc}"
            # no swap accounting: the limit holds for memory alone
    return MemoryGroup(group, limit), ""


def _enable_v2_memory(path: str) -> None:
    """Have the memory controller in the children of v2 group ``path`` (OSError if the kernel refuses:
    a group that holds processes cannot give controllers to children, its own processes among them)."""
    control = _read(os.path.join(path, "cgroup.subtree_control")) or ""
    if "memory" not in control.split():
        with open(os.path.join(path, "cgroup.subtree_control"), "w") as f:
            f.write("+memory")
