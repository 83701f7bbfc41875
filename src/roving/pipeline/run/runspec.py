"""What a training run is, checked and planned before any node starts: ``TrainConfig`` (``runconfig``:
every field a key of a TOML run file's section or a flag of ``roving pipeline train``), ``calibrate``
(this machine's compute for the cost model) and ``prepare`` (the corpus, the network, the plan and its
predicted iteration time). Bad input is a PlanError (or DataError) here, so that nothing is started for
a run that cannot work."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..planning.costs import ModelSpec
from ..errors import PlanError
from .data import Corpus, load_corpus
from ..model import Block
from ..presets import LlamaConfig
from ..planning.network import Network, build_network
from .runconfig import TrainConfig
from ..runtime.stage_process import pick_device
from ..planning.baselines import full_pipeline
from ..planning.plan import Plan
from ..planning.planner import plan
from ..planning.simulate import simulate
from ..planning.skippipe_schedule import read_schedule, schedule_network, schedule_plan
from ..stages import Stage, layer_ranges, model_spec, stage_gradient_bytes


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

        def timed(fn: Callable[[], None]) -> float:
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
    if config.skippipe_schedule:
        plan_sync = grad_bytes
        net, the_plan = _imported(config, cal["seconds_per_sample_layer"])
    elif config.schedule == "dtfm":
        plan_sync = None  # the baseline: DT-FM's allocation, which has a data-parallel cost of its own
        the_plan = full_pipeline(net, spec, config.stages, config.microbatches,
                                 budget_s=config.planner_budget, seed=config.seed,
                                 max_evals=config.planner_evals or None)
    else:
        # judged by the whole iteration: the runtime's replicas exchange gradients over these links too
        plan_sync = grad_bytes
        the_plan = plan(net, spec, config.stages, config.skip, config.microbatches,
                        budget_s=config.planner_budget, seed=config.seed, sync_bytes=plan_sync,
                        max_evals=config.planner_evals or None, route_rule=config.route_rule)
    predicted = simulate(net, spec, the_plan, record=False).makespan
    if math.isinf(predicted):
        raise PlanError("the plan deadlocks under the memory limit: raise in_flight")
    return Prepared(config, mcfg, corpus, net, spec, the_plan, predicted, cal, grad_bytes, plan_sync)


def _imported(config: TrainConfig, speed: float) -> tuple[Network, Plan]:
    """The network and plan of ``config.skippipe_schedule`` (``planning.skippipe_schedule``); PlanError
    when its stages, microbatches or node count are not the run's."""
    sched = read_schedule(config.skippipe_schedule)
    net = schedule_network(sched, config.network, speed=speed)
    the_plan = schedule_plan(sched, net)
    for name, ours, theirs in (("stages", config.stages, the_plan.stages),
                               ("microbatches", config.microbatches, len(the_plan.paths)),
                               ("nodes", config.nodes, len(net.nodes))):
        if str(ours) != str(theirs):
            raise PlanError(f"[plan] {name} is {ours!r} but the SkipPipe schedule {config.skippipe_schedule} "
                            f"makes {theirs}: give {name} = {theirs}")
    return net, the_plan
