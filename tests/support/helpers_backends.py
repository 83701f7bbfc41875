"""What the backend tests share: options per backend, checks that the real daemons run, outside kills.

Slurm and Docker are real here: scripts/cluster/slurm.sh and scripts/cluster/docker.sh (run by
scripts/test.sh) install and start them. A test that needs one that is not running fails, loudly.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

#: The image scripts/cluster/docker.sh builds: a minimal root filesystem; the host's /usr and Python
#: installation are mounted into each container read-only, so containers run this very Python and roving.
DOCKER_IMAGE = os.environ.get("SETUP_TEST_IMAGE", "roving-test:latest")


def docker_options() -> dict:
    prefixes = sorted({sys.base_prefix, sys.prefix})
    return {"image": DOCKER_IMAGE,
            "docker_volumes": ["/usr:/usr:ro", *(f"{p}:{p}:ro" for p in prefixes)]}


OPTIONS = {"local": {}, "slurm": {}, "docker": docker_options()}


def require(name: str) -> None:
    """Fail the test, naming the fix, when the backend's daemon is not there."""
    if name == "slurm":
        try:
            out = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired) as exc:
            out = str(exc)
        if "UP" not in out:
            pytest.fail(f"Slurm is not running here ({out.strip()!r}): run `bash scripts/cluster/slurm.sh` "
                        "(scripts/test.sh does)")
    elif name == "docker":
        try:
            ok = subprocess.run(["docker", "image", "inspect", DOCKER_IMAGE], capture_output=True,
                                timeout=20).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if not ok:
            pytest.fail(f"the Docker engine or the image {DOCKER_IMAGE} is not there: run "
                        "`bash scripts/cluster/docker.sh` (scripts/test.sh does)")


def kill_from_outside(backend: str, proc) -> None:
    """Kill a process's job with the cluster's own tool, as an operator would: scancel, docker kill."""
    if backend == "local":
        os.kill(proc.pid, signal.SIGKILL)
    elif backend == "slurm":
        subprocess.run(["scancel", proc.job.id], check=True, timeout=30)
    elif backend == "docker":
        subprocess.run(["docker", "kill", proc.job.id], check=True, timeout=30, capture_output=True)
    else:
        raise ValueError(backend)


def session_jobs_alive(backend: str, job_ids) -> list:
    """The jobs among ``job_ids`` that the cluster still runs or has pending."""
    if backend == "slurm":
        out = subprocess.run(["squeue", "-h", "-t", "PD,R,CG,CF,S", "-j", ",".join(job_ids), "-o", "%i"],
                             capture_output=True, text=True, timeout=30).stdout
        return [j for j in out.split() if j in job_ids]
    if backend == "docker":
        out = subprocess.run(["docker", "ps", "-a", "-q", "--no-trunc"], capture_output=True, text=True,
                             timeout=30).stdout
        return [j for j in out.split() if j in job_ids]
    raise ValueError(backend)


@pytest.fixture(params=["local", "slurm", "docker"])
def backend(request):
    """Run the test on each backend with a real daemon here; fails (not skips) when one is not running.

    Test modules import it (``from helpers_backends import backend``); it runs after conftest's
    autouse fixture that resets roving's configuration.
    """
    import roving

    name = request.param
    require(name)
    roving.init(backend=name, **OPTIONS[name])
    return name
