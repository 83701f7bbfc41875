"""Shared fixtures of roving's core tests.

* tests/support/ is put on sys.path, so that children (which take on the parent's sys.path) can import
  ``helpers_targets`` by reference.
* Every test starts from the configuration of the environment (no ``roving.init`` leaks between tests), and
  any child a test leaves running is killed afterwards, so that a failing test cannot leave processes behind.
* The test process's own roving threads are watched (helpers_watchdog): should one stop, the suite
  stops at once and says after which test, instead of failing every later test by timeout.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

SUPPORT_DIR = Path(__file__).resolve().parent / "support"
if str(SUPPORT_DIR) not in sys.path:
    sys.path.insert(0, str(SUPPORT_DIR))

import roving  # noqa: E402
from roving import config as _config  # noqa: E402
from roving import context as _context  # noqa: E402

import helpers_watchdog  # noqa: E402
from helpers_core import TIMEOUT  # noqa: E402

helpers_watchdog.install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    last_of_file = nextitem is None or nextitem.path != item.path
    trouble = helpers_watchdog.check(probe=last_of_file)
    if trouble:
        sys.__stderr__.write(f"\n{trouble} (after {item.nodeid})\n{helpers_watchdog.stacks()}\n")
        sys.__stderr__.write("\n".join(helpers_watchdog.reported) + "\n")
        sys.__stderr__.flush()
        pytest.exit(f"{trouble}, after {item.nodeid}: every later test would wait on it (stacks above)", 3)


def pytest_terminal_summary(terminalreporter):
    if helpers_watchdog.reported:
        terminalreporter.section("errors roving's threads logged or raised in the test process (tests that inject "
                                 "faults add some on purpose)")
        for text in helpers_watchdog.reported:
            terminalreporter.write_line(text)


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


@pytest.fixture
def specs(monkeypatch):
    """The JobSpecs the local backend receives, recorded on their way in."""
    from roving import backends

    backend = backends.get("local")
    got = []
    real = backend.create_job

    def create_job(spec):
        got.append(spec)
        return real(spec)

    monkeypatch.setattr(backend, "create_job", create_job)
    return got
