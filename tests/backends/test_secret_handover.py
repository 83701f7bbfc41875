"""The session secret reaches local and Slurm children in a private file they remove once read, never in
their environment (issue 31): ``/proc/PID/environ`` is the kernel's copy of the environment a process
started with, which removing the variable from ``os.environ`` does not clear, and Slurm keeps a job's
exported environment with the job. Runs on the real single-node Slurm (scripts/cluster/slurm.sh).
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import helpers_backends as hb
import roving
from helpers_core import TIMEOUT, finish, start
from roving.transport import session as _session

FILE_VAR = _session.SECRET_FILE_ENV.encode()


# -- targets run in children -------------------------------------------------------------------

def environ_of_this_process(_=None) -> bytes:
    with open(f"/proc/{os.getpid()}/environ", "rb") as f:
        return f.read()


def report_environ_and_a_grandchilds(out) -> None:
    out.put(environ_of_this_process())
    inner = roving.Queue()
    p = roving.Process(target=_put_environ, args=(inner,))
    p.start()
    out.put(inner.get(timeout=TIMEOUT))
    p.join(TIMEOUT)


def _put_environ(out) -> None:
    out.put(environ_of_this_process())


# -- checks ------------------------------------------------------------------------------------

def _check(environs) -> None:
    secret = _session.current().secret.hex().encode()
    assert environs
    for environ in environs:
        assert b"PATH=" in environ  # it is the environment
        assert secret not in environ
        assert _session.SECRET_ENV.encode() + b"=" not in environ
        # where it found the secret instead, removed once read; a child forked from the local backend's
        # starter has the starter's environment here, which names no file (its own came over a socket)
        for line in [v for v in environ.split(b"\0") if v.startswith(FILE_VAR + b"=")]:
            path = line.split(b"=", 1)[1].decode()
            assert not os.path.lexists(path), path


def _state_save_location() -> Path:
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30).stdout
    (line,) = [ln for ln in out.splitlines() if ln.startswith("StateSaveLocation")]
    path = Path(line.split("=", 1)[1].strip())
    assert path.is_dir(), f"Slurm's StateSaveLocation {path} is not readable here"
    return path


def _slurm_state_holds(secret: bytes) -> list:
    """Files of slurmctld's saved state (each job's environment among them) that hold ``secret``."""
    found = []
    for path in _state_save_location().rglob("*"):
        try:
            if path.is_file() and secret in path.read_bytes():
                found.append(str(path))
        except OSError:
            continue
    return found


# -- tests -------------------------------------------------------------------------------------

def test_no_local_child_grandchild_or_pool_worker_has_the_secret_in_its_proc_environ():
    out = roving.Queue()
    p = start(report_environ_and_a_grandchilds, out)
    environs = [out.get(timeout=TIMEOUT), out.get(timeout=TIMEOUT)]
    finish(p)
    assert p.exitcode == 0
    folder = roving.backends.get("local")._secrets._folder  # made by the first child's start
    assert folder
    before = set(os.listdir(folder))  # (files of children of earlier tests that never started)
    with roving.Pool(2) as pool:
        environs += pool.map(environ_of_this_process, range(4))
    _check(environs)
    # the files the forked workers read their secrets from: each removed once read
    assert set(os.listdir(folder)) <= before


@pytest.fixture
def slurm():
    hb.require("slurm")
    roving.init(backend="slurm")


def test_no_slurm_job_or_array_task_has_the_secret_in_its_environment_nor_slurm_in_its_state(slurm):
    secret = _session.current().secret.hex().encode()
    out = roving.Queue()
    p = start(report_environ_and_a_grandchilds, out)  # a job, and its own child another job
    environs = [out.get(timeout=TIMEOUT * 2), out.get(timeout=TIMEOUT * 2)]
    assert _slurm_state_holds(secret) == []  # while the jobs are there
    finish(p)
    assert p.exitcode == 0
    with roving.Pool(3) as pool:  # one job array
        environs += pool.map(environ_of_this_process, range(6))
        assert _slurm_state_holds(secret) == []
    _check(environs)


def test_the_state_check_would_see_a_secret_exported_the_old_way(slurm):
    """The check above can fail: a job given a marker in its exported environment leaves it in Slurm's state."""
    marker = os.urandom(16).hex()
    env = dict(os.environ, ROVING_TEST_MARKER=marker)
    job = subprocess.run(["sbatch", "--parsable", "--export=ALL", "--wrap", "sleep 30"], env=env,
                         capture_output=True, text=True, timeout=30)
    assert job.returncode == 0, job.stderr
    job_id = job.stdout.strip().split(";")[0]
    try:
        assert _slurm_state_holds(marker.encode()) != []
    finally:
        subprocess.run(["scancel", job_id], timeout=30)
