"""The README's table of errors is the one the error classes make: a new, moved, renamed or reworded
error fails here until the table is made again (``python3 scripts/error_table.py --write README.md``)."""
from __future__ import annotations

import importlib.util
import multiprocessing
from pathlib import Path

import pytest

from roving.backends import errors as backend_errors
from roving.pipeline import errors as pipeline_errors
from roving.pool import errors as pool_errors

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("error_table", ROOT / "scripts" / "error_table.py")
error_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(error_table)


def _rows(table: str) -> dict:
    """{error name: the row's cells} of a table in the README's form."""
    rows = {}
    for line in table.splitlines()[3:-1]:
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 4, f"not a row of four cells: {line!r}"
        rows[cells[0].strip("`")] = cells
    return rows


def test_the_readmes_error_table_is_the_one_the_error_classes_make():
    written = _rows(error_table.readme_table((ROOT / "README.md").read_text()))
    made = _rows(error_table.table())
    assert sorted(written) == sorted(made), "errors missing from the README's table or no longer in the code"
    for name in made:
        assert written[name] == made[name], f"{name}: the README says {written[name]}, the code {made[name]}"
    assert error_table.readme_table((ROOT / "README.md").read_text()) == error_table.table()  # order too


def test_the_table_has_every_error_of_the_error_modules_with_its_bases_and_an_import_path_that_works():
    rows = _rows(error_table.table())
    for module in (backend_errors, pool_errors, pipeline_errors):
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
    assert rows["PoolError"][1] == "multiprocessing.ProcessError" and issubclass(
        pool_errors.WorkerLostError, multiprocessing.ProcessError)
    assert rows["BackendError"][1] == "OSError"


def test_a_readme_without_the_markers_is_told_so():
    with pytest.raises(ValueError, match="no error table"):
        error_table.readme_table("# a README\nwith no table\n")
