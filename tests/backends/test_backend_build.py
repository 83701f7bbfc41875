"""`roving run --backend docker --build`: the image is built from ./Dockerfile with the project in it, the
program runs in it, and a configured registry that cannot be reached is a quick, clear error.

The Dockerfile starts FROM the locally imported test image (scripts/cluster/docker.sh), so nothing is
pulled. The build copies the project folder to /baked in the image; the docker backend bind-mounts the
working directory over its own path, so only /baked shows what the build put in the image.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

import helpers_backends as hb

SCRIPT = """\
import sys
with open("/baked/marker.txt") as f:
    print("marker from the image:", f.read().strip(), "args", sys.argv[1:])
"""


def _roving(*args, cwd, timeout=60):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROVING_")}
    return subprocess.run([sys.executable, "-m", "roving.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


@pytest.fixture
def project(tmp_path):
    """A project folder with a Dockerfile FROM the test image, a script, a marker and roving.toml."""
    hb.require("docker")
    name = f"buildproj-{uuid.uuid4().hex[:8]}"
    root = tmp_path / name
    root.mkdir()
    (root / "Dockerfile").write_text(f"FROM {hb.DOCKER_IMAGE}\nARG WORKDIR=/app\nCOPY . /baked/\n")
    (root / "job.py").write_text(SCRIPT)
    token = uuid.uuid4().hex
    (root / "marker.txt").write_text(token + "\n")
    volumes = hb.docker_options()["docker_volumes"]
    (root / "roving.toml").write_text("docker_volumes = [" + ", ".join(f'"{v}"' for v in volumes) + "]\n")
    tags = []
    yield root, name, token, tags
    for tag in tags:
        subprocess.run(["docker", "image", "rm", "-f", tag], capture_output=True, timeout=60)


def test_build_makes_an_image_of_the_project_and_runs_the_program_in_it(project):
    root, name, token, tags = project
    tag = f"roving-{name}:latest"
    tags.append(tag)
    assert subprocess.run(["docker", "image", "inspect", tag], capture_output=True).returncode != 0
    r = _roving("run", "--backend", "docker", "--build", "job.py", "x", "y", cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"building {tag}" in r.stderr
    assert subprocess.run(["docker", "image", "inspect", tag], capture_output=True).returncode == 0
    # the job ran in the built image (only the image has /baked) and its output reached the terminal
    assert f"[job.py] marker from the image: {token} args ['x', 'y']" in r.stdout, r.stdout + r.stderr
    assert "runs as docker job" in r.stderr
    # the image holds the project's files, independent of the job's bind mount
    ls = subprocess.run(["docker", "run", "--rm", "--network", "host", "-v", "/usr:/usr:ro", tag,
                         "ls", "/baked"], capture_output=True, text=True, timeout=30)
    assert set(ls.stdout.split()) >= {"Dockerfile", "job.py", "marker.txt", "roving.toml"}, ls.stderr


def test_build_with_an_unreachable_registry_fails_quickly_naming_it(project):
    root, name, token, tags = project
    with socket.socket() as s:  # a free port on 127.0.0.1 that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    registry = f"127.0.0.1:{port}"
    tags.append(f"{registry}/roving-{name}:latest")
    (root / "roving.toml").write_text((root / "roving.toml").read_text() + f'registry = "{registry}"\n')
    start = time.monotonic()
    r = _roving("run", "--backend", "docker", "--build", "job.py", cwd=root, timeout=60)
    took = time.monotonic() - start
    assert r.returncode == 2, r.stdout + r.stderr
    assert "roving: error:" in r.stderr and registry in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "runs as docker job" not in r.stderr and "marker from the image" not in r.stdout
    assert took < 30, took


def test_a_failing_build_is_a_clear_error_and_an_odd_folder_name_still_makes_a_valid_tag(tmp_path):
    hb.require("docker")
    suffix = uuid.uuid4().hex[:8]
    root = tmp_path / f"My Proj+{suffix}"
    root.mkdir()
    (root / "Dockerfile").write_text(f"FROM {hb.DOCKER_IMAGE}\nCOPY not-there /x\n")
    (root / "job.py").write_text("print('never')\n")
    r = _roving("run", "--backend", "docker", "--build", "job.py", cwd=root)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"building roving-my-proj-{suffix}:latest" in r.stderr
    assert "roving: error: the build of" in r.stderr and "not-there" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "never" not in r.stdout
