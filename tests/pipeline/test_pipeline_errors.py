"""The pipeline's errors: one base, and ValueError above it, so older ``except ValueError`` still works."""

from __future__ import annotations

import pytest

import roving.pipeline as pipeline
from roving.pipeline.planning.costs import PlanError as PlanErrorFromCosts
from roving.pipeline.run.data import DataError
from roving.pipeline.errors import PipelineError, PlanError
from roving.pipeline.run.inference import InferenceError


@pytest.mark.parametrize("cls", [PlanError, DataError, InferenceError])
def test_every_pipeline_error_is_a_pipeline_error_and_a_value_error(cls):
    assert issubclass(cls, PipelineError) and issubclass(cls, ValueError)
    with pytest.raises(ValueError, match="what was wrong"):
        raise cls("what was wrong")


def test_data_and_inference_errors_are_not_plan_errors():
    assert not issubclass(DataError, PlanError)
    assert not issubclass(InferenceError, PlanError)


def test_plan_error_is_one_class_wherever_it_is_imported_from():
    assert PlanErrorFromCosts is PlanError and pipeline.PlanError is PlanError
    assert pipeline.PipelineError is PipelineError


def test_the_train_command_reports_a_data_error_as_an_error_not_a_traceback(tmp_path, capsys):
    from roving.cli import main

    missing = tmp_path / "no-such-corpus"
    assert main(["pipeline", "train", "--corpus", str(missing)]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == f"error: corpus path {missing} does not exist"


def test_every_exception_class_of_the_pipeline_is_defined_in_errors_py_under_pipeline_error():
    import ast
    import inspect
    from pathlib import Path

    import roving.pipeline.errors as errors

    folder = Path(errors.__file__).parent
    elsewhere = []
    for path in sorted(folder.rglob("*.py")):
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(b, ast.Name) and (b.id.endswith(("Error", "Exception")) or b.id in dir(errors))
                    for b in node.bases):
                elsewhere.append(f"{path.name}:{node.lineno} {node.name}")
    assert elsewhere == [], "exception classes outside errors.py"
    defined = [c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__]
    assert len(defined) >= 10 and all(issubclass(c, PipelineError) for c in defined)
