"""The coordinator of SkipPipe training: checks the run, plans it, starts one roving process per node,
feeds microbatches along their planned paths, has replicas average gradients and step, evaluates the
whole model on held-out text, checkpoints, and records metrics.

An iteration: every microbatch goes to its origin (a stage-0 node) and travels its path forward, back
to the origin for the loss, and backward along the same path (``node.py``). When all are done, the
replicas of each stage average their summed gradients over the number of microbatches the stage
processed (so a stage that was skipped by some microbatches is not trained with a smaller step), the
coordinator clips by the whole model's gradient norm, and every node takes an AdamW step.

Predicted seconds come from the planner's simulator with the compute speed measured on this machine
(``calibrate``), so measured and predicted iteration times can be compared (the simulator models the
microbatch phase, not the replica synchronisation: both are recorded).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import queue as _queue
import statistics
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path as FilePath
from typing import Any, Callable

import torch

from .costs import ModelSpec, PlanError
from .data import Corpus, load_corpus, train_batches, val_batches
from .evaluate import half_of_the_stages, kept_layers, perplexity, validation_loss
from .model import Block, Llama, LlamaConfig, preset
from .network import Network, build_network
from .node import NodeSettings, node_main, pick_device
from .paths import Plan, full_pipeline, plan
from .simulate import simulate
from .stages import Stage, layer_ranges, merge_state_dicts, model_spec

log = logging.getLogger(__name__)


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
    seed: int = 0
    checkpoint: str = ""
    checkpoint_every: int = 0
    metrics: str = ""
    plot: str = ""
    #: seconds to wait for any one message from the nodes before giving up.
    timeout: float = 300.0

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
    if config.schedule == "dtfm":
        the_plan = full_pipeline(net, spec, config.stages, config.microbatches,
                                 budget_s=config.planner_budget, seed=config.seed)
    else:
        the_plan = plan(net, spec, config.stages, config.skip, config.microbatches,
                        budget_s=config.planner_budget, seed=config.seed)
    predicted = simulate(net, spec, the_plan, record=False).makespan
    if math.isinf(predicted):
        raise PlanError("the plan deadlocks under the memory limit: raise in_flight")
    return Prepared(config, mcfg, corpus, net, spec, the_plan, predicted, cal)


class NodeFailed(RuntimeError):
    """A node raised or exited; the message carries its traceback."""


class Trainer:
    """Runs a prepared plan on roving processes. Use as a context manager (stops the nodes)."""

    def __init__(self, prep: Prepared, progress: Callable[[dict], None] | None = None) -> None:
        import roving

        self.p, self.c = prep, prep.config
        self.progress = progress or (lambda rec: None)
        if self.c.backend:
            roving.init(backend=self.c.backend)
        self.control = roving.Queue()
        self.release = roving.Queue()
        self.alloc = prep.plan.allocation
        self.replicas = {s: sorted(n for n, st in self.alloc.items() if st == s) for s in range(self.c.stages)}
        counts = [0] * self.c.stages
        for path in prep.plan.paths:
            counts[0] += 1
            for s in path.stages:
                counts[s] += 1
        self.stage_counts = counts
        self.metrics: dict[str, Any] = {
            "config": dataclasses.asdict(self.c), "calibration": prep.calibration,
            "plan": prep.plan.to_dict(), "predicted_s": prep.predicted_s, "iterations": [], "evaluations": []}
        self.procs: dict[str, Any] = {}
        self.inboxes: dict[str, Any] = {}
        self._batches = train_batches(prep.corpus.train, self.c.samples, self.c.seq_len, self.c.seed)
        self._val = val_batches(prep.corpus.val, self.c.samples, self.c.seq_len, self.c.eval_batches)
        self._t0 = time.perf_counter()
        self._train_s = 0.0

    # -- nodes -------------------------------------------------------------------------------
    def start(self) -> None:
        import roving

        net = self.p.network
        for index, (name, stage) in enumerate(sorted(self.alloc.items())):
            emulate = ({o: net.link(name, o) for o in self.alloc if o != name}
                       if self.c.emulate_network else None)
            limit = net.node(name).in_flight(stage, self.p.spec, self.c.stages)
            s = NodeSettings(name, stage, self.c.stages, self.p.model, self.c.seed, limit,
                             lr=self.c.lr, weight_decay=self.c.weight_decay, device=self.c.device,
                             bf16=self.c.bf16, threads=self.c.threads, index=index, emulate=emulate)
            proc = roving.Process(target=node_main, args=(s, self.control, self.release), name=f"stage{stage}-{name}",
                                  daemon=True)
            proc.start()
            self.procs[name] = proc
        for _ in self.procs:
            _, name, inbox = self._recv("ready")
            self.inboxes[name] = inbox
        for inbox in self.inboxes.values():
            inbox.put(("peers", self.inboxes))
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        """Stop the nodes in two phases (see ``StageNode._shut_down``); kills any that do not stop.
        After a start that failed part-way (some nodes never reported ready, so the coordinator has no
        inbox to tell them to stop, and none has its peers), the started nodes are killed at once."""
        if len(self.inboxes) < len(self.procs):
            for proc in self.procs.values():
                if proc.is_alive():
                    proc.kill()
            for proc in self.procs.values():
                proc.join(timeout=5)
            return
        try:
            for inbox in self.inboxes.values():
                inbox.put(("stop",))
            for _ in self.inboxes:
                self._recv("stopped", timeout=30.0)
            for inbox in self.inboxes.values():
                inbox.qsize()  # a round trip: our sends have all arrived, nothing is left to flush
            for _ in self.inboxes:
                self.release.put(None)
        except Exception as exc:  # a node that failed is killed below
            log.warning("nodes did not stop cleanly: %s", exc)
        for proc in self.procs.values():
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)

    def __enter__(self) -> "Trainer":
        try:
            self.start()
        except BaseException:
            # __exit__ does not run when __enter__ raises: without this, the nodes already started
            # would wait for their peers forever
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _recv(self, kind: str, timeout: float | None = None) -> tuple:
        timeout = self.c.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.control.get(timeout=1.0)
            except _queue.Empty:
                dead = [n for n, p in self.procs.items() if not p.is_alive()]
                if dead:
                    raise NodeFailed(f"node(s) {', '.join(dead)} exited while the coordinator waited for {kind!r}")
                if time.monotonic() > deadline:
                    raise NodeFailed(f"no {kind!r} message from the nodes within {timeout:g} s")
                continue
            if msg[0] == "error":
                raise NodeFailed(f"node {msg[1]} failed:\n{msg[2]}")
            if msg[0] != kind:
                raise NodeFailed(f"unexpected message {msg[0]!r} while waiting for {kind!r}")
            return msg

    # -- one iteration -----------------------------------------------------------------------
    def lr_at(self, it: int) -> float:
        c = self.c
        if it < c.warmup:
            return c.lr * (it + 1) / c.warmup
        frac = (it - c.warmup) / max(1, c.iterations - c.warmup)
        return c.min_lr + 0.5 * (c.lr - c.min_lr) * (1 + math.cos(math.pi * min(frac, 1.0)))

    def iteration(self, it: int) -> dict:
        """One whole iteration: microbatches along their paths, replica averaging, clipping, AdamW."""
        t0 = time.perf_counter()
        self._wall0 = time.time()
        losses = self.run_microbatches(it)
        t_compute = time.perf_counter() - t0
        norm = self.synchronize(it)
        coef = min(1.0, self.c.clip / (norm + 1e-6)) if self.c.clip > 0 else 1.0
        lr = self.lr_at(it)
        stats = self.step(it, coef, lr)
        seconds = time.perf_counter() - t0
        self._train_s += seconds
        rec = {"iteration": it, "train_loss": sum(losses) / len(losses), "seconds": seconds,
               "compute_seconds": t_compute, "sync_seconds": seconds - t_compute,
               "predicted_seconds": self.p.predicted_s, "grad_norm": norm, "lr": lr,
               "train_seconds_total": self._train_s,
               "peak_in_flight": max(s["peak_in_flight"] for s in stats.values()),
               "processed": {n: s["processed"] for n, s in sorted(stats.items())},
               "node_compute_seconds": {n: s["compute_s"] for n, s in sorted(stats.items())}}
        self.last_trace = {n: [(k, mb, a - self._wall0, b - self._wall0) for k, mb, a, b in s["trace"]]
                           for n, s in stats.items()}
        self.metrics["iterations"].append(rec)
        return rec

    def run_microbatches(self, it: int) -> list[float]:
        """Send every microbatch of the plan to its origin; wait until all are done; their losses."""
        plan = self.p.plan
        order = plan.priority or list(range(len(plan.paths)))
        rank = {mb: r for r, mb in enumerate(order)}
        batches = [next(self._batches) for _ in plan.paths]
        for mb in order:
            path = plan.paths[mb]
            tokens, targets = batches[mb]
            self.inboxes[path.origin].put(("mb", it, mb, rank[mb], tokens, targets, path))
        losses = [0.0] * len(plan.paths)
        for _ in plan.paths:
            _, _, mb, loss = self._recv("done")
            losses[mb] = loss
        return losses

    def synchronize(self, it: int) -> float:
        """Replicas average their gradients over the microbatches their stage processed; returns the
        whole model's gradient norm."""
        for name, s in self.alloc.items():
            self.inboxes[name].put(("sync", it, self.replicas[s], self.stage_counts[s]))
        sq: dict[int, float] = {}
        for _ in self.alloc:
            _, _, name, stage, v = self._recv("norm")
            sq.setdefault(stage, v)
        return math.sqrt(sum(sq.values()))

    def step(self, it: int, coef: float, lr: float) -> dict[str, dict]:
        """Every node scales its gradients by ``coef`` and steps; returns each node's statistics."""
        for inbox in self.inboxes.values():
            inbox.put(("step", it, coef, lr))
        stats = {}
        for _ in self.alloc:
            _, _, name, st = self._recv("stepped")
            stats[name] = st
        return stats

    # -- evaluation and checkpoints ------------------------------------------------------------
    def stage_states(self, all_replicas: bool = False, grads: bool = False) -> dict[str, tuple[int, dict]]:
        """Weights (or, with ``grads``, gradients) of one replica per stage, or of every node:
        name -> (stage, {parameter name: tensor})."""
        names = sorted(self.alloc) if all_replicas else [r[0] for r in self.replicas.values()]
        for n in names:
            self.inboxes[n].put(("grads",) if grads else ("state",))
        out = {}
        for _ in names:
            _, name, stage, sd = self._recv("state")
            out[name] = (stage, sd)
        return out

    def full_model(self) -> Llama:
        states = self.stage_states()
        model = Llama(self.p.model)
        model.load_state_dict(merge_state_dicts([sd for _, sd in states.values()]))
        return model

    @torch.no_grad()
    def evaluate(self, it: int) -> dict:
        """Validation loss and perplexity of the whole model (one replica of each stage, merged), on
        the coordinator's device; and the loss with half of the stages after 0 dropped
        (``evaluate.half_of_the_stages``)."""
        device = torch.device(pick_device(self.c.device))
        model = self.full_model().to(device).eval()
        val = validation_loss(model, self._val, bf16=self.c.bf16)
        drop = half_of_the_stages(self.c.stages)
        dropped = validation_loss(model, self._val, kept_layers(model, self.c.stages, drop), bf16=self.c.bf16)
        rec = {"iteration": it, "val_loss": val, "perplexity": perplexity(val),
               "val_loss_half_stages_dropped": dropped, "dropped_stages": drop,
               "train_seconds_total": self._train_s}
        self.metrics["evaluations"].append(rec)
        self._last_model = model.cpu()
        return rec

    def checkpoint(self, it: int, model: Llama | None = None) -> None:
        model = model or self.full_model()
        path = FilePath(self.c.checkpoint)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "model_config": dataclasses.asdict(self.p.model),
                    "config": dataclasses.asdict(self.c), "iteration": it}, path)

    def train(self) -> dict:
        """Run every iteration; evaluate every ``eval_every`` and at the end. Returns the metrics."""
        c = self.c
        self.progress({"event": "evaluation", **self.evaluate(0)})
        for it in range(c.iterations):
            self.progress({"event": "iteration", **self.iteration(it)})
            done = it + 1
            evaluated = False
            if done % c.eval_every == 0 or done == c.iterations:
                self.progress({"event": "evaluation", **self.evaluate(done)})
                evaluated = True
            if c.checkpoint and ((c.checkpoint_every and done % c.checkpoint_every == 0) or done == c.iterations):
                self.checkpoint(done, self._last_model if evaluated else None)
        if c.metrics:
            write_metrics(self.metrics, c.metrics)
        if c.plot:
            plot_losses({"run": self.metrics}, c.plot)
        return self.metrics


def write_metrics(metrics: dict, path: str) -> None:
    FilePath(path).parent.mkdir(parents=True, exist_ok=True)
    FilePath(path).write_text(json.dumps(metrics, indent=1))


def plot_losses(runs: dict[str, dict], out_png: str) -> None:
    """Train and validation loss of each run against iterations and against training seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, m in runs.items():
        its = m["iterations"]
        line, = a.plot([r["iteration"] + 1 for r in its], [r["train_loss"] for r in its], alpha=0.35, lw=1)
        ev = m["evaluations"]
        a.plot([e["iteration"] for e in ev], [e["val_loss"] for e in ev], "o-", color=line.get_color(),
               label=f"{label} (validation)")
        b.plot([e["train_seconds_total"] for e in ev], [e["val_loss"] for e in ev], "o-",
               color=line.get_color(), label=label)
    a.set_xlabel("iteration")
    a.set_ylabel("loss (nats per byte)")
    a.set_title("train (faint) and validation loss")
    a.legend(fontsize=8)
    b.set_xlabel("training seconds (wall clock)")
    b.set_ylabel("validation loss")
    b.set_title("validation loss against time")
    b.legend(fontsize=8)
    fig.tight_layout()
    FilePath(out_png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


def run(config: TrainConfig, progress: Callable[[dict], None] | None = None) -> dict:
    """Check, plan and run ``config``; returns the metrics."""
    prep = prepare(config)
    with Trainer(prep, progress) as trainer:
        return trainer.train()
