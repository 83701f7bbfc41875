"""The local backend's starter (roving.backends.local.starter): children forked, by default, from a process
that imported roving's child code (and ``local_preload``) once, as a fresh ``python -m roving._child``
would run them; fresh interpreters with ``local_start="fresh"``.

Real processes throughout: the starter, its forked children, and (for the parent's death) a parent
program in a subprocess of its own. ``xml.dom.minidom`` is the probe of preloading: roving does not
import it, so it is in a child's ``sys.modules`` before its target runs only when the starter imported it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

import helpers_targets as h
import roving
from helpers_core import TIMEOUT, pid_running, read_log, wait_until
from roving.config import ConfigError

PROBE = "xml.dom.minidom"


def _report(**kwargs):
    q = roving.Queue()
    p = roving.Process(target=h.report_process, args=(q,), kwargs=kwargs)
    p.start()
    got = q.get(timeout=TIMEOUT)
    p.join(TIMEOUT)
    assert p.exitcode == 0
    return p, got


def test_a_forked_child_runs_with_its_own_environment_directory_output_and_random_state(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("RV_STARTER_MARK", "given")
    roving.init(local_preload=f"{PROBE}, numpy", child_output="files", log_dir=str(tmp_path / "logs"))
    reports = [_report(probe_module=PROBE, variable="RV_STARTER_MARK") for _ in range(3)]
    starters = {got["ppid"] for _, got in reports}
    assert len(starters) == 1 and os.getpid() not in starters  # all three forked by one starter
    for p, got in reports:
        assert got["probe"] is True  # imported before the target ran: by the starter
        assert got["variable"] == "given"
        assert got["cwd"] == str(work) == got["path0"]
        assert got["main"] == "__main__" and got["argv"][0].endswith(os.path.join("roving", "_child.py"))
        assert f"reported from {got['pid']}" in read_log(tmp_path / "logs", p.name)
    assert len({got["random"] for _, got in reports}) == 3  # reseeded in each child
    assert len({got["numpy"] for _, got in reports}) == 3


def test_by_default_children_are_forked_from_a_starter_without_the_preload_modules():
    _, got = _report(probe_module=PROBE)
    assert got["ppid"] != os.getpid() and got["probe"] is False


def test_with_local_start_fresh_children_are_fresh_interpreters():
    roving.init(local_start="fresh")
    _, got = _report(probe_module=PROBE)
    assert got["ppid"] == os.getpid() and got["probe"] is False


def test_local_preload_forks_children_even_with_local_start_fresh():
    roving.init(local_start="fresh", local_preload=PROBE)
    _, got = _report(probe_module=PROBE)
    assert got["ppid"] != os.getpid() and got["probe"] is True


def test_a_local_start_that_is_not_known_is_an_error_that_names_the_choices():
    with pytest.raises(ConfigError, match="local_start.*fork, fresh"):
        roving.init(local_start="spawn")


def test_a_child_whose_interpreter_settings_differ_gets_a_starter_of_its_own(monkeypatch):
    """An interpreter reads its ``PYTHON*`` variables as it starts, so a forked child has its starter's:
    children with other values of them are forked by another starter, started with those values, and
    hash as a fresh interpreter with them does."""
    roving.init(local_preload=PROBE)
    monkeypatch.setenv("PYTHONHASHSEED", "1")
    _, one = _report(variable="PYTHONHASHSEED")
    _, again = _report(variable="PYTHONHASHSEED")
    monkeypatch.setenv("PYTHONHASHSEED", "2")
    _, two = _report(variable="PYTHONHASHSEED")
    assert one["ppid"] == again["ppid"] != two["ppid"] and os.getpid() not in (one["ppid"], two["ppid"])
    assert (one["variable"], two["variable"]) == ("1", "2")
    fresh = {seed: int(subprocess.run([sys.executable, "-c", "print(hash('roving'))"], capture_output=True,
                                      text=True, check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout)
             for seed in ("1", "2")}
    assert (one["hash"], again["hash"], two["hash"]) == (fresh["1"], fresh["1"], fresh["2"])
    assert fresh["1"] != fresh["2"]


def test_a_forked_childs_exit_code_signal_and_end_are_as_a_fresh_childs():
    roving.init(local_preload=PROBE)
    exits = roving.Process(target=h.exit_with, args=(3,))
    killed = roving.Process(target=h.sleep_for, args=(60,))
    ended = roving.Process(target=h.sleep_for, args=(60,))
    for p in (exits, killed, ended):
        p.start()
    exits.join(TIMEOUT)
    assert exits.exitcode == 3
    killed.kill()
    killed.join(TIMEOUT)
    assert killed.exitcode == -signal.SIGKILL
    ended.terminate()
    ended.join(TIMEOUT)
    assert ended.exitcode == -signal.SIGTERM
    assert roving.active_children() == []


def test_the_starter_ignores_a_terminals_interrupt_and_a_starter_killed_is_replaced(tmp_path):
    roving.init(local_preload=PROBE)
    _, first = _report()
    starter = first["ppid"]
    os.kill(starter, signal.SIGINT)  # ^C goes to the whole foreground group: the starter stays
    _, second = _report()
    assert second["ppid"] == starter
    sleeper = roving.Process(target=h.sleep_for, args=(60,))
    sleeper.start()
    assert wait_until(lambda: sleeper.pid is not None and pid_running(sleeper.pid), TIMEOUT)
    os.kill(starter, signal.SIGKILL)
    assert wait_until(lambda: not pid_running(starter), TIMEOUT)
    # its orphan still runs, and its end is still seen (by its pidfd; the code is no longer known)
    assert sleeper.is_alive()
    os.kill(sleeper.pid, signal.SIGKILL)
    sleeper.join(TIMEOUT)
    assert sleeper.exitcode == -signal.SIGKILL
    _, third = _report(probe_module=PROBE)  # a new starter, made on the next start
    assert third["ppid"] not in (starter, os.getpid()) and third["probe"] is True


def test_a_module_that_cannot_be_preloaded_is_an_error_that_names_it():
    with pytest.raises(ConfigError, match="'not a module' is not a module name"):
        roving.init(local_preload="json, not a module")
    roving.init(local_preload="roving_no_such_module_xyz")
    p = roving.Process(target=h.sleep_for, args=(0,))
    with pytest.raises(OSError, match=r"could not preload \['roving_no_such_module_xyz'\]: ModuleNotFoundError"):
        p.start()


def test_a_forked_child_exits_when_its_parent_is_killed(tmp_path):
    parent = tmp_path / "parent.py"
    parent.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(os.path.dirname(h.__file__))!r})
        import roving, helpers_targets as h
        if __name__ == "__main__":
            roving.init(local_preload="{PROBE}", child_output="off")
            q = roving.Queue()
            p = roving.Process(target=h.report_process, args=(q,))
            p.start()
            got = q.get(timeout=60)
            child = roving.Process(target=h.sleep_for, args=(300,))
            child.start()
            print(got["ppid"], child.pid, flush=True)
            child.join()
    """))
    proc = subprocess.Popen([sys.executable, str(parent)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        starter, child = (int(x) for x in proc.stdout.readline().split())
        assert pid_running(child) and pid_running(starter)
        proc.kill()
        proc.wait(TIMEOUT)
        # the child watches its parent's pidfd (its own parent is the starter, which exits with the
        # parent's socket): both go within a few heartbeats
        assert wait_until(lambda: not pid_running(child) and not pid_running(starter), TIMEOUT)
    finally:
        proc.kill()
        proc.wait()


def test_closing_the_starters_leaves_their_running_children_and_their_exit_codes():
    from roving import backends

    roving.init(local_preload=PROBE)
    _, first = _report()
    running = roving.Process(target=h.exit_after, args=(1.0, 5))
    running.start()
    backends.get("local").close_starters()
    assert pid_running(first["ppid"])  # it stays while its child runs, to tell its end
    running.join(TIMEOUT)
    assert running.exitcode == 5
    assert wait_until(lambda: not pid_running(first["ppid"]), TIMEOUT)
    _, second = _report()
    assert second["ppid"] not in (first["ppid"], os.getpid())


def test_a_forked_child_that_ended_is_not_reported_running_while_the_starters_word_is_on_its_way():
    """A forked child's sentinel (its pidfd) fires as it exits; its exit code comes a moment later, from
    the starter. ``is_alive()`` right after the sentinel must already say it ended (multiprocessing's
    guarantee): the backend waits for the starter's word then, rather than report it running."""
    import threading

    from roving.backends.base import Job, JobState
    from roving.backends.local.backend import LocalBackend
    from roving.backends.local.starter import ForkedChild

    pid = os.fork()
    if pid == 0:
        os._exit(3)
    try:
        child = ForkedChild(pid)
        backend = LocalBackend()
        job = Job(backend, str(pid))
        backend._procs[job.id] = child
        assert wait_until(child.exited, TIMEOUT)
        assert child.poll() is None  # the starter's word has not come
        threading.Timer(0.3, child._end, args=(3,)).start()
        status = backend.job_status(job)
        assert status.state is JobState.EXITED and status.exitcode == 3
    finally:
        os.waitpid(pid, 0)
