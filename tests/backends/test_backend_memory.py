"""roving.backends.memory: a process's memory and its cgroup's as the kernel writes them, a local job in a
memory cgroup of its own, and each backend's word that a job was killed for memory (the local cgroup's
oom_kill, Slurm's OUT_OF_MEMORY state as squeue prints it, a pod's OOMKilled reason)."""
from __future__ import annotations

import os
import subprocess

import pytest

import helpers_memory as hm
import roving
from roving import backends
from roving.backends import memory
from roving.backends.local import backend as local
from roving.backends.slurm import backend as slurm
from roving.backends.base import JobSession, JobSpec, JobState, Resources

T = 60


def _tree(tmp_path, files):
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _mountinfo(v1=None, v2=None):
    lines = []
    if v1:
        lines.append(f"35 31 0:32 / {v1} rw,relatime - cgroup cgroup rw,memory")
    if v2:
        lines.append(f"41 31 0:38 / {v2} rw,relatime - cgroup2 cgroup2 rw")
    return "\n".join(lines)


def test_a_v2_group_is_found_from_proc_cgroup_and_its_usage_limit_peak_and_oom_kills_read(tmp_path):
    root = tmp_path / "v2"
    _tree(root, {"job/memory.current": "1048576\n", "job/memory.max": "268435456\n", "job/memory.peak": "2097152\n",
                 "job/memory.events": "low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\noom_group_kill 0\n"})
    group = memory.find_cgroup("0::/job\n", _mountinfo(v2=str(root)))
    assert group == memory.CgroupDir(str(root / "job"), 2)
    assert memory.read_cgroup(group) == (1048576, 268435456, 2097152)
    assert memory.oom_kills(group) == 2


def test_v2_max_is_no_limit_and_a_missing_peak_is_unknown(tmp_path):
    root = tmp_path / "v2"
    _tree(root, {"a/memory.current": "4096\n", "a/memory.max": "max\n", "a/memory.events": "oom_kill 0\n"})
    group = memory.find_cgroup("0::/a\n", _mountinfo(v2=str(root)))
    assert memory.read_cgroup(group) == (4096, None, None)
    assert memory.oom_kills(group) == 0


def test_a_v1_memory_group_is_found_and_its_unlimited_value_is_no_limit(tmp_path):
    root = tmp_path / "memory"
    _tree(root, {"docker/abc/memory.usage_in_bytes": "8192\n",
                 "docker/abc/memory.limit_in_bytes": "9223372036854771712\n",
                 "docker/abc/memory.max_usage_in_bytes": "16384\n",
                 "docker/abc/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n"})
    text = "5:devices:/docker/abc\n4:memory:/docker/abc\n0::/docker/abc\n"
    group = memory.find_cgroup(text, _mountinfo(v1=str(root), v2=str(tmp_path / "unified")))
    assert group == memory.CgroupDir(str(root / "docker/abc"), 1)
    assert memory.read_cgroup(group) == (8192, None, 16384)
    assert memory.oom_kills(group) == 1


def test_a_container_that_mounts_its_own_group_as_the_root_is_read_at_the_mount(tmp_path):
    root = tmp_path / "memory"  # what /proc/self/cgroup names is not under the mount: the mount is the group
    _tree(root, {"memory.usage_in_bytes": "100\n", "memory.limit_in_bytes": "67108864\n",
                 "memory.max_usage_in_bytes": "200\n"})
    group = memory.find_cgroup("4:memory:/docker/0aafb5f1\n", _mountinfo(v1=str(root)))
    assert group == memory.CgroupDir(str(root), 1)
    assert memory.read_cgroup(group) == (100, 67108864, 200)


def test_no_memory_cgroup_is_none(tmp_path):
    assert memory.find_cgroup("0::/\n", _mountinfo()) is None
    assert memory.find_cgroup("0::/x\n", _mountinfo(v2=str(tmp_path))) is None  # no memory controller there


def test_this_processs_sample_has_its_resident_set_and_its_peak_growing_with_what_it_holds():
    before = memory.sample()
    block = hm.touched(64)
    after = memory.sample()
    assert before.rss is not None and after.rss is not None and after.rss_peak is not None
    assert after.rss - before.rss >= 60 * hm.MiB
    assert after.rss_peak >= after.rss and after.peak() >= after.rss
    del block


def test_sizes_are_described_in_binary_units():
    assert [memory.describe(v) for v in (None, 512, 96 * 2**20, 3 * 2**29, 5 * 2**40)] == [
        "unknown", "512 B", "96 MiB", "1.5 GiB", "5 TiB"]


def _spec(code, mib_limit):
    session = JobSession("t", "NO_SECRET_HERE", "NO_SECRET_FILE_HERE")
    return JobSpec("memjob", ["python3", "-c", code], dict(os.environ), os.getcwd(), session,
                   Resources(memory=mib_limit * hm.MiB), output="off")


def test_a_local_job_asking_for_memory_runs_in_a_cgroup_with_that_limit_and_its_oom_kill_is_reported():
    backend = local.LocalBackend()
    within = backend.create_job(_spec("b = bytearray(8 * 2**20)\nfor i in range(0, len(b), 4096): b[i] = 1", 96))
    group = backend._groups.get(within.id)
    assert group is not None, "no memory cgroup could be made for a local job on this machine"
    assert group.read()[1] == 96 * hm.MiB
    assert backend.wait(within, T) == 0
    assert backend.job_status(within).out_of_memory is False
    hog = backend.create_job(_spec("b = bytearray(400 * 2**20)\nfor i in range(0, len(b), 4096): b[i] = 1", 96))
    assert backend.wait(hog, T) == -9
    status = backend.job_status(hog)
    assert status.state is JobState.EXITED and status.out_of_memory, status
    assert status.memory_peak is not None and 80 * hm.MiB <= status.memory_peak <= 96 * hm.MiB
    paths = [backend._groups[j.id].group.path for j in (within, hog)]
    for job in (within, hog):
        backend.forget(job)
    assert not any(os.path.exists(p) for p in paths), "the jobs' cgroups are removed once forgotten"


def _squeue_says(monkeypatch, line):
    real = slurm._slurm

    def fake(args, *a, **k):
        if args[0] == "squeue":
            return subprocess.CompletedProcess(args, 0, line + "\n", "")
        return real(args, *a, **k)

    monkeypatch.setattr(slurm, "_slurm", fake)


@pytest.mark.parametrize("state, raw, oom, code", [
    ("OUT_OF_MEMORY", "0", True, -9),
    ("OUT_OF_MEMORY", "9", True, -9),  # killed by signal 9, as slurmstepd reports it
    ("FAILED", "256", False, 1),
    ("CANCELLED", "0", False, -15),
])
def test_slurms_out_of_memory_state_as_squeue_prints_it_is_an_end_for_memory(monkeypatch, state, raw, oom, code):
    # This Slurm runs TaskPlugin=task/none (no cgroup enforcement, shared by every test): no job of it can
    # end OUT_OF_MEMORY, so the mapping is tested on the lines squeue prints for such a job.
    _squeue_says(monkeypatch, f"4242|{state}|None|{raw}|4242|")
    backend = slurm.SlurmBackend()
    status = backend.job_status(backends.Job(backend, "4242"))
    assert (status.state, status.exitcode, status.out_of_memory) == (JobState.EXITED, code, oom)
    assert status.reason.startswith(state)


def test_roving_exposes_one_error_type_for_memory_a_worker_lost_error():
    assert issubclass(roving.OutOfMemoryError, roving.WorkerLostError)
    err = roving.OutOfMemoryError("item 0 of f ran out of memory", 5, 7)
    import pickle

    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.peak, back.limit) == (str(err), 5, 7)
