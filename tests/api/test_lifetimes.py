"""Children never outlive their parent: not after kill -9, not when it stops answering, not at its exit."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers_core import pid_running, roving_children, wait_until, PROGRAMS

PROGRAM = PROGRAMS / "parent_with_children.py"
GONE_WITHIN = 10.0  # seconds: the requirement


def start_parent(tmp_path, *args):
    pidfile = tmp_path / "pids.txt"
    env = dict(os.environ)
    env.pop("ROVING_CHILD", None)
    parent = subprocess.Popen([sys.executable, str(PROGRAM), str(pidfile), *map(str, args)], env=env,
                              cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready = wait_until(lambda: pidfile.exists() or parent.poll() is not None, 60)
    if not pidfile.exists():
        parent.kill()
        out, err = parent.communicate(timeout=30)
        pytest.fail(f"the parent did not start its children (ready={ready}): {out}\n{err}")
    lines = pidfile.read_text().split()
    assert lines[-1] == "ready"
    parent_pid, child_pids = int(lines[0]), [int(x) for x in lines[1:-1]]
    assert parent_pid == parent.pid
    return parent, child_pids


def cleanup(parent, child_pids):
    for pid in [parent.pid, *child_pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    parent.wait(30)


@pytest.mark.parametrize("daemon", ["daemon", "normal"])
def test_no_child_survives_kill_9_of_its_parent_for_10_seconds(tmp_path, daemon):
    parent, child_pids = start_parent(tmp_path, 3, "sleep", daemon)
    try:
        assert len(child_pids) == 3
        assert all(pid_running(pid) for pid in child_pids)
        assert sorted(roving_children(parent.pid)) == sorted(child_pids)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(30)
        gone = wait_until(lambda: not any(pid_running(pid) for pid in child_pids), GONE_WITHIN)
        survivors = [pid for pid in child_pids if pid_running(pid)]
        assert gone, f"children still running {GONE_WITHIN:g} s after kill -9 of their parent: {survivors}"
    finally:
        cleanup(parent, child_pids)


def test_children_exit_when_their_parent_stops_answering(tmp_path):
    # heartbeat every 0.2 s, give up after 1 s of silence; SIGSTOP keeps the parent alive but silent
    parent, child_pids = start_parent(tmp_path, 2, "sleep", "normal", 0.2, 1.0)
    try:
        time.sleep(1.0)  # not a check: lets the children's heartbeats reach the parent before it stops
        os.kill(parent.pid, signal.SIGSTOP)
        gone = wait_until(lambda: not any(pid_running(pid) for pid in child_pids), GONE_WITHIN)
        assert gone, "children kept running although their parent stopped answering"
        assert pid_running(parent.pid)  # the parent itself is only stopped
    finally:
        cleanup(parent, child_pids)


def test_children_stay_while_their_parent_works_without_answering_for_longer_than_parent_timeout(tmp_path):
    """A parent busy in C code that holds its interpreter's lock (a start storm of a thousand workers on
    two cores starves it alike) answers no heartbeat for several times ``parent_timeout``, but it works:
    its children on this machine see its CPU time grow and stay."""
    parent, child_pids = start_parent(tmp_path, 2, "busy", "normal", 0.2, 1.0)
    try:
        done = tmp_path / "pids.txt.busy"
        assert wait_until(done.exists, 120), "the parent never finished its busy spell"
        busy_s = float(done.read_text())
        assert busy_s > 2.0, f"the busy spell lasted {busy_s:.1f} s: too short to show anything"
        assert all(pid_running(pid) for pid in child_pids), "a child left while its parent was only busy"
    finally:
        cleanup(parent, child_pids)


def test_children_exit_when_their_parent_stops_answering_before_their_first_heartbeat(tmp_path):
    # heartbeat every 1 s, give up after 2 s: the parent stops before any child's first heartbeat, so
    # every child should be gone about 3 s later (the parent is alive, so only heartbeats can tell)
    parent, child_pids = start_parent(tmp_path, 2, "sleep", "normal", 1.0, 2.0)
    try:
        os.kill(parent.pid, signal.SIGSTOP)
        gone = wait_until(lambda: not any(pid_running(pid) for pid in child_pids), GONE_WITHIN)
        assert gone, "children kept running although their parent never answered a heartbeat"
    finally:
        cleanup(parent, child_pids)


def test_daemonic_children_are_terminated_when_the_parent_exits_normally(tmp_path):
    parent, child_pids = start_parent(tmp_path, 2, "exit", "daemon")
    try:
        assert parent.wait(60) == 0
        gone = wait_until(lambda: not any(pid_running(pid) for pid in child_pids), GONE_WITHIN)
        assert gone, "daemonic children outlived their parent's normal exit"
    finally:
        cleanup(parent, child_pids)


def test_exit_does_not_wait_for_a_node_whose_process_has_ended(tmp_path):
    """What was put to a queue of an ended child is gone with it: the parent's exit notices that
    nothing listens there any more instead of waiting (10 s) for an answer, and warns of nothing."""
    env = {k: v for k, v in os.environ.items() if k != "ROVING_CHILD"}
    run = subprocess.run([sys.executable, str(PROGRAMS / "put_to_ended_child.py")], env=env,
                         cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "joined 0" in run.stdout, run.stderr
    assert "may be lost" not in run.stderr, run.stderr
