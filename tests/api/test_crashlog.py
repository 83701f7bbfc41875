"""A crashed child's last output is kept on disk past its job's end (roving.crashlog), and
``roving logs --failed`` prints it; children roving stopped itself leave no record. Each test keeps its
records in a folder of its own (XDG_STATE_HOME)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import helpers_targets as h
import roving
from helpers_core import wait_until
from roving import crashlog


@pytest.fixture(autouse=True)
def _state(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


def _logs_failed() -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "roving", "logs", "--failed"], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ))


def test_a_crashed_childs_last_lines_are_kept_and_roving_logs_failed_prints_them():
    roving.init(child_output="prefix")
    p = roving.Process(target=h.raise_value_error, args=("the cause of it all",), name="doomed")
    p.start()
    p.join(60)
    assert p.exitcode == 1
    # the traceback's last line is output that may arrive after the exit is noticed: the record takes it in
    assert wait_until(lambda: any("ValueError: the cause of it all" in line
                                  for r in crashlog.records() for line in r.lines), 10)
    (rec,) = crashlog.records()
    assert rec.name == "doomed" and rec.exitcode == 1 and rec.cause == "exited with code 1"
    assert os.stat(rec.path).st_mode & 0o777 == 0o600
    done = _logs_failed()
    assert done.returncode == 0
    assert "== doomed (job " in done.stdout and "exited with code 1" in done.stdout
    assert "  ValueError: the cause of it all" in done.stdout


def test_roving_logs_failed_shows_the_escape_sequences_of_a_childs_output_visibly_not_raw():
    roving.init(child_output="prefix")
    # what a child prints is shown to whoever reads the records: a window title, a clear screen, a bell
    p = roving.Process(target=h.raise_value_error, args=("\x1b]0;owned\x07\x1b[2J\tgone",), name="loud\x1b[5m")
    p.start()
    p.join(60)
    assert p.exitcode == 1
    assert wait_until(lambda: any("gone" in line for r in crashlog.records() for line in r.lines), 10)
    done = _logs_failed()
    assert done.returncode == 0
    assert "  ValueError: \\x1b]0;owned\\x07\\x1b[2J\tgone" in done.stdout  # a tab stays a tab
    assert "== loud\\x1b[5m (job " in done.stdout
    assert "\x1b" not in done.stdout and "\x07" not in done.stdout


def test_a_child_killed_by_a_signal_is_kept_and_one_roving_stopped_is_not():
    roving.init(child_output="files")
    fine = roving.Process(target=h.print_lines, args=(["all is well"], []), name="fine")
    fine.start()
    fine.join(60)
    assert fine.exitcode == 0  # no record
    stopped = roving.Process(target=h.sleep_for, args=(60,), name="stopped")
    victim = roving.Process(target=h.sleep_for, args=(60,), name="outside-kill")
    stopped.start()
    victim.start()
    assert wait_until(lambda: victim.pid is not None, 30)
    stopped.terminate()  # roving's own stop: no record
    stopped.join(60)
    os.kill(victim.pid, 9)  # killed from outside, as the OOM killer would
    victim.join(60)
    assert victim.exitcode == -9 and stopped.exitcode == -15
    assert wait_until(lambda: [r.name for r in crashlog.records()] == ["outside-kill"], 10), crashlog.records()
    assert crashlog.records()[0].cause == "killed by signal 9"


def test_no_records_is_said_and_a_planted_link_is_refused(tmp_path):
    done = _logs_failed()
    assert done.returncode == 0 and "no crashed children on record" in done.stdout
    root = crashlog.folder()
    os.makedirs(os.path.dirname(root), exist_ok=True)
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    os.symlink(tmp_path / "elsewhere", root)
    done = _logs_failed()
    assert done.returncode == 1 and "is not a private folder of this user" in done.stderr


def test_only_the_latest_sessions_are_kept(monkeypatch):
    monkeypatch.setattr(crashlog, "KEEP_SESSIONS", 3)
    for i in range(5):  # five runs, one crashed child each (folders named by time, then session)
        crashlog.record("w", f"s{i}", "1", "local", "", 1, "exited with code 1", lambda: ["its last line"])
    assert sorted(r.session for r in crashlog.records()) == ["s2", "s3", "s4"]
    assert len(os.listdir(crashlog.folder())) == 3
