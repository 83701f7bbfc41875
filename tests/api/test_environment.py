"""A child compares its environment with its parent's when it starts, before it unpickles anything
(roving.environment, the ``env_check`` option): children run by another Python minor, or with another
numpy, in real venvs made on this machine (helpers_envs), on the local backend."""
from __future__ import annotations

import platform

import numpy  # imported, so that the parent's fingerprint names numpy
import pytest

import helpers_envs
import helpers_targets as h
import roving
from roving import environment
from roving.environment import Difference, EnvironmentMismatchError, Fingerprint

OTHER_NUMPY = "2.3.5" if numpy.__version__ != "2.3.5" else "2.2.6"


@pytest.fixture(scope="module")
def other_python() -> str:
    return helpers_envs.venv("other-minor", helpers_envs.other_minor_python())


@pytest.fixture(scope="module")
def other_numpy() -> str:
    import sys

    return helpers_envs.venv(f"numpy-{OTHER_NUMPY}", sys.executable, [f"numpy=={OTHER_NUMPY}"])


def _minor_of(python: str) -> str:
    import subprocess

    return subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                          capture_output=True, text=True, timeout=60, check=True).stdout.strip()


# -- the comparison --------------------------------------------------------------------------------

PARENT = Fingerprint("3.11.7", "cpython", "Linux-x86_64", {"roving": "0.1.0", "numpy": "2.4.6", "mine": "1"})


def _child(**changes) -> Fingerprint:
    fields = {"python": "3.11.7", "implementation": "cpython", "platform": "Linux-x86_64",
              "packages": {"roving": "0.1.0", "numpy": "2.4.6", "mine": "1"}}
    fields.update(changes)
    return Fingerprint(**fields)


def test_auto_makes_python_minor_and_roving_errors_and_the_rest_warnings():
    found = environment.compare(PARENT, _child(python="3.12.1", platform="Linux-aarch64",
                                               packages={"roving": "0.2.0", "numpy": "2.3.5"}), "auto")
    assert {d.what: d.fatal for d in found} == {"python": True, "platform": False, "roving": True,
                                               "numpy": False, "mine": False}
    assert Difference("mine", "1", "not installed", False) in found
    assert environment.compare(PARENT, _child(python="3.11.9"), "auto") == [
        Difference("python", "3.11.7", "3.11.9", False)]  # a patch release only warns


def test_strict_makes_every_difference_an_error_warn_none_and_off_compares_nothing():
    child = _child(python="3.11.9", packages={"roving": "0.1.0", "numpy": "2.3.5", "mine": "1"})
    assert [d.fatal for d in environment.compare(PARENT, child, "strict")] == [True, True]
    assert [d.fatal for d in environment.compare(PARENT, child, "warn")] == [False, False]
    assert environment.compare(PARENT, _child(python="3.13.0"), "off") == []
    assert environment.compare(PARENT, _child(), "strict") == []
    with pytest.raises(ValueError, match="env_check must be one of auto, strict, warn, off, not 'sometimes'"):
        environment.compare(PARENT, child, "sometimes")


def test_a_description_that_is_not_one_is_refused_naming_what_is_wrong():
    with pytest.raises(ValueError, match="not an environment description"):
        Fingerprint.from_json({"python": "3.11.7"})
    with pytest.raises(ValueError, match="of the wrong kind"):
        Fingerprint.from_json({"python": 3, "implementation": "cpython", "platform": "x", "packages": {}})
    assert Fingerprint.from_json(PARENT.to_json()) == PARENT


def test_this_processs_fingerprint_names_its_imported_distributions_and_not_its_own_modules():
    mine = environment.here()
    assert mine.python == platform.python_version()
    assert {"roving", "cloudpickle", "pyzmq", "numpy"} <= set(mine.packages)
    assert mine.packages["numpy"] == numpy.__version__
    assert "helpers_targets" not in mine.packages  # a module of the program's own, not installed
    with pytest.raises(roving.ConfigError, match="env_check"):
        roving.init(env_check="sometimes")


# -- children in other environments ----------------------------------------------------------------

def test_a_child_of_another_python_minor_does_not_run_and_join_names_the_difference(other_python):
    roving.init(python=other_python, child_output="off")
    q = roving.Queue()
    p = roving.Process(target=h.put_value, args=(q, "ran"))
    p.start()
    with pytest.raises(EnvironmentMismatchError) as caught:
        p.join(120)
    child_version = _minor_of(other_python)
    assert f"Python {platform.python_version()} in the parent, {child_version} in the child" in str(caught.value)
    assert p.name in str(caught.value) and 'env_check="warn"' in str(caught.value)
    assert [d.what for d in caught.value.differences] == ["python"]
    assert p.exitcode == 1 and q.empty()
    assert p.environment.fingerprint.python == child_version
    p.join(1)  # raised once, as a failed start is


def test_in_warn_mode_a_child_of_another_python_minor_runs_and_its_differences_are_known(other_python):
    roving.init(python=other_python, env_check="warn", child_output="off")
    q = roving.Queue()
    p = roving.Process(target=h.put_value, args=(q, "ran"))
    p.start()
    assert q.get(timeout=120) == "ran"
    p.join(60)
    assert p.exitcode == 0
    assert [(d.what, d.fatal) for d in p.environment.differences if d.what == "python"] == [("python", False)]


def test_a_child_with_another_numpy_runs_with_a_warning_and_strict_refuses_it_naming_numpy(other_numpy):
    roving.init(python=other_numpy, child_output="off")
    q = roving.Queue()
    p = roving.Process(target=h.put_value, args=(q, "ran"))
    p.start()
    assert q.get(timeout=120) == "ran"
    p.join(60)
    numpy_now = [d for d in p.environment.differences if d.what == "numpy"]
    assert numpy_now == [Difference("numpy", numpy.__version__, OTHER_NUMPY, False)]

    roving.init(env_check="strict")
    p = roving.Process(target=h.put_value, args=(q, "ran again"))
    p.start()
    with pytest.raises(EnvironmentMismatchError, match=rf"numpy {numpy.__version__} in the parent, "
                                                        rf"{OTHER_NUMPY} in the child"):
        p.join(120)
    assert q.empty()


def test_a_pool_whose_workers_run_another_python_minor_fails_at_once_naming_the_difference(other_python):
    roving.init(python=other_python, child_output="off")
    with roving.Pool(2) as pool:
        with pytest.raises(EnvironmentMismatchError, match=r"Python .* in the parent, .* in the child"):
            pool.apply(abs, (-1,))
        with pytest.raises(EnvironmentMismatchError):  # and every later call, as a pool that gave up
            pool.apply_async(abs, (-2,))


def test_roving_info_workers_shows_each_workers_environment_and_its_differences(other_numpy, other_python):
    import os
    import subprocess
    import sys

    def info(python: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "ROVING_PYTHON": python, "ROVING_BACKEND": "local"}
        # numpy imported first, so that this machine's fingerprint names it
        program = ("import numpy, sys; from roving.cli import main; "
                   "sys.argv = ['roving', 'info', '--workers', '2']; sys.exit(main())")
        return subprocess.run([sys.executable, "-c", program],
                              capture_output=True, text=True, timeout=240, env=env)

    done = info(other_numpy)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(f"differs: numpy {numpy.__version__} in the parent, {OTHER_NUMPY} in the child "
                             "(a warning under env_check=auto)") == 2
    done = info(other_python)
    assert done.returncode == 1
    assert done.stdout.count(f"differs: Python {platform.python_version()} in the parent, "
                             f"{_minor_of(other_python)} in the child (an error under env_check=auto)") == 2


# -- a report that is not one ---------------------------------------------------------------------------

DEEP = b"[" * 200_000 + b"]" * 200_000  # lists in lists: deeper than json's parser recurses


def test_a_report_nested_too_deeply_or_of_the_wrong_kind_is_a_value_error_saying_so():
    with pytest.raises(ValueError, match="nested too deeply"):
        environment.Report.from_bytes(DEEP)
    nested_host = b'{"host": ' + b"[" * 500 + b"]" * 500 + b', "policy": "auto", "differences": [], ' \
        b'"fingerprint": {"python": "3", "implementation": "c", "platform": "p", "packages": {}}}'
    with pytest.raises(ValueError, match="of the wrong kind"):
        environment.Report.from_bytes(nested_host)
    with pytest.raises(ValueError, match="not a difference"):
        environment.Report.from_bytes(b'{"host": "h", "policy": "auto", "differences": [[]], "fingerprint": '
                                      b'{"python": "3", "implementation": "c", "platform": "p", "packages": {}}}')
    with pytest.raises(ValueError, match="over"):
        environment.Report.from_bytes(b" " * (environment.MAX_REPORT + 1))


def test_a_childs_report_nested_too_deeply_is_refused_and_join_raises_nothing(caplog):
    import logging

    from roving.transport import node as _node
    from roving.transport import session

    go, out = roving.Queue(), roving.Queue()
    p = roving.Process(target=h.echo_once, args=(go, out))
    p.start()
    node = session.current().started_node()
    # the child's own report, once it is there
    status, frames = node.mailboxes.call_local(_node.GET, p._boot.env_box, 120)
    assert status == _node.OK and environment.Report.from_bytes(bytes(frames[0])).host
    # what a child could leave in its place: lists in lists, deeper than the JSON parser goes
    node.mailboxes.call_local(_node.PUT, p._boot.env_box, 0, [DEEP])
    go.put("on")
    assert out.get(timeout=120) == "on"
    with caplog.at_level(logging.WARNING, logger="roving.process"):
        p.join(120)
        assert p.exitcode == 0 and p.environment is None
    assert "environment report that cannot be read" in caplog.text and "nested too deeply" in caplog.text
