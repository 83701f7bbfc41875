"""A program written for multiprocessing runs unchanged with ``import roving as multiprocessing``."""
from __future__ import annotations

import shutil

from helpers_core import run_script, PROGRAMS

PROGRAM = PROGRAMS / "mp_program.py"


def test_multiprocessing_program_prints_the_same_with_roving_as_with_the_stdlib(tmp_path):
    stdlib_copy = tmp_path / "stdlib" / "mp_program.py"
    roving_copy = tmp_path / "roving" / "mp_program.py"
    stdlib_copy.parent.mkdir()
    roving_copy.parent.mkdir()
    shutil.copy(PROGRAM, stdlib_copy)
    source = PROGRAM.read_text()
    assert source.count("\nimport multiprocessing\n") == 1
    roving_copy.write_text(source.replace("\nimport multiprocessing\n", "\nimport roving as multiprocessing\n"))

    expected = run_script(stdlib_copy, cwd=stdlib_copy.parent)
    assert expected.returncode == 0, expected.stderr
    got = run_script(roving_copy, cwd=roving_copy.parent)
    assert got.returncode == 0, got.stderr
    assert got.stdout == expected.stdout
    # the program really exercised what it claims (guards against a program that prints nothing)
    assert "squares [(0, 0), (1, 1)" in expected.stdout
    assert "exitcodes [0, 3, 0, 1]" in expected.stdout
    assert "signalled -15 -9 False" in expected.stdout
    # the child's traceback is shown (prefixed with its name under roving)
    assert "RuntimeError: expected failure" in got.stderr
