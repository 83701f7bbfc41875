"""Python environments other than the test run's, for the tests of children whose environment differs
from their parent's: a venv of another Python minor, or of this Python with other package versions.

Each is made once per machine under :data:`CACHE` (pip, from the configured index) and reused while its
recipe is the same. roving itself is not installed in them: a child gets it from the parent's path (a
checkout's ``src``). A Python that is not on the machine fails the test, naming what to install.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import pytest

#: the venvs' folder; TEST_ENVS_CACHE moves it (not a ROVING_ name: roving refuses ROVING_ variables it does not know)
CACHE = Path(os.environ.get("TEST_ENVS_CACHE", "/var/cache/roving-test-envs"))
#: roving's own dependencies (pyproject.toml): what a child needs to boot.
BASE = ("pyzmq", "cloudpickle", "cryptography")


def other_minor_python() -> str:
    """A CPython 3.10–3.13 of another minor than this one (pyenv's, else the system's), as a path."""
    here = sys.version_info[:2]
    for minor in (12, 13, 10, 11):
        if (3, minor) == here:
            continue
        for found in sorted(Path("/root/.pyenv/versions").glob(f"3.{minor}.*/bin/python3")):
            return str(found)
        found = shutil.which(f"python3.{minor}")
        if found:
            return found
    pytest.fail(f"no CPython 3.10-3.13 other than {here[0]}.{here[1]} on this machine (pyenv's or python3.X): "
                "install one (pyenv install 3.12) for the tests of children in another environment",
                pytrace=False)


def venv(name: str, python: str, packages: Sequence[str] = ()) -> str:
    """The interpreter of the venv ``name`` made with ``python`` and holding :data:`BASE` and ``packages``
    (pip requirement strings); made on first use, reused after."""
    home = CACHE / name
    recipe = {"python": python, "packages": [*BASE, *packages]}
    stamp = home / "roving-test-env.json"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists() and json.loads(stamp.read_text()) == recipe:
            return str(home / "bin" / "python")
        shutil.rmtree(home, ignore_errors=True)
        # no pip of its own (ensurepip took 10 s of the venv's 11 on a loaded machine): this Python's pip
        # installs into it (pip's --python)
        steps = ([python, "-m", "venv", "--without-pip", str(home)],
                 [sys.executable, "-m", "pip", "--python", str(home / "bin" / "python"), "install", "-q",
                  *recipe["packages"]])
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                pytest.fail(f"making the test environment {home} failed at `{' '.join(step)}` "
                            f"(exit {done.returncode}): {done.stderr.strip()[-2000:]}", pytrace=False)
        stamp.write_text(json.dumps(recipe))
    return str(home / "bin" / "python")
