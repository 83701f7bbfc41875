"""What a training run is, checked and planned before any node starts: ``TrainConfig`` (every field a
TOML key or a flag of ``roving pipeline train``), ``calibrate`` (this machine's compute for the cost
model) and ``prepare`` (the corpus, the network, the plan and its predicted iteration time). Bad input is
a PlanError (or DataError) here, so that nothing is started for a run that cannot work."""

from __future__ import annotations

import dataclasses
import math
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path as FilePath
from typing import Any

import torch

from .costs import ModelSpec, PlanError
from .data import Corpus, load_corpus
from .model import Block, LlamaConfig, preset
from .network import Network, build_network
from .baselines import full_pipeline
from .node import pick_device
from .plan import Plan
from .planner import plan
from .simulate import simulate
from .stages import Stage, layer_ranges, model_spec, stage_gradient_bytes


@dataclass
class TrainConfig:
    """One training run. Every field can be given in a TOML file (top-level keys) or as a flag."""

    model: str = "tiny"
    #: override the preset's layer count / width (0: the preset's).
    layers: int = 0
    dim: int = 0
    seq_len: int = 64
    network: str = "gcp12"
    nodes: Any = 6
    stages: int = 3
    skip: float = 0.33
    #: "skippipe" (this planner, any skip) or "dtfm" (the paper's full-pipeline baseline, skip 0).
    schedule: str = "skippipe"
    microbatches: int = 12
    samples: int = 4
    iterations: int = 50
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 5
    weight_decay: float = 0.1
    clip: float = 1.0
    #: microbatches each node may hold in flight (the memory limit), for nodes whose entry in a nodes
    #: file gives neither memory nor memory_mb; otherwise the node's own (as the simulator has it).
    in_flight: int = 4
    eval_every: int = 10
    eval_batches: int = 16
    corpus: list = field(default_factory=list)
    val_fraction: float = 0.1
    backend: str = ""
    emulate_network: bool = False
    device: str = "auto"
    bf16: bool = False
    threads: int = 1
    #: seconds per sample per layer (forward); 0: measure it on this machine.
    speed: float = 0.0
    planner_budget: float = 2.0
    #: simulator evaluations the SkipPipe planner shares out (0: its wall-clock budget does); with a
    #: count the plan is the same on any machine and under any load, ``planner_budget`` only caps it.
    planner_evals: int = 0
    seed: int = 0
    checkpoint: str = ""
    #: with ``checkpoint``: iterations between checkpoints (and one at the end; 0: only at the end).
    checkpoint_every: int = 10
    #: continue the run saved in ``checkpoint`` (its weights, optimizer state, metrics, data position).
    resume: bool = False
    #: iterations between in-memory snapshots of every stage (what a node takes a lost stage over from).
    snapshot_every: int = 5
    metrics: str = ""
    plot: str = ""
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
    #: seconds the planner may take to re-plan after a failure, slowdown or join.
    replan_budget: float = 0.5
    #: simulator evaluations of a re-plan's path search (0: ``replan_budget`` alone bounds it); with a
    #: count the same failure gives the same plan on any machine, ``replan_budget`` only caps it.
    replan_evals: int = 0
    #: after each re-plan, seconds to search a fresh plan for the same nodes in the background, taken
    #: at an iteration boundary when it is faster (``Trainer``, Refining); 0: never.
    refine_budget: float = 0.0
    #: attempts at one iteration (each after a failure) before giving up.
    max_retries: int = 5
    #: a folder watched for join requests (``roving pipeline join``); status.json is written there.
    control: str = ""

    @classmethod
    def from_toml(cls, path: str, **overrides: Any) -> "TrainConfig":
        try:
            doc = tomllib.loads(FilePath(path).read_text())
        except FileNotFoundError:
            raise PlanError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise PlanError(f"{path}: not valid TOML ({exc})") from None
        return cls.from_dict(doc, source=path, **overrides)

    @classmethod
    def from_dict(cls, doc: dict, source: str = "config", **overrides: Any) -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        doc = {k.replace("-", "_"): v for k, v in doc.items()}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise PlanError(f"{source}: unknown key(s) {', '.join(unknown)}; known keys are "
                            f"{', '.join(sorted(known))}")
        doc.update({k: v for k, v in overrides.items() if v is not None})
        cfg = cls(**doc)
        cfg.check()
        return cfg

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
        if isinstance(self.corpus, str):
            self.corpus = [self.corpus]

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


def calibrate(cfg: LlamaConfig, samples: int, seq_len: int, threads: int = 1, device: str = "cpu",
              repeats: int = 15) -> dict[str, float]:
    """Measure this machine's compute for the cost model: forward seconds per sample per layer, the
    backward/forward ratio, and stage 0's embedding+head+loss in layer equivalents (``ModelSpec``).
    Each is the fastest of ``repeats`` runs: on a shared machine the median moves with other work
    (several-fold on 2 busy cores), the fastest run hardly does."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dev = torch.device(device)
        block = Block(cfg).to(dev)
        stage = Stage(dataclasses.replace(cfg, n_layers=2), 0, 2).to(dev)
        cos, sin = stage.rope_cos, stage.rope_sin
        x = torch.randn(samples, seq_len, cfg.dim, device=dev)
        tokens = torch.randint(0, cfg.vocab_size, (samples, seq_len), device=dev)

        def timed(fn) -> float:
            fn()
            runs = []
            for _ in range(repeats):
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                runs.append(time.perf_counter() - t0)
            return min(runs)

        xg = x.clone().requires_grad_(True)

        def fwd() -> None:  # with autograd recording, as in training
            block(xg, cos, sin)

        def fwd_bwd() -> None:
            block(xg, cos, sin).sum().backward()

        def head() -> None:
            h = stage.embed(tokens)
            stage.loss(h, tokens).backward()

        f, fb, hd = timed(fwd), timed(fwd_bwd), timed(head)
        ratio = max(fb / f - 1.0, 0.5)
        per_layer = f
        return {"seconds_per_sample_layer": f / samples, "backward_ratio": ratio,
                "head_layers": hd / (per_layer * (1.0 + ratio))}
    finally:
        torch.set_num_threads(old)


@dataclass
class Prepared:
    """Everything checked and planned before any node starts."""

    config: TrainConfig
    model: LlamaConfig
    corpus: Corpus
    network: Network
    spec: ModelSpec
    plan: Plan
    predicted_s: float
    calibration: dict
    #: bytes of each stage's gradients (float32), which replicas exchange to average them.
    gradient_bytes: list[float] = dataclasses.field(default_factory=list)
    #: what the planner judged plans with (``plan(sync_bytes=...)``; None: the microbatch phase alone).
    plan_sync_bytes: list[float] | None = None


def prepare(config: TrainConfig, calibration: dict[str, float] | None = None) -> Prepared:
    """Check the run and plan it; raises PlanError (or DataError) with a clear message on bad input,
    before any node starts. ``calibration`` (from ``calibrate``) skips the measurement, so that runs
    to be compared share one cost model."""
    config.check()
    mcfg = config.model_config()
    layer_ranges(mcfg, config.stages)  # the model must fit the stages
    nodes = config.nodes
    if isinstance(nodes, str) and nodes.isdigit():
        nodes = int(nodes)
    net = build_network(config.network, nodes, memory=config.in_flight)
    if len(net.nodes) < config.stages:
        raise PlanError(f"network has {len(net.nodes)} node(s) but the model is split into {config.stages} "
                        "stages: every stage needs a node; add nodes or use fewer stages")
    corpus = load_corpus(config.corpus or None, val_fraction=config.val_fraction, seq_len=config.seq_len,
                         batch_samples=config.samples)
    mcfg = dataclasses.replace(mcfg, vocab_size=corpus.vocab_size)
    device = pick_device(config.device)
    if calibration is not None:
        cal = dict(calibration)
    elif config.speed > 0:
        cal = {"seconds_per_sample_layer": config.speed, "backward_ratio": 2.0, "head_layers": 1.0}
    else:
        cal = calibrate(mcfg, config.samples, config.seq_len, config.threads, device)
    spec = model_spec(mcfg, config.samples, config.seq_len,
                      bytes_per_activation=4, backward_ratio=cal["backward_ratio"], head_layers=cal["head_layers"])
    net = build_network(config.network, nodes, memory=config.in_flight, speed=cal["seconds_per_sample_layer"])
    grad_bytes = stage_gradient_bytes(mcfg, config.stages)
    if config.schedule == "dtfm":
        plan_sync = None  # the baseline: DT-FM's allocation, which has a data-parallel cost of its own
        the_plan = full_pipeline(net, spec, config.stages, config.microbatches,
                                 budget_s=config.planner_budget, seed=config.seed,
                                 max_evals=config.planner_evals or None)
    else:
        # judged by the whole iteration: the runtime's replicas exchange gradients over these links too
        plan_sync = grad_bytes
        the_plan = plan(net, spec, config.stages, config.skip, config.microbatches,
                        budget_s=config.planner_budget, seed=config.seed, sync_bytes=plan_sync,
                        max_evals=config.planner_evals or None)
    predicted = simulate(net, spec, the_plan, record=False).makespan
    if math.isinf(predicted):
        raise PlanError("the plan deadlocks under the memory limit: raise in_flight")
    return Prepared(config, mcfg, corpus, net, spec, the_plan, predicted, cal, grad_bytes, plan_sync)
