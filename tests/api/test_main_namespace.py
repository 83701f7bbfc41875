"""Functions of the parent's __main__ share one namespace in a child, as under multiprocessing's spawn."""
import os
import subprocess
import sys

from helpers_core import TIMEOUT

PROGRAM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support", "programs",
                       "main_namespace.py")


def run(*args):
    out = subprocess.run([sys.executable, PROGRAM, *args], capture_output=True, text=True,
                         timeout=4 * TIMEOUT)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_pool_initializer_globals_reach_the_task_and_its_helpers_as_with_the_stdlib():
    expected = "[(10, 1), (20, 2), (30, 3)]\n120\n"
    assert run("stdlib") == expected  # the behaviour roving must match
    assert run() == expected
