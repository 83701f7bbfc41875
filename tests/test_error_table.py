"""The documented table of errors (docs/reference/errors.md) is the one the error classes make: a new, moved,
renamed or reworded error fails here until the table is made again
(``python3 scripts/error_table.py --write docs/reference/errors.md``)."""
from __future__ import annotations

import importlib.util
import multiprocessing
from pathlib import Path

import pytest

from roving.backends import errors as backend_errors
from roving.pipeline import errors as pipeline_errors
from roving.pool import errors as pool_errors
from roving.transport import errors as transport_errors

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("error_table", ROOT / "scripts" / "error_table.py")
error_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(error_table)


def _rows(table: str) -> dict:
    """{error name: the row's cells} of a table in the page's form."""
    rows = {}
    for line in table.splitlines()[3:-1]:
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 4, f"not a row of four cells: {line!r}"
        rows[cells[0].strip("`")] = cells
    return rows


def test_the_documented_error_table_is_the_one_the_error_classes_make():
    written = _rows(error_table.documented_table((ROOT / error_table.PAGE).read_text()))
    made = _rows(error_table.table())
    assert sorted(written) == sorted(made), "errors missing from the documented table or no longer in the code"
    for name in made:
        assert written[name] == made[name], f"{name}: the page says {written[name]}, the code {made[name]}"
    assert error_table.documented_table((ROOT / error_table.PAGE).read_text()) == error_table.table()  # order too


def test_the_table_has_every_error_of_the_error_modules_with_its_bases_and_an_import_path_that_works():
    rows = _rows(error_table.table())
    for module in (backend_errors, transport_errors, pool_errors, pipeline_errors):
        for name in module.__all__ if hasattr(module, "__all__") else dir(module):
            cls = getattr(module, name)
            if isinstance(cls, type) and issubclass(cls, BaseException) and cls.__module__ == module.__name__:
                assert name in rows, f"{module.__name__}.{name} is not in the table"
    for name, (_, bases, where, meaning) in rows.items():
        path = where.strip("`")
        module, _, attr = path.rpartition(".")
        cls = getattr(importlib.import_module(module), attr)
        assert cls.__name__ == name and issubclass(cls, BaseException)
        assert bases == ", ".join(error_table.base_name(b) for b in cls.__bases__)
        for base in cls.__bases__:  # each base named so that it can be found
            public = error_table.base_name(base)
            if "." in public:
                package, _, attr = public.rpartition(".")
                assert getattr(importlib.import_module(package), attr) is base
        assert meaning, f"{name} has no docstring to say what it means"
    assert rows["RovingError"][1] == "multiprocessing.ProcessError"
    assert rows["PoolError"][1] == "RovingError" and issubclass(
        pool_errors.WorkerLostError, multiprocessing.ProcessError)
    assert rows["BackendError"][1] == "RovingError, OSError"


#: each package with an error module, its one base, and what may live outside that module (with why)
PACKAGES = {
    "roving.backends": (backend_errors, backend_errors.BackendError),
    "roving.transport": (transport_errors, transport_errors.TransportError),
    "roving.pool": (pool_errors, pool_errors.PoolError),
    "roving.pipeline": (pipeline_errors, pipeline_errors.PipelineError),
}
#: not raised by itself, so not under the pool's base: the cause attached to a call's own error
OUTSIDE_THE_BASE = {pool_errors.UnloadedTraceback}


def test_every_error_of_a_package_is_defined_in_its_error_module_under_its_one_base():
    for package, (module, base) in PACKAGES.items():
        root = Path(importlib.import_module(package).__file__).parent
        for path in sorted(root.rglob("*.py")):
            name = ".".join((package, *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
            if name.endswith("__main__"):
                continue
            for attr, cls in vars(importlib.import_module(name)).items():
                if isinstance(cls, type) and issubclass(cls, BaseException) and cls.__module__ == name:
                    assert module.__name__ == name, f"{name}.{attr} is an error defined outside {module.__name__}"
        defined = [c for c in vars(module).values()
                   if isinstance(c, type) and issubclass(c, BaseException) and c.__module__ == module.__name__]
        assert base in defined
        for cls in defined:
            assert issubclass(cls, base) or cls in OUTSIDE_THE_BASE, f"{module.__name__}.{cls.__name__} is not a {base}"


def test_the_transports_errors_are_the_builtin_kinds_multiprocessing_code_catches_and_bad_data_is_no_oserror():
    e = transport_errors
    for cls in (e.NodeError, e.ConnectionLost, e.AddressError, e.StreamError, e.ServerGone,
                e.AuthenticationError, e.IdentityError):
        assert issubclass(cls, OSError), cls  # what a retry on a broken connection catches
    for cls in (e.StreamError, e.ServerGone, e.AuthenticationError, e.IdentityError):
        assert issubclass(cls, ConnectionError), cls
    for cls in (e.AuthenticationError, e.IdentityError):
        assert issubclass(cls, multiprocessing.AuthenticationError), cls
    assert issubclass(e.SerializationError, TypeError) and not issubclass(e.SerializationError, OSError)
    assert issubclass(e.MalformedMessage, ValueError) and not issubclass(e.MalformedMessage, OSError)
    assert not issubclass(e.TransportError, OSError)  # the base: so that it can hold the two above
    # the modules that raise them still offer them, as they did before the errors module
    from roving.transport import addressing, auth, endpoint, identity, rpc, serialize, stream, wire
    assert (addressing.AddressError, auth.AuthenticationError, endpoint.TransportError, endpoint.ConnectionLost,
            identity.IdentityError, rpc.ServerGone, serialize.SerializationError, stream.StreamError,
            wire.MalformedMessage) == (e.AddressError, e.AuthenticationError, e.TransportError, e.ConnectionLost,
                                       e.IdentityError, e.ServerGone, e.SerializationError, e.StreamError,
                                       e.MalformedMessage)


def test_an_error_made_for_what_pickle_raised_is_both_kinds_and_crosses_a_pickle():
    import pickle

    from roving.transport.serialize import serialization_error
    made = serialization_error("cannot pickle the lock in f's arguments", pickle.PicklingError("no"))
    assert isinstance(made, transport_errors.SerializationError) and isinstance(made, pickle.PicklingError)
    assert isinstance(made, transport_errors.TransportError) and not isinstance(made, OSError)
    back = pickle.loads(pickle.dumps(made))
    assert type(back) is type(made) and str(back) == str(made)


def test_a_page_without_the_markers_is_told_so():
    with pytest.raises(ValueError, match="no error table"):
        error_table.documented_table("# a page\nwith no table\n")
