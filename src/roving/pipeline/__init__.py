"""SkipPipe planning: which node holds which stage, and which stages each microbatch visits.

Public surface: the plain data (Network, Node, Link, ModelSpec, Plan, Route), ``plan()`` and
``replan()``, the memory model (``stage_memory``, ``microbatches_in_flight``), the simulator that
judges every plan (``simulate()``; ``predict()`` for what a running training keeps), the baselines
(``full_pipeline``, ``full_pipeline_planned``, ``random_skip``) and the errors (``PipelineError``, its
``PlanError``). Imports only the standard library
(numpy and matplotlib are not needed here; matplotlib is used lazily by the CLI's --gantt).

Training (needs PyTorch, imported on first use): ``Llama``/``LlamaConfig`` (model.py), ``Stage``
(stages.py), ``TrainConfig`` and ``prepare`` (run/runspec.py), ``Trainer`` and ``train`` (run/trainer.py).
"""

from __future__ import annotations

from typing import Any

from .planning.baselines import full_pipeline, full_pipeline_planned, random_skip
from .planning.costs import MODEL_PRESETS, ModelSpec, microbatches_in_flight, model_preset, stage_memory
from .errors import PipelineError, PlanError
from .planning.network import Link, Network, Node, build_network
from .planning.plan import Plan, Route, validate
from .planning.planner import plan, replan
from .planning.simulate import Prediction, SimResult, predict, simulate


_TRAINING = {"Llama": "model", "LlamaConfig": "presets", "Stage": "stages", "TrainConfig": "run.runspec",
             "Trainer": "run.trainer", "prepare": "run.runspec", "train": "run.trainer"}


def __getattr__(name: str) -> Any:
    """The training names, imported on first use so that planning never needs PyTorch."""
    if name in _TRAINING:
        import importlib

        module = importlib.import_module(f".{_TRAINING[name]}", __name__)
        return getattr(module, "run" if name == "train" else name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Link", "MODEL_PRESETS", "ModelSpec", "Network", "Node", "PipelineError", "Plan", "PlanError", "Prediction",
    "Route", "SimResult", "build_network", "full_pipeline", "full_pipeline_planned", "microbatches_in_flight",
    "model_preset", "plan", "predict", "random_skip", "replan", "simulate", "stage_memory", "validate",
]
