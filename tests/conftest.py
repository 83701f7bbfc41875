"""Shared fixtures of roving's core tests.

* tests/ is put on sys.path, so that children (which take on the parent's sys.path) can import
  ``helpers_targets`` by reference.
* Every test starts from the configuration of the environment (no ``roving.init`` leaks between tests), and any child a test
  leaves running is killed afterwards, so that a failing test cannot leave processes behind.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

import roving  # noqa: E402
from roving import config as _config  # noqa: E402
from roving import context as _context  # noqa: E402

from helpers_core import TIMEOUT  # noqa: E402


@pytest.fixture(autouse=True)
def _roving_state():
    saved_config, saved_method, saved_init = _config._current, _context._method, _config._init_options
    _config._current = None  # resolved afresh (file, ROVING_* environment, defaults) on first use
    _config._init_options = {}
    yield
    for child in roving.active_children():
        try:
            child.kill()
            child.join(TIMEOUT)
        except Exception:
            pass
    _config._current, _context._method, _config._init_options = saved_config, saved_method, saved_init


@pytest.fixture
def log_dir(tmp_path):
    """Children's output goes to one log file per process in a fresh directory."""
    path = tmp_path / "logs"
    roving.init(child_output="files", log_dir=str(path))
    return path


