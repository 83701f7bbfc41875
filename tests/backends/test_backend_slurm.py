"""The slurm backend on the real single-node Slurm that scripts/cluster/slurm.sh starts: resources and
options reach sbatch, bad requests fail within seconds with Slurm's reason, pending jobs say why."""
from __future__ import annotations

import logging
import subprocess
import time

import pytest

import helpers_backends as hb
import helpers_targets as h
import roving
from helpers_core import wait_until
from roving import backends
from roving.transport import session as _session
from roving.backends.slurm import SlurmBackend


@pytest.fixture(autouse=True)
def _slurm():
    hb.require("slurm")


def _job_fields(job_id):
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def test_resources_and_configured_options_reach_the_slurm_job():
    roving.init(backend="slurm", cpu=2, memory="300M", slurm_time="5:00", slurm_options="--nice=7",
                slurm_partition="debug")
    p = roving.Process(target=h.sleep_for, args=(60,), name="sized")
    p.start()
    f = _job_fields(p.job.id)
    assert f["NumCPUs"] == "2" and f["MinMemoryNode"] == "300M" and f["TimeLimit"] == "00:05:00"
    assert f["Nice"] == "7" and f["Partition"] == "debug"
    assert f["JobName"] == f"roving-{_session.current().tag}" and f["Comment"] == "sized"
    p.kill()
    p.join(30)


@pytest.mark.parametrize("options, words", [
    ({"memory": "10T"}, "Memory specification can not be satisfied"),
    ({"gpu": 2}, "Invalid generic resource"),
    ({"slurm_partition": "nope"}, "invalid partition"),
])
def test_requests_the_cluster_cannot_meet_fail_at_start_with_slurms_reason(options, words):
    roving.init(backend="slurm", **options)
    t0 = time.monotonic()
    with pytest.raises(OSError, match=words):
        roving.Process(target=h.return_normally).start()
    assert time.monotonic() - t0 < 10


def test_unreachable_controller_is_an_error_within_seconds(tmp_path, monkeypatch):
    conf = open("/etc/slurm/slurm.conf").read().replace("SlurmctldPort=6817", "SlurmctldPort=6999")
    (tmp_path / "slurm.conf").write_text(conf)
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
    roving.init(backend="slurm")
    backend = SlurmBackend()
    t0 = time.monotonic()
    with pytest.raises(OSError, match="Slurm controller is not reachable"):
        backend._check_controller()
    assert time.monotonic() - t0 < 10


def _queue_is_empty() -> bool:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=10)
    return out.returncode == 0 and not out.stdout.strip()


def test_a_pending_job_reports_slurms_reason_and_is_logged(caplog):
    # The test needs the whole node: earlier tests' jobs (cancelled as their parents end) must be gone.
    assert wait_until(_queue_is_empty, 60), "jobs of earlier tests are still in the Slurm queue"
    roving.init(backend="slurm", cpu=32, pending_warning=0.5)
    procs = [roving.Process(target=h.sleep_for, args=(60,)) for _ in range(2)]
    for p in procs:
        p.start()
    backend = procs[0]._backend
    statuses = lambda: [backend.job_status(p.job) for p in procs]
    assert wait_until(lambda: [s.state for s in statuses()].count(backends.JobState.RUNNING) == 1, 30)
    pending = [s for s in statuses() if s.state is backends.JobState.PENDING]
    assert len(pending) == 1 and pending[0].reason in ("Resources", "Priority")
    with caplog.at_level(logging.WARNING, logger="roving.backends.slurm"):
        assert wait_until(lambda: (backend.job_status(procs[0].job), backend.job_status(procs[1].job))
                          and "has been pending" in caplog.text, 10)
    assert "Slurm's reason" in caplog.text
    for p in procs:
        p.kill()
        p.join(30)


def _mode(path):
    import os
    return os.stat(path).st_mode & 0o777


@pytest.mark.parametrize("child_output", ["prefix", "files"])
def test_slurm_output_folders_and_files_are_private_and_the_job_keeps_the_callers_umask(child_output, tmp_path):
    import glob
    import os

    log_dir = tmp_path / "new" / "logs"
    roving.init(backend="slurm", child_output=child_output, log_dir=str(log_dir))
    out = roving.Queue()
    p = roving.Process(target=h.make_file_and_report_mode, args=(str(tmp_path / "made.txt"), out), name="modes")
    p.start()
    made = out.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0
    if child_output == "prefix":
        folder = os.path.join(os.path.expanduser("~/.roving/slurm"), _session.current().tag)
    else:
        folder = str(log_dir)
        assert _mode(tmp_path / "new") == 0o700  # a missing parent is made private too
    files = glob.glob(os.path.join(folder, "modes*"))
    assert files, os.listdir(folder)
    assert _mode(folder) == 0o700
    assert all(_mode(f) == 0o600 for f in files), [(f, oct(_mode(f))) for f in files]
    umask = os.umask(0o022)
    os.umask(umask)
    assert made == 0o666 & ~umask  # what the job itself creates follows the caller's umask, not 077


def test_cancel_all_lists_only_this_users_jobs():
    """A job of user nobody (submitted as root with sbatch --uid) is a roving job of another user; this
    user's `roving cancel --all` must not touch it. Its list comes from the real squeue; the cancel
    itself is recorded, not sent: other sessions of this user (other test runs on this machine) have
    roving jobs too, which a real --all would cancel."""
    from roving import cli

    other = subprocess.run(["sbatch", "--uid=nobody", "--parsable", "--job-name=roving-anotherusers",
                            "--chdir=/tmp", "--output=/dev/null", "--wrap", "sleep 120"],
                           capture_output=True, text=True, timeout=30)
    assert other.returncode == 0, other.stderr
    other_id = other.stdout.strip().split(";")[0]
    roving.init(backend="slurm")
    p = roving.Process(target=h.sleep_for, args=(120,), name="mine")
    p.start()
    try:
        backend = backends.get("slurm")
        assert wait_until(lambda: {p.job.id, other_id} <= {j.id for j in backend.list_jobs()}, 30)
        mine = {j.id: j for j in backend.list_jobs(user=backends.base.user_name())}
        assert p.job.id in mine and other_id not in mine and mine[p.job.id].user == backends.base.user_name()
        theirs = {j.id for j in backend.list_jobs(user="nobody")}
        assert other_id in theirs and p.job.id not in theirs
        cancelled = []
        real_cancel = backend.cancel_ids
        backend.cancel_ids = lambda ids: cancelled.extend(ids)
        try:
            assert cli.main(["cancel", "--all", "--backend", "slurm"]) == 0
        finally:
            backend.cancel_ids = real_cancel
        assert p.job.id in cancelled and other_id not in cancelled
    finally:
        subprocess.run(["scancel", other_id], timeout=30)
        p.kill()
        p.join(30)


def _program(*args, timeout=180):
    import sys
    from helpers_core import PROGRAMS

    return subprocess.Popen([sys.executable, str(PROGRAMS / "slurm_cancel_lines.py"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_pool_that_ends_normally_shows_no_cancelled_line_of_its_workers_jobs():
    proc = _program("pool")
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    assert out.count("result [1, 2, 3]") == 2 and "done" in out
    assert "CANCELLED" not in out + err, out + err


def test_a_job_cancelled_from_outside_still_shows_slurms_cancelled_line(tmp_path):
    id_file = tmp_path / "job"
    proc = _program("sleeper", str(id_file))
    try:
        assert wait_until(lambda: id_file.exists() or proc.poll() is not None, 60), "the parent did not start"
        assert id_file.exists(), proc.communicate(timeout=30)
        job_id = id_file.read_text()
        assert wait_until(lambda: _job_fields(job_id).get("JobState") == "RUNNING", 60)
        subprocess.run(["scancel", job_id], check=True, timeout=30)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert "exitcode -15" in out, (out, err)
    assert "[sleeper] slurmstepd" in err and f"JOB {job_id} ON" in err and "CANCELLED" in err, (out, err)
