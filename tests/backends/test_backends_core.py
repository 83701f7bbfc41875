"""Process, Queue, Pipe and Pool on every backend with a real daemon here: local, slurm, docker.

A representative subset of the core tests, parametrised by the ``backend`` fixture (tests/conftest.py):
Slurm and Docker are the real daemons that scripts/test.sh installs and starts.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import helpers_backends as hb
from helpers_backends import backend  # noqa: F401  (the fixture)
import helpers_pool as hp
import helpers_targets as h
import roving
from roving import backends
from helpers_core import read_log, run_script, wait_until, PROGRAMS, ROOT

T = 60


def test_process_runs_its_target_and_sends_the_result_through_a_queue(backend):
    q = roving.Queue()
    p = roving.Process(target=h.put_value, args=(q, {"answer": 42, "backend": backend}))
    p.start()
    assert q.get(timeout=T) == {"answer": 42, "backend": backend}
    p.join(T)
    assert p.exitcode == 0
    assert roving.active_children() == []


def test_exit_codes_of_sys_exit_and_of_an_exception_are_multiprocessings(backend):
    procs = [roving.Process(target=h.exit_with, args=(3,)), roving.Process(target=h.raise_value_error, args=("x",))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(T)
    assert [p.exitcode for p in procs] == [3, 1]


def test_terminate_gives_minus_sigterm_and_kill_gives_minus_sigkill(backend):
    procs = [roving.Process(target=h.sleep_for, args=(120,)) for _ in range(2)]
    for p in procs:
        p.start()
    assert wait_until(lambda: all(p.is_alive() for p in procs), T)
    time.sleep(1)  # past the child's interpreter start-up
    procs[0].terminate()
    procs[1].kill()
    for p in procs:
        p.join(T)
    assert [p.exitcode for p in procs] == [-signal.SIGTERM, -signal.SIGKILL]


def test_duplex_pipe_echoes_and_reader_sees_eof_after_the_child_exits(backend):
    parent_end, child_end = roving.Pipe()
    p = roving.Process(target=h.pipe_echo, args=(child_end, 3))
    p.start()
    child_end.close()
    for i in range(3):
        parent_end.send(("ping", i))
        assert parent_end.recv() == (("ping", i), "echo")
    p.join(T)
    assert p.exitcode == 0
    r, w = roving.Pipe(duplex=False)
    p = roving.Process(target=h.send_then_exit, args=(w, [1, 2, 3]))
    p.start()
    w.close()
    assert [r.recv() for _ in range(3)] == [1, 2, 3]
    with pytest.raises(EOFError):
        r.recv()
    p.join(T)


def test_items_of_several_child_producers_all_arrive_in_order_per_producer(backend):
    q = roving.Queue()
    procs = [roving.Process(target=h.put_many, args=(q, 1000 * i, 50)) for i in range(3)]
    for p in procs:
        p.start()
    got = [q.get(timeout=T) for _ in range(150)]
    for i in range(3):
        mine = [x for x in got if 1000 * i <= x < 1000 * i + 50]
        assert mine == list(range(1000 * i, 1000 * i + 50))
    for p in procs:
        p.join(T)
        assert p.exitcode == 0


def test_child_output_is_prefixed_on_the_terminal_and_written_to_log_files(backend, capfd, tmp_path):
    p = roving.Process(target=h.print_lines, args=(["out one", "out two"], ["err one"]), name="talker")
    p.start()
    p.join(T)
    assert p.exitcode == 0
    seen = {"out": "", "err": ""}

    def printed():
        out, err = capfd.readouterr()
        seen["out"] += out
        seen["err"] += err
        return "[talker] out two" in seen["out"] and "[talker] err one" in seen["err"]

    assert wait_until(printed, 15), seen
    assert "[talker] out one\n[talker] out two" in seen["out"]
    roving.init(backend=backend, child_output="files", log_dir=str(tmp_path / "logs"), **hb.OPTIONS[backend])
    p = roving.Process(target=h.print_lines, args=(["to the file"], ["and err"]), name="filed")
    p.start()
    p.join(T)
    log = read_log(tmp_path / "logs", "filed")
    assert "to the file" in log and "and err" in log


def test_pool_map_imap_and_apply_give_correct_results(backend):
    with roving.Pool(4) as pool:
        assert pool.map(hp.square, range(200), chunksize=5) == [x * x for x in range(200)]
        assert sorted(pool.imap_unordered(hp.square, range(50))) == [x * x for x in range(50)]
        assert pool.apply(hp.add, (2, 3)) == 5
        with pytest.raises(ValueError, match="boom"):
            pool.apply(hp.raise_value_error, ("boom",))


def test_worker_job_killed_from_outside_during_a_pool_map_does_not_change_the_result(backend):
    with roving.Pool(3) as pool:
        assert wait_until(lambda: sum(1 for w in pool._workers.values() if w.ident is not None) == 3, T)
        r = pool.starmap_async(hp.sleep_square, [(x, 0.01) for x in range(400)], chunksize=4)
        time.sleep(1.0)
        busy = [w for w in pool._workers.values() if w.units and w.proc.is_alive()]
        assert busy, "no worker was busy"
        hb.kill_from_outside(backend, busy[0].proc)  # scancel / docker kill / SIGKILL
        assert r.get(T * 2) == [x * x for x in range(400)]
        assert busy[0].proc.exitcode is not None and busy[0].proc.exitcode < 0


@pytest.mark.parametrize("name", ["local", "slurm", "docker"])
def test_a_child_never_joined_runs_to_its_end_because_the_parents_exit_joins_it(name):
    """As in multiprocessing, a program may end without joining a non-daemonic child: its exit joins it.
    The child must still find its session secret then (its file is removed only after that join)."""
    if name != "local":
        hb.require(name)
    run = run_script(PROGRAMS / "unjoined_child.py", name, json.dumps(hb.OPTIONS[name]), cwd=str(ROOT),
                     timeout=180)
    assert run.returncode == 0, run.stderr
    assert "[Unjoined] the unjoined child ran to its end" in run.stdout, (run.stdout, run.stderr)
    assert "session secret" not in run.stdout + run.stderr


@pytest.mark.parametrize("name", ["slurm", "docker"])
def test_every_job_of_a_parent_killed_with_sigkill_is_cancelled(name, tmp_path):
    hb.require(name)
    out = tmp_path / "jobs.txt"
    options = hb.OPTIONS[name]
    env = dict(os.environ)
    if name == "slurm":  # its secret files' folder is under ~/.roving/secrets: here, one of this test's own
        env["HOME"] = str(tmp_path / "home")
    parent = subprocess.Popen([sys.executable, str(PROGRAMS / "backend_parent.py"), str(out), name,
                               "3", json.dumps(options)], cwd=str(ROOT), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if not wait_until(lambda: out.exists() or parent.poll() is not None, 120):
            pytest.fail("the parent did not start its jobs")
        if not out.exists():
            pytest.fail(f"the parent failed: {parent.communicate(timeout=30)}")
        job_ids = out.read_text().split()[1:]
        assert len(job_ids) == 3 and sorted(hb.session_jobs_alive(name, job_ids)) == sorted(job_ids)
        folders = []
        if name == "docker":  # each container's secret file lies in a host folder of its own
            client = backends.get("docker").client()
            folders = [m["Source"] for cid in job_ids for m in client.api.inspect_container(cid)["Mounts"]
                       if m["Destination"] == "/run/roving-session"]
            assert len(folders) == 3 and all(os.path.isfile(os.path.join(f, "secret")) for f in folders)
        else:  # the parent's one folder of secret files (its jobs removed theirs once read)
            folders = [str(f) for f in (tmp_path / "home" / ".roving" / "secrets").glob("roving-secrets-*")]
            assert len(folders) == 1
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        assert wait_until(lambda: hb.session_jobs_alive(name, job_ids) == [], 15, 0.25), \
            hb.session_jobs_alive(name, job_ids)
        assert wait_until(lambda: not any(os.path.exists(f) for f in folders), 15), "secret folders left"
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.communicate(timeout=30)
