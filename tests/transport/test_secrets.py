"""The session secret and the parent's environment go no further than they must (issue 18, finding 6):
a child's own subprocesses do not inherit the secret; output folders and log files are private."""
from __future__ import annotations

import os
import stat
import subprocess
import sys

import helpers_targets as h
import roving
from helpers_core import TIMEOUT, finish, start
from roving.transport import session as _session


# -- targets run in children -------------------------------------------------------------------

def environment_of_a_plain_subprocess(out):
    dump = subprocess.run([sys.executable, "-c", "import os; print(repr(dict(os.environ)))"],
                          capture_output=True, text=True, timeout=TIMEOUT)
    out.put((dump.stdout, repr(dict(os.environ)), open(f"/proc/{os.getpid()}/cmdline").read()))


def put_from_a_grandchild(out):
    inner = roving.Queue()
    p = roving.Process(target=inner.put, args=("from the grandchild",))
    p.start()
    out.put(inner.get(timeout=TIMEOUT))
    p.join(TIMEOUT)


# -- tests ---------------------------------------------------------------------------------------

def test_a_plain_subprocess_of_a_child_does_not_see_the_session_secret():
    secret = _session.current().secret.hex()
    out = roving.Queue()
    p = start(environment_of_a_plain_subprocess, out)
    grandchild_env, child_env, cmdline = out.get(timeout=TIMEOUT)
    finish(p)
    assert "PATH" in grandchild_env  # it did print its environment
    assert secret not in grandchild_env
    assert secret not in child_env  # gone from the child's os.environ once read
    assert _session.CHILD_ENV not in grandchild_env  # it is no roving child: it would start a session of its own
    assert secret not in cmdline


def test_a_roving_grandchild_still_gets_the_secret_from_its_parents_session():
    out = roving.Queue()
    p = start(put_from_a_grandchild, out)
    assert out.get(timeout=TIMEOUT) == "from the grandchild"
    finish(p)
    assert p.exitcode == 0


def test_log_dir_and_its_log_files_are_private(tmp_path):
    log_dir = tmp_path / "fresh" / "logs"
    roving.init(child_output="files", log_dir=str(log_dir))
    out = roving.Queue()
    p = start(h.make_file_and_report_mode, str(tmp_path / "made.txt"), out, name="private-log")
    out.get(timeout=TIMEOUT)
    finish(p)
    log = log_dir / "private-log.log"
    assert "a line for the job's output" in log.read_text()
    assert stat.S_IMODE(os.stat(log).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(log_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "fresh").st_mode) == 0o700
