"""What a training run is: ``TrainConfig``, in sections that a TOML run file mirrors.

A run file has one table per section (``[model]``, ``[data]``, ``[plan]``, ``[optim]``, ``[faults]``,
``[checkpoint]``, ``[run]``, ``[verify]``), each holding that section's keys (``examples/configs/*.toml``)::

    [model]
    model = "tiny"

    [plan]
    network = "gcp12"
    nodes = 6
    stages = 3

Keys may also stand at the top level, outside any table (run files written before the sections). The
keys are the fields of the section classes below; ``TrainConfig`` holds them all as flat attributes
(``cfg.lr``), is made from flat keyword arguments (``TrainConfig(lr=1e-3)``, as the flags of ``roving
pipeline train`` do) and shows one section with ``section(name)``. An unknown section or key, a key in
the wrong section or given twice, and a value of the wrong type are a PlanError naming the key and the
file.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..verify.adversary import parse_adversaries
from ..errors import PlanError
from ..presets import LlamaConfig, preset
from ..planning.plan import DEFAULT_ROUTE_RULE, check_route_rule
from ..faults import POLICIES, parse_fail_at

if sys.version_info >= (3, 11):
    import tomllib
else:  # CPython 3.10 (pyproject.toml requires tomli there)
    import tomli as tomllib


@dataclass
class ModelSection:
    """[model]: the model trained (a preset, its layer count and width overridden)."""

    model: str = "tiny"
    #: override the preset's layer count / width (0: the preset's).
    layers: int = 0
    dim: int = 0


@dataclass
class DataSection:
    """[data]: the text trained on, and the batches cut from it."""

    #: text files or folders (none: the corpus that ships with roving).
    corpus: list = field(default_factory=list)
    val_fraction: float = 0.1
    seq_len: int = 64
    #: sequences per microbatch.
    samples: int = 4
    #: validation batches per evaluation.
    eval_batches: int = 16


@dataclass
class PlanSection:
    """[plan]: the network, the split into stages, and the planner."""

    #: a preset (gcp12, aws10), a network JSON file, or the network itself (a table of regions and links).
    network: str | dict = "gcp12"
    #: a number of nodes (placed on the regions in turn), a JSON file of nodes, or a list of node tables.
    nodes: int | str | list = 6
    stages: int = 3
    skip: float = 0.33
    #: "skippipe" (this planner, any skip) or "dtfm" (the paper's full-pipeline baseline, skip 0).
    schedule: str = "skippipe"
    #: a SkipPipe schedule.json whose plan is trained (its allocation and collision-aware routes, on
    #: its nodes: ``network``'s regions by its locations): stages and microbatches must be its own, and
    #: nodes is its node count. Re-plans after a failure are this planner's. "": plan here.
    skippipe_schedule: str = ""
    #: the order a microbatch may visit its stages in (``plan.ROUTE_RULES``): "skippipe" (SkipPipe's rule:
    #: a stage at most one stage number behind the furthest reached, at most two swaps) or "inversions"
    #: (looser: at most two inversions). Re-plans keep the plan's rule; a background refinement
    #: (``refine_budget``) plans under SkipPipe's.
    route_rule: str = DEFAULT_ROUTE_RULE
    microbatches: int = 12
    #: microbatches each node may hold in flight (the memory limit), for nodes whose entry in a nodes
    #: file gives neither memory nor memory_mb; otherwise the node's own (as the simulator has it).
    in_flight: int = 4
    #: seconds per sample per layer (forward); 0: measure it on this machine.
    speed: float = 0.0
    planner_budget: float = 2.0
    #: simulator evaluations the SkipPipe planner shares out (0: its wall-clock budget does); with a
    #: count the plan is the same on any machine and under any load, ``planner_budget`` only caps it.
    planner_evals: int = 0
    #: seconds the planner may take to re-plan after a failure, slowdown or join.
    replan_budget: float = 0.5
    #: simulator evaluations of a re-plan's path search (0: ``replan_budget`` alone bounds it); with a
    #: count the same failure gives the same plan on any machine, ``replan_budget`` only caps it.
    replan_evals: int = 0
    #: after each re-plan, seconds to search a fresh plan for the same nodes in the background, taken
    #: at an iteration boundary when it is faster (``Trainer``, Refining); 0: never.
    refine_budget: float = 0.0


@dataclass
class OptimSection:
    """[optim]: AdamW, its learning-rate schedule (linear warm-up, cosine decay) and clipping."""

    iterations: int = 50
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 5
    weight_decay: float = 0.1
    #: clip the whole model's gradient norm to this (0: never).
    clip: float = 1.0


@dataclass
class FaultsSection:
    """[faults]: finding dead, slow and silent nodes, and what is done about them."""

    #: seconds to wait for any one message from the nodes before giving up.
    timeout: float = 300.0
    #: seconds without any message from the nodes while a round runs (microbatches, then averaging),
    #: every node alive, after which the round is taken as stalled (a message lost to a network drop)
    #: and run again on the same plan, as one of ``max_retries`` attempts; never less than twice the
    #: iteration the plan predicts. 0: wait ``timeout``.
    stall_after: float = 60.0
    #: seconds between a node's heartbeats, and without one before it is declared dead.
    heartbeat: float = 0.5
    dead_after: float = 2.0
    #: a node whose busy time over the plan's is this many times the median node's, for
    #: ``slow_iterations`` iterations in a row, is marked slow and planned around (0: never).
    slow_factor: float = 3.0
    slow_iterations: int = 2
    #: start a dead node again at once (it rejoins when ready).
    restart: bool = False
    #: seconds to wait at the start for every node; after that the run starts with the nodes that are
    #: ready if they hold every stage, and the others join when they start.
    start_wait: float = 60.0
    #: attempts at one iteration (each after a failure) before giving up.
    max_retries: int = 5
    #: where a stage that no live process holds gets its weights (``recovery``): "snapshot" (its latest
    #: snapshot), "skip" (dropped for good: paths skip it), "neighbours" (CheckFree's gradient-norm
    #: weighted average of the adjacent stages) or "auto" (neighbours when the snapshot is older than
    #: ``auto_snapshot_age`` iterations, else the snapshot).
    stage_recovery: str = "snapshot"
    #: a stage rebuilt from its neighbours trains with its learning rate times this from then on.
    recovery_lr_factor: float = 1.1
    #: with stage_recovery = "auto": the oldest snapshot (in iterations) still taken over.
    auto_snapshot_age: int = 10
    #: failure injection: failures of each stage (every replica killed) per ``fail_hour_iterations``
    #: iterations (a scaled hour; 0.1: 10% of the stages per hour), at random from the seed (stage 0
    #: spared; ``recovery.FailureSchedule``); 0: none.
    fail_rate: float = 0.0
    fail_hour_iterations: int = 100
    #: failure injection, scripted: "10:2,30:1" kills every replica of stage 2 at the start of
    #: iteration 10, and of stage 1 at 30 ("": none).
    fail_at: str = ""


@dataclass
class CheckpointSection:
    """[checkpoint]: weights on disk and in memory."""

    #: the file the run is saved to ("": none).
    checkpoint: str = ""
    #: with ``checkpoint``: iterations between checkpoints (and one at the end; 0: only at the end).
    checkpoint_every: int = 10
    #: continue the run saved in ``checkpoint`` (its weights, optimizer state, metrics, data position).
    resume: bool = False
    #: iterations between in-memory snapshots of every stage (what a node takes a lost stage over from).
    snapshot_every: int = 5


@dataclass
class RunSection:
    """[run]: where and how the run goes, and what it writes besides checkpoints."""

    seed: int = 0
    #: the roving backend that runs the nodes ("": the roving configuration's).
    backend: str = ""
    #: delay and throttle every link as the network describes (one-machine experiments).
    emulate_network: bool = False
    device: str = "auto"
    bf16: bool = False
    #: PyTorch threads per node.
    threads: int = 1
    #: iterations between evaluations (and one at the end).
    eval_every: int = 10
    #: per-iteration and per-evaluation metrics, as JSON ("": none).
    metrics: str = ""
    #: the loss curves, as a PNG ("": none).
    plot: str = ""
    #: a folder watched for join requests (``roving pipeline join``); status.json is written there.
    control: str = ""
    #: HOST:PORT of the open door (``door``): nodes someone else starts join with an invitation
    #: (``roving pipeline invite``, which needs ``control``); "": no door.
    open_join: str = ""


@dataclass
class VerifySection:
    """[verify]: what a stage's nodes send is checked, not trusted (issue 32; docs/guides/untrusted-nodes.md).
    The default, ``mode = "off"`` with ``aggregation = "mean"``, is training as it was."""

    #: "off" (nothing checked), "screen" (receipts, and running statistics of what crosses each stage
    #: boundary: ``screen``), "spot" (screening and recomputation of sampled computations) or "full"
    #: (every computation recomputed); ``verify`` has what each checks and does.
    mode: str = "off"
    #: mode spot: the chance that each computation a node sends the result of is recomputed by another
    #: replica of its stage (a screening suspect's: at least ``verify.SUSPECT_RATE``).
    verify_rate: float = 0.05
    #: modes spot and full: how many of a stage's other replicas (where it has that many) recompute each
    #: computation drawn. With 1, a node with an accomplice among its replicas escapes each check that
    #: draws the accomplice; with 2, a pair has no escape (each verifier's answer is held to the
    #: coordinator's own recomputation once either reports a mismatch).
    verifiers: int = 2
    #: modes spot and full: the chance that the coordinator recomputes a computation all its verifiers
    #: passed, all the same (drawn after their answers), and holds each to its own result: the only
    #: check of colluders that are all of a stage's replicas (two of a stage of 2), at the price of the
    #: coordinator's recomputation (and the weights of the node and its verifiers, once an iteration).
    #: A node that screening singles out in a round (opposed or turned: ``verify``) has all of that
    #: round's confirmed whatever this is; this is for the colluders screening does not see.
    confirm_rate: float = 0.0
    #: relative difference between a recomputation and the original still taken as equal (float
    #: nondeterminism).
    tolerance: float = 1e-3
    #: how a stage's replicas' gradient shares are combined (``aggregate``): "mean" (as before),
    #: "trimmed", "median" or "clip" (centered clipping).
    aggregation: str = "mean"
    #: adversary injection: "n03:scale:10:0.5" (``adversary``'s NODE:KIND[:FROM[:FRACTION[:STRENGTH]]];
    #: "": none).
    adversaries: str = ""


#: the sections of a run file, in the order they are written.
SECTIONS: dict[str, type] = {"model": ModelSection, "data": DataSection, "plan": PlanSection,
                             "optim": OptimSection, "faults": FaultsSection, "checkpoint": CheckpointSection,
                             "run": RunSection, "verify": VerifySection}


@dataclass
class TrainConfig(VerifySection, RunSection, CheckpointSection, FaultsSection, OptimSection, PlanSection, DataSection,
                  ModelSection):
    """One training run: every field of every section, as flat attributes. ``from_toml`` reads a run
    file, ``from_dict`` its parsed content (sections as tables, or flat keys); flags override both."""

    @classmethod
    def from_toml(cls, path: str, **overrides: object) -> "TrainConfig":
        try:
            doc = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise PlanError(f"config file {path} does not exist") from None
        except (IsADirectoryError, UnicodeDecodeError) as exc:
            raise PlanError(f"config file {path} cannot be read: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise PlanError(f"{path}: not valid TOML ({exc})") from None
        return cls.from_dict(doc, source=path, **overrides)

    @classmethod
    def from_dict(cls, doc: dict, source: str = "config", **overrides: object) -> "TrainConfig":
        """A config from a run file's content (``source`` names it in errors), then ``overrides``
        (flat keys; None values are left out: a flag not given)."""
        flat = flatten(doc, source)
        flat.update({k: v for k, v in overrides.items() if v is not None})
        cfg = cls(**flat)
        cfg.check()
        return cfg

    def section(self, name: str) -> Any:
        """Section ``name`` (a key of ``SECTIONS``) of this config, as its own dataclass."""
        if name not in SECTIONS:
            raise KeyError(f"no section {name!r}; the sections are {', '.join(SECTIONS)}")
        kind = SECTIONS[name]
        return kind(**{f.name: getattr(self, f.name) for f in dataclasses.fields(kind)})

    def as_sections(self) -> dict[str, dict[str, Any]]:
        """This config as a run file's tables: {section: {key: value}}."""
        return {name: dataclasses.asdict(self.section(name)) for name in SECTIONS}

    def check(self) -> None:
        for name in ("stages", "microbatches", "samples", "iterations", "seq_len", "in_flight", "threads"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise PlanError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not 0.0 <= self.skip < 1.0:
            raise PlanError(f"skip must be in [0, 1), got {self.skip}")
        if self.schedule not in ("skippipe", "dtfm"):
            raise PlanError(f"schedule must be skippipe or dtfm, got {self.schedule!r}")
        if self.schedule == "dtfm" and self.skip:
            raise PlanError("the dtfm schedule is a full pipeline: use skip = 0 with it")
        check_route_rule(self.route_rule)
        if not isinstance(self.skippipe_schedule, str) or (self.skippipe_schedule and self.schedule != "skippipe"):
            raise PlanError(f"skippipe_schedule must be the path of a SkipPipe schedule.json, trained with schedule "
                            f"= skippipe, got {self.skippipe_schedule!r} with schedule {self.schedule!r}")
        if not 0 < self.heartbeat < self.dead_after:
            raise PlanError(f"heartbeat ({self.heartbeat} s) must be positive and below dead_after "
                            f"({self.dead_after} s)")
        if self.resume and not self.checkpoint:
            raise PlanError("resume needs checkpoint = the file the run to continue wrote")
        for name, by in (("planner_evals", "planner_budget"), ("replan_evals", "replan_budget")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PlanError(f"{name} must be a count >= 0 (0: plan by {by} alone), got {value!r}")
        for name in ("replan_budget", "refine_budget", "stall_after"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise PlanError(f"{name} must be a number of seconds >= 0, got {value!r}")
        for name in ("snapshot_every", "checkpoint_every", "max_retries"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise PlanError(f"{name} must be a non-negative integer, got {getattr(self, name)!r}")
        self._check_recovery()
        self._check_verify()
        if isinstance(self.corpus, str):
            self.corpus = [self.corpus]

    def _check_recovery(self) -> None:
        if self.stage_recovery not in POLICIES:
            raise PlanError(f"stage_recovery must be one of {', '.join(POLICIES)}, got {self.stage_recovery!r}")
        f = self.recovery_lr_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not (0 < f < math.inf):
            raise PlanError(f"recovery_lr_factor must be a positive number (CheckFree uses 1.1-1.2), got {f!r}")
        for name in ("auto_snapshot_age", "fail_hour_iterations"):
            v, least = getattr(self, name), 0 if name == "auto_snapshot_age" else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise PlanError(f"{name} must be an integer >= {least} (iterations), got {v!r}")
        r = self.fail_rate
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not (0 <= r <= self.fail_hour_iterations):
            raise PlanError(f"fail_rate must be the failures of each stage per fail_hour_iterations "
                            f"({self.fail_hour_iterations}) iterations, from 0 to that, got {r!r}")
        if not isinstance(self.fail_at, str):
            raise PlanError(f"fail_at must be a string like \"10:2,30:1\", got {self.fail_at!r}")
        scripted = parse_fail_at(self.fail_at, self.stages)
        if self.stage_recovery == "skip" and any(0 in st for st in scripted.values()):
            raise PlanError("fail_at kills stage 0, which stage_recovery = \"skip\" cannot skip (it holds the "
                            "embedding, head and loss): use another policy or another stage")

    def _check_verify(self) -> None:
        from ..verify.aggregate import RULES

        if self.mode not in MODES:
            raise PlanError(f"mode ([verify]) must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.aggregation not in RULES:
            raise PlanError(f"aggregation must be one of {', '.join(RULES)}, got {self.aggregation!r}")
        r = self.verify_rate
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= 1:
            raise PlanError(f"verify_rate must be a chance from 0 to 1, got {r!r}")
        r = self.confirm_rate
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= 1:
            raise PlanError(f"confirm_rate must be a chance from 0 to 1, got {r!r}")
        k = self.verifiers
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise PlanError(f"verifiers must be a whole number of replicas >= 1, got {k!r}")
        t = self.tolerance
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < math.inf:
            raise PlanError(f"tolerance must be a relative difference >= 0, got {t!r}")
        parse_adversaries(self.adversaries, self.seed)

    def lr_at(self, it: int) -> float:
        """The learning rate at iteration ``it``: linear warm-up over ``warmup`` iterations, then a cosine
        down to ``min_lr`` at the last iteration."""
        if it < self.warmup:
            return self.lr * (it + 1) / self.warmup
        frac = (it - self.warmup) / max(1, self.iterations - self.warmup)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * min(frac, 1.0)))

    def model_config(self) -> LlamaConfig:
        try:
            base = preset(self.model)
            over = {"max_seq_len": max(self.seq_len, 1)}
            if self.layers:
                over["n_layers"] = self.layers
            if self.dim:
                over["dim"] = self.dim
            return dataclasses.replace(base, **over)
        except (ValueError, TypeError) as exc:
            raise PlanError(f"model: {exc}") from None


#: the verification modes, as ``[verify] mode`` names them.
MODES = ("off", "screen", "spot", "full")
#: each key's section.
SECTION_OF: dict[str, str] = {f.name: name for name, kind in SECTIONS.items() for f in dataclasses.fields(kind)}
_TYPES = {f.name: str(f.type) for kind in SECTIONS.values() for f in dataclasses.fields(kind)}  # annotations: strings


def flatten(doc: dict, source: str = "config") -> dict[str, Any]:
    """A run file's content as flat keys, each checked: its section exists, it is a key of that section
    (or of some section, at the top level), it is not given twice, its value has the key's type.
    PlanError naming ``source`` and the key otherwise. Dashes in keys read as underscores."""
    if not isinstance(doc, dict):
        raise PlanError(f"{source}: a run file is a table of sections, got a {type(doc).__name__}")
    flat: dict[str, Any] = {}
    where: dict[str, str] = {}
    items: list[tuple[str, Any, str | None]] = []
    for key, value in doc.items():
        name = key.replace("-", "_")
        if name in SECTIONS and isinstance(value, dict):
            items += [(k, v, name) for k, v in value.items()]
        elif name in SECTIONS and name not in SECTION_OF:
            raise PlanError(f"{source}: [{name}] is a section: give it as a table of keys, got {value!r}")
        elif name not in SECTION_OF and isinstance(value, dict):
            raise PlanError(f"{source}: unknown section [{key}]; the sections are "
                            f"{', '.join(f'[{s}]' for s in SECTIONS)}")
        else:
            items.append((key, value, None))
    unknown = [f"[{t}] {k}" if t else k for k, _, t in items if k.replace("-", "_") not in SECTION_OF]
    if unknown:
        tables = sorted({t for k, _, t in items if t and k.replace("-", "_") not in SECTION_OF})
        known = "; ".join(f"[{t}] has {', '.join(f.name for f in dataclasses.fields(SECTIONS[t]))}" for t in tables)
        raise PlanError(f"{source}: unknown key(s) {', '.join(unknown)}; "
                        + (known or f"the keys are those of the sections {', '.join(f'[{s}]' for s in SECTIONS)} "
                                    f"(a table each, or at the top level): {', '.join(sorted(SECTION_OF))}"))
    for key, value, table in items:
        key = key.replace("-", "_")
        label = f"[{table}] {key}" if table else key
        if table and SECTION_OF[key] != table:
            raise PlanError(f"{source}: {key} belongs in [{SECTION_OF[key]}], not in [{table}]")
        if key in flat:
            raise PlanError(f"{source}: {key} is given twice ({where[key]} and {label})")
        problem = _type_problem(key, value)
        if problem:
            raise PlanError(f"{source}: {label} must be {problem}, got {value!r} ({type(value).__name__})")
        flat[key], where[key] = value, label
    return flat


_WANT = {"int": "an integer", "float": "a number", "str": "a string", "list": "a list of strings",
         "str | dict": "a string (a preset or a file) or a table",
         "int | str | list": "an integer, a string (a file) or a list of node tables"}


def _type_problem(key: str, value: Any) -> str:
    """What ``value`` should be for ``key`` when it is not ("" when it is)."""
    want = _TYPES[key]
    if want == "bool":
        return "" if isinstance(value, bool) else "true or false"
    if isinstance(value, bool):
        return _WANT[want]
    if want == "int":
        return "" if isinstance(value, int) else "an integer"
    if want == "float":
        return "" if isinstance(value, (int, float)) else "a number"
    if want == "str":
        return "" if isinstance(value, str) else "a string"
    if want == "str | dict":
        return "" if isinstance(value, (str, dict)) else _WANT[want]
    if want == "int | str | list":
        return "" if isinstance(value, (int, str, list)) else _WANT[want]
    if want == "list":  # the corpus: one path, or a list of paths
        ok = isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
        return "" if ok else "a list of strings"
    raise AssertionError(f"no type rule for {key} ({want})")
