"""The `roving` command: run (on the real Slurm), ps, logs, cancel, info, --help, bad input."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import helpers_backends as hb
import helpers_targets as h
import roving
from helpers_core import wait_until, PROGRAMS


def roving_cmd(*args, timeout=120, cwd=None):
    return subprocess.run([sys.executable, "-m", "roving.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


@pytest.mark.parametrize("sub", ["run", "ps", "logs", "cancel", "info"])
def test_every_subcommand_has_help(sub):
    r = roving_cmd(sub, "--help")
    assert r.returncode == 0 and "--backend" in r.stdout


def test_run_works_where_torch_the_pipeline_extra_is_not_installed(tmp_path):
    # `import torch` fails in the command's interpreter, as where roving was installed without [pipeline]
    (tmp_path / "blocked" / "torch").mkdir(parents=True)
    blocked = "raise ModuleNotFoundError(\"No module named 'torch'\")\n"
    (tmp_path / "blocked" / "torch" / "__init__.py").write_text(blocked)
    (tmp_path / "prog.py").write_text("import sys\nprint('ran', 'torch' in sys.modules)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "blocked"), *sys.path])}
    env.pop("ROVING_CHILD", None)
    r = subprocess.run([sys.executable, "-m", "roving", "run", "--backend", "local", "prog.py"], env=env,
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "[prog.py] ran False" in r.stdout
    blocked = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True,
                             timeout=60)
    assert "No module named 'torch'" in blocked.stderr  # the block held


def test_run_on_slurm_runs_the_program_as_a_job_whose_pool_workers_are_job_steps():
    hb.require("slurm")
    r = roving_cmd("run", "--backend", "slurm", "--cpu", "2", "cli_prog.py", "a", "b", cwd=PROGRAMS)
    assert r.returncode == 0, r.stderr
    assert "[cli_prog.py] result [1, 2, 3] backend slurm ['a', 'b']" in r.stdout
    assert "runs as slurm job" in r.stderr


def test_ps_logs_and_cancel_a_slurm_job_of_this_session():
    hb.require("slurm")
    roving.init(backend="slurm")
    p = roving.Process(target=h.print_lines, args=(["marker-line"], []))
    p.start()
    p.join(60)
    q = roving.Process(target=h.sleep_for, args=(120,), name="sleeper")
    q.start()
    assert wait_until(lambda: q.job.id in roving_cmd("ps", "--backend", "slurm").stdout, 30)
    line = [t for t in roving_cmd("ps", "--backend", "slurm").stdout.splitlines() if t.startswith(q.job.id + " ")][0]
    assert "sleeper" in line and roving.transport.session.current().tag in line
    assert "marker-line" in roving_cmd("logs", "--backend", "slurm", p.job.id).stdout
    r = roving_cmd("cancel", "--backend", "slurm", q.job.id)
    assert r.returncode == 0 and f"cancelled {q.job.id}" in r.stdout
    q.join(30)
    assert q.exitcode == -15


#: What a job's name, label or output may hold: an OSC window title, a clear screen, a bell, a CSI in its
#: one-byte form, a right-to-left override. A terminal obeys every one of them when printed raw.
HOSTILE = "evil\x1b]0;owned\x07\x1b[2J\x9b31m\u202e"
HOSTILE_SHOWN = "evil\\x1b]0;owned\\x07\\x1b[2J\\x9b31m\\u202e"


def test_ps_and_logs_show_the_escape_sequences_of_names_and_output_visibly_not_raw():
    hb.require("docker")
    # anyone who can create a container can give it roving's labels: a name of their choosing in our `ps`
    options = hb.docker_options()
    volumes = {host: {"bind": inside, "mode": mode}
               for host, inside, mode in (v.split(":") for v in options["docker_volumes"])}
    client = roving.backends.get("docker").client()
    container = client.containers.run(
        options["image"], ["/usr/bin/printf", "line one\\n\\033[2J\\033]0;owned\\007\\tline two\\n"],
        labels={"roving.session": "s\x1b[31m", "roving.name": HOSTILE}, volumes=volumes, detach=True)
    try:
        assert container.wait(timeout=60)["StatusCode"] == 0
        r = roving_cmd("ps", "--backend", "docker")
        assert r.returncode == 0, r.stderr
        (line,) = [t for t in r.stdout.splitlines() if t.startswith(container.id[:12])]
        assert HOSTILE_SHOWN in line and "s\\x1b[31m" in line
        assert not any(c in r.stdout for c in "\x1b\x07\x9b\u202e")
        r = roving_cmd("logs", "--backend", "docker", container.id[:12])
        assert r.returncode == 0, r.stderr
        # the output's own lines and tab stay as they are; its escape sequences are shown, not obeyed
        assert r.stdout == "line one\n\\x1b[2J\\x1b]0;owned\\x07\tline two\n"
    finally:
        container.remove(force=True)


def test_info_workers_shows_what_a_worker_reports_visibly_not_raw(tmp_path):
    # a worker whose host name is hostile (here: made so by a sitecustomize that only children run)
    (tmp_path / "sitecustomize.py").write_text(
        "import os, socket\n"
        "if os.environ.get('ROVING_CHILD'):\n"
        f"    socket.gethostname = lambda: {HOSTILE!r}\n")
    # (fresh interpreters: a child forked from the local backend's starter runs no sitecustomize of its own)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]), "ROVING_BACKEND": "local",
           "ROVING_LOCAL_START": "fresh"}
    env.pop("ROVING_CHILD", None)
    r = subprocess.run([sys.executable, "-m", "roving", "info", "--workers", "1"], capture_output=True, text=True,
                       timeout=240, env=env)
    assert r.returncode == 0, r.stderr
    assert f"info-worker-1 on {HOSTILE_SHOWN}: Python" in r.stdout
    assert not any(c in r.stdout for c in "\x1b\x07\x9b\u202e")


def test_info_says_which_backend_and_why():
    r = roving_cmd("info")
    assert r.returncode == 0 and "backend: local (detected: no Slurm allocation" in r.stdout
    hb.require("slurm")
    r = roving_cmd("info", "--backend", "slurm")
    assert "controller: Slurmctld(primary)" in r.stdout and "is UP" in r.stdout


def test_unknown_backend_is_a_clear_error():
    r = roving_cmd("ps", "--backend", "nope")
    assert r.returncode == 2 and "bad value 'nope' for roving option 'backend'" in r.stderr


def test_python_dash_m_roving_is_the_roving_command():
    r = subprocess.run([sys.executable, "-m", "roving", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: roving") and "info" in r.stdout
    r = subprocess.run([sys.executable, "-m", "roving", "info"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "backend: local (detected: no Slurm allocation" in r.stdout
    r = subprocess.run([sys.executable, "-m", "roving", "ps", "--backend", "nope"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "bad value 'nope' for roving option 'backend'" in r.stderr


@pytest.mark.parametrize("name", ["local", "slurm", "docker"])
def test_logs_and_cancel_of_an_unknown_job_say_so_and_fail(name):
    if name != "local":
        hb.require(name)
    r = roving_cmd("logs", "--backend", name, "999999")
    assert r.returncode == 1 and "unknown job" in r.stderr and "999999" in r.stderr, (r.stdout, r.stderr)
    assert r.stdout == ""
    r = roving_cmd("cancel", "--backend", name, "999999")
    assert r.returncode == 1 and "unknown job" in r.stderr and "999999" in r.stderr, (r.stdout, r.stderr)
    assert "cancelled" not in r.stdout


def test_cancel_with_one_unknown_id_cancels_none_of_the_list():
    hb.require("slurm")
    roving.init(backend="slurm")
    q = roving.Process(target=h.sleep_for, args=(120,), name="sleeper")
    q.start()
    try:
        assert wait_until(lambda: q.job.id in roving_cmd("ps", "--backend", "slurm").stdout, 30)
        r = roving_cmd("cancel", "--backend", "slurm", q.job.id, "999999")
        assert r.returncode == 1 and "999999" in r.stderr and "nothing was cancelled" in r.stderr
        assert q.is_alive()
    finally:
        q.kill()
        q.join(30)
