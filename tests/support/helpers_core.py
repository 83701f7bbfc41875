"""Utilities shared by the core tests (not fixtures: those are in conftest.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

#: tests/support: the helper modules (on sys.path, so children import them by reference) and the test programs.
SUPPORT_DIR = Path(__file__).resolve().parent
#: tests/
TESTS_DIR = SUPPORT_DIR.parent
#: The repository's root.
ROOT = TESTS_DIR.parent
#: The programs some tests run in a fresh interpreter.
PROGRAMS = SUPPORT_DIR / "programs"

#: The bound of every blocking call in these tests: generous, only there so that a bug cannot hang the run.
TIMEOUT = 30


def read_log(log_dir: Path, name: str) -> str:
    path = log_dir / f"{name}.log"
    return path.read_text() if path.exists() else ""


def run_script(path, *args, env=None, cwd=None, timeout=120):
    """Run a Python script in a fresh interpreter; returns the CompletedProcess (text)."""
    full_env = dict(os.environ)
    full_env.pop("ROVING_CHILD", None)
    full_env["PYTHONPATH"] = os.pathsep.join([str(SUPPORT_DIR), full_env.get("PYTHONPATH", "")])
    if env:
        full_env.update(env)
    return subprocess.run([sys.executable, str(path), *map(str, args)], capture_output=True, text=True,
                          env=full_env, cwd=cwd, timeout=timeout)


def pid_running(pid: int) -> bool:
    """True while ``pid`` is a live process (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def wait_or_exit(predicate, timeout: float) -> None:
    """For a test program run on its own: wait until ``predicate()`` holds; after ``timeout`` seconds
    without it, exit with a message saying so (the test that ran the program shows its output)."""
    if not wait_until(predicate, timeout, interval=0.1):
        sys.exit(f"timed out after {timeout} s")


def serves_connection_of(node_id: str) -> bool:
    """Whether this process's node still serves a connection of process ``node_id`` (a stream, or a
    ZeroMQ connection): False once it has seen every one of them close (a killed process's, say)."""
    from roving.transport import session

    node = session.current().node()
    door = node.router.door
    try:
        peers = [s.peer for s in tuple(node.hub.peers.values())]
        peers += [door.peer(token) for token in tuple(door.tokens.values())]
    except RuntimeError:  # changed by the node's thread while read: still changing, so ask again
        return True
    return any(peer is not None and peer.node_id == node_id for peer in peers)


def waiting_readers(q) -> int:
    """How many gets wait at queue ``q``'s mailbox (``q`` made by this process: its node holds it)."""
    from roving.transport import session

    boxes = session.current().node().mailboxes
    with boxes.lock:
        return len(boxes.boxes[q._box].getters)


def start(target, *args, **kwargs):
    """A started roving.Process running ``target(*args)``; keyword arguments go to Process."""
    import roving

    p = roving.Process(target=target, args=args, **kwargs)
    p.start()
    return p


def finish(*procs):
    """Join each process and assert that it ended with exit code 0."""
    for p in procs:
        p.join(TIMEOUT)
        assert p.exitcode == 0, p


def _proc_table() -> dict:
    """{pid: (ppid, cmdline bytes)} of every process now."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    table[int(entry)] = (ppid, f.read())
            except (OSError, IndexError, ValueError):
                pass
    return table


def roving_children(parent: int) -> list:
    """The pids of the roving children of process ``parent`` on the local backend: its own children that
    run ``roving._child``, and the children of its starter (``local_preload``), which are forked there."""
    table = _proc_table()
    starters = {pid for pid, (ppid, cmd) in table.items() if ppid == parent and b"roving.backends.local.starter" in cmd}
    return sorted(pid for pid, (ppid, cmd) in table.items()
                  if (ppid == parent and b"roving._child" in cmd) or ppid in starters)
