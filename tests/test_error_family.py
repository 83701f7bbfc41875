"""roving's errors are one family: every exception class roving defines is a ``RovingError``, itself a
``multiprocessing.ProcessError``; each kept the built-in kinds an ``except`` clause may have named before
the family existed, and each is still importable from where it was."""
from __future__ import annotations

import ast
import importlib
import multiprocessing
import pickle
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Dict, List, Tuple

import roving
from roving.errors import RovingError

SRC = Path(roving.__file__).resolve().parent

#: Packages whose errors are not in the family yet, each with what brings them in. The test fails when
#: one of them is in (so that its entry goes) as when an error elsewhere is not.
NOT_YET: Dict[str, str] = {}


def _module_name(path: Path) -> str:
    parts = ("roving", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exception_classes() -> List[Tuple[str, type]]:
    """(module, class) for every exception class whose ``class`` statement is in roving's source, at
    any depth of its module (a class defined in a function is found by its statement and must say so)."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        name = _module_name(path)
        if name.endswith("__main__"):
            continue  # running it is what importing it does
        tree = ast.parse(path.read_text())
        statements = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
        if not statements:
            continue
        module = importlib.import_module(name)
        top = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
        for node in statements:
            assert node.name in top, f"{name}.{node.name}: a class defined inside a function or class, " \
                                     "which this test cannot see; define it at the top of its module"
            cls = getattr(module, node.name)
            if isinstance(cls, type) and issubclass(cls, BaseException):
                found.append((name, cls))
    return found


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_every_exception_class_defined_in_roving_derives_from_roving_error_a_process_error():
    assert issubclass(RovingError, multiprocessing.ProcessError) and RovingError is roving.RovingError
    classes = _exception_classes()
    assert len(classes) > 30, f"only {len(classes)} exception classes found under {SRC}"
    outside = [f"{module}.{cls.__name__}" for module, cls in classes
               if not issubclass(cls, RovingError) and not any(_in(module, p) for p in NOT_YET)]
    assert outside == [], f"errors outside the RovingError family: {outside}"
    for package, why in NOT_YET.items():
        pending = [cls for module, cls in classes if _in(module, package) and not issubclass(cls, RovingError)]
        assert pending, f"{package}'s errors are all RovingErrors now: remove its NOT_YET entry ({why})"


def test_each_error_keeps_the_builtin_kinds_an_except_clause_could_name_before_the_family():
    from roving import backends, transport
    from roving.pool import errors as pool_errors
    kinds = {
        roving.ConfigError: (ValueError,), roving.ProcessStartError: (OSError,),
        roving.EnvironmentMismatchError: (multiprocessing.ProcessError,),
        roving.errors.CodeShipError: (ValueError,), roving.errors.CrashLogError: (OSError,),
        roving.errors.RemoteError: (Exception,),
        backends.BackendError: (OSError,), backends.errors.UnknownJobError: (OSError, LookupError),
        backends.errors.NotPrivateError: (PermissionError,),
        transport.errors.AuthenticationError: (multiprocessing.AuthenticationError, ConnectionError),
        transport.errors.SerializationError: (TypeError,), transport.errors.MalformedMessage: (ValueError,),
        pool_errors.PoolStartError: (multiprocessing.ProcessError, OSError),
        roving.WorkerLostError: (multiprocessing.ProcessError, BrokenProcessPool),
        pool_errors.UnloadedTraceback: (multiprocessing.pool.RemoteTraceback,),  # type: ignore[attr-defined]
    }
    for cls, bases in kinds.items():
        for base in bases:
            assert issubclass(cls, base), f"{cls.__name__} is no longer a {base.__name__}"
        assert issubclass(cls, RovingError), cls
    # bad data stays apart from broken connections, as it was
    assert not issubclass(transport.errors.SerializationError, OSError)
    assert not issubclass(transport.errors.MalformedMessage, OSError)


def test_there_is_one_worker_lost_error_raised_by_the_pool_and_the_executor_alike():
    import roving.futures
    import roving.pool
    assert roving.WorkerLostError is roving.pool.WorkerLostError is roving.futures.WorkerLostError
    assert issubclass(roving.WorkerLostError, BrokenProcessPool)
    assert issubclass(roving.WorkerLostError, roving.pool.PoolError)


def test_the_top_level_errors_are_importable_from_the_modules_that_raise_them_as_before():
    from roving import _manager_proxy, codeship, config, crashlog, environment, managers, process
    from roving import errors
    assert config.ConfigError is errors.ConfigError is roving.ConfigError
    assert process.ProcessStartError is errors.ProcessStartError is roving.ProcessStartError
    assert environment.EnvironmentMismatchError is errors.EnvironmentMismatchError
    assert codeship.CodeShipError is errors.CodeShipError
    assert crashlog.CrashLogError is errors.CrashLogError
    assert _manager_proxy.RemoteError is managers.RemoteError is errors.RemoteError


def test_an_error_with_fields_of_its_own_crosses_a_pickle_whole():
    from roving.errors import EnvironmentMismatchError
    made = EnvironmentMismatchError("child 3 on h1: numpy 1.26 here, 2.0 there")
    back = pickle.loads(pickle.dumps(made))
    assert type(back) is EnvironmentMismatchError and str(back) == str(made)
    assert isinstance(back, RovingError) and back.differences == ()
