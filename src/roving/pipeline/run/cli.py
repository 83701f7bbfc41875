"""`roving pipeline` and its commands; the planning ones (`plan`, `simulate`) are in ``plan_cli``."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any, Callable

from ..runtime.control import STATUS, ControlFolder
from ..errors import NodeFailed, PipelineError
from .outputs import check_output
from .plan_cli import Subparsers, add_plan_parsers, note

def add_pipeline_parser(subparsers: Subparsers) -> None:
    """Register `pipeline plan`, `simulate`, `train` and the run tools on an argparse subparsers object."""
    pipeline = subparsers.add_parser("pipeline", help="skip-pipeline training tools")
    sub = pipeline.add_subparsers(dest="pipeline_command", required=True)
    add_plan_parsers(sub)
    add_train_parser(sub)
    add_inference_parsers(sub)


def add_inference_parsers(sub: Subparsers) -> None:
    """Register `pipeline eval` and `pipeline generate` on the pipeline subparsers object. Their module
    (roving.pipeline.run.inference) needs torch, the `pipeline` extra: it is imported when one of them runs, so
    that every other `roving` command works where torch is not installed."""
    e = sub.add_parser("eval", help="validation perplexity of a checkpoint, whole and with stages dropped")
    _common(e)
    e.add_argument("--subsets", type=int, default=8,
                   help="with --drop: evaluate every subset of that size when there are at most this many, "
                        "else this many random ones (default 8)")
    e.add_argument("--seed", type=int, default=0, help="picks the random subsets")
    e.add_argument("--corpus", action="append", help="evaluate on this text file or folder's validation split "
                   "instead of the training corpus (repeatable)")
    e.add_argument("--batches", type=int, default=None, help="validation batches (default: the training run's)")
    e.add_argument("--json", dest="json_out", default=None, help="also write the figures to this JSON file")
    e.set_defaults(handler=_inference_command("run_eval"))
    g = sub.add_parser("generate", help="continue a prompt with a checkpoint, optionally with stages dropped")
    _common(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--tokens", type=int, default=200, help="bytes to generate (default 200)")
    g.add_argument("--temperature", type=float, default=0.8, help="0: always the most likely byte")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely bytes (0: all)")
    g.add_argument("--seed", type=int, default=0, help="the sampling, and with --drop the subset dropped")
    g.set_defaults(handler=_inference_command("run_generate"))


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="a file written by `roving pipeline train --checkpoint`")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--drop", type=float, default=None, metavar="FRACTION",
                       help="drop round(FRACTION x (stages - 1)) of the stages after 0, chosen at random")
    which.add_argument("--stages", default=None, metavar="LIST", help="drop these stages, e.g. 1,3")


def _inference_command(name: str) -> Callable[[argparse.Namespace], int]:
    def handler(args: argparse.Namespace) -> int:
        from . import inference

        return getattr(inference, name)(args)

    return handler


def add_train_parser(sub: Subparsers) -> None:
    """`pipeline train`: a TOML config (``TrainConfig``'s fields) with flags for the common fields.
    Its flags in ``--help``'s order: the run's here, then those of [faults] and [verify] (one function
    each); the commands that act on a running training are made by :func:`_add_run_tool_parsers`."""
    t = sub.add_parser("train", help="train a LLaMA-style model by skip-pipelining across roving processes")
    t.add_argument("--config", default=None,
                   help="TOML run file: [model], [data], [plan], [optim], [faults], [checkpoint] and [run] tables "
                        "of TrainConfig fields, or the fields as top-level keys (examples/configs/*.toml); "
                        "flags override it")
    t.add_argument("--model", help="model preset (tiny, small, 500m, 1b)")
    t.add_argument("--network", help="preset (gcp12, aws10) or a network JSON file")
    t.add_argument("--nodes", help="number of nodes or a JSON file of nodes")
    t.add_argument("--stages", type=int)
    t.add_argument("--skip", type=float, help="fraction of stages each microbatch skips")
    t.add_argument("--schedule", choices=("skippipe", "dtfm"), help="dtfm: the full-pipeline baseline")
    t.add_argument("--skippipe-schedule", metavar="FILE",
                   help="train the plan of a SkipPipe schedule.json (its nodes, stages and routes)")
    t.add_argument("--microbatches", type=int, help="per iteration")
    t.add_argument("--samples", type=int, help="sequences per microbatch")
    t.add_argument("--seq-len", type=int)
    t.add_argument("--iterations", type=int)
    t.add_argument("--lr", type=float)
    t.add_argument("--eval-every", type=int)
    t.add_argument("--backend", help="roving backend that runs the nodes (local, slurm, docker, kubernetes)")
    t.add_argument("--emulate-network", action=argparse.BooleanOptionalAction, default=None,
                   help="delay and throttle every link as the network describes (one-machine experiments)")
    t.add_argument("--corpus", action="append", help="text file or folder to train on (repeatable)")
    t.add_argument("--device", help="auto (CUDA when there is one), cpu, cuda, cuda:N")
    t.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None, help="bf16 autocast")
    t.add_argument("--seed", type=int)
    t.add_argument("--checkpoint", help="where to save the model (at the end and every --checkpoint-every)")
    t.add_argument("--checkpoint-every", type=int,
                   help="iterations between checkpoints, each with every stage's optimizer state, for --resume "
                        "(default 10; 0: only at the end)")
    t.add_argument("--metrics", help="write per-iteration and per-evaluation metrics to this JSON file")
    t.add_argument("--plot", help="draw the loss curves to this PNG")
    t.add_argument("--resume", action="store_true", default=None,
                   help="continue the run saved in --checkpoint (after the coordinator died)")
    t.add_argument("--snapshot-every", type=int,
                   help="iterations between in-memory snapshots of every stage (what a lost stage is taken "
                        "over from; default 5)")
    t.add_argument("--dead-after", type=float,
                   help="seconds without a heartbeat before a node is declared dead (default 2)")
    t.add_argument("--start-wait", type=float,
                   help="seconds to wait at the start for every node; then the run starts with those ready "
                        "if they hold every stage, and the others join when they start (default 60)")
    t.add_argument("--stall-after", type=float,
                   help="seconds without any message from the nodes during a round after which it is run "
                        "again on the same plan (a message lost to a network drop; default 60, 0: off)")
    t.add_argument("--refine-budget", type=float,
                   help="after each re-plan (failure, slowdown, join), seconds to search a fresh plan for the "
                        "same nodes in the background; taken between iterations when it is faster (default 0: off)")
    t.add_argument("--restart", action=argparse.BooleanOptionalAction, default=None,
                   help="start dead nodes again at once; they rejoin when ready")
    t.add_argument("--control", help="folder watched for join requests (`roving pipeline join`); "
                                     "status.json is written there every iteration")
    t.add_argument("--open-join", metavar="HOST:PORT",
                   help="open a door at HOST:PORT through which nodes that others start (`roving pipeline node`) "
                        "join with an invitation (`roving pipeline invite`, which needs --control)")
    t.add_argument("--dashboard", action="store_true",
                   help="serve the live dashboard (roving's `dashboard` option) with this run's pipeline view; "
                        "without --control a fresh temporary control folder is used")
    _add_fault_flags(t)
    _add_verify_flags(t)
    t.set_defaults(handler=run_train)
    _add_run_tool_parsers(sub)


def _add_fault_flags(t: argparse.ArgumentParser) -> None:
    """`pipeline train`'s flags of stage recovery and failure injection ([faults])."""
    t.add_argument("--stage-recovery", choices=("snapshot", "skip", "neighbours", "auto"),
                   help="where a stage with no live node gets its weights: its snapshot (default), skip it for "
                        "good, CheckFree's average of its neighbours, or auto (neighbours when the snapshot is "
                        "older than --auto-snapshot-age)")
    t.add_argument("--recovery-lr-factor", type=float,
                   help="learning-rate factor of a stage rebuilt from its neighbours (default 1.1)")
    t.add_argument("--auto-snapshot-age", type=int,
                   help="with --stage-recovery auto: the oldest snapshot, in iterations, still used (default 10)")
    t.add_argument("--fail-rate", type=float,
                   help="failure injection: failures of each stage (every node of it killed) per "
                        "--fail-hour-iterations iterations (0.1: 10%% of the stages per hour), at random from "
                        "--seed (stage 0 spared; default 0)")
    t.add_argument("--fail-hour-iterations", type=int,
                   help="iterations that count as an hour for --fail-rate (default 100)")
    t.add_argument("--fail-at", help='failure injection, scripted: "10:2,30:1" kills every node of stage 2 at the '
                                     "start of iteration 10, and of stage 1 at 30")


def _add_verify_flags(t: argparse.ArgumentParser) -> None:
    """`pipeline train`'s flags of [verify]: checks of what untrusted nodes send, adversary injection."""
    t.add_argument("--verify", dest="mode", choices=("off", "screen", "spot", "full"),
                   help="[verify] mode: what is checked of what the nodes send: nothing (off, the default), "
                        "screening statistics (screen), sampled recomputations too (spot), every computation "
                        "recomputed (full)")
    t.add_argument("--verify-rate", type=float,
                   help="mode spot: the chance that each computation a node sends the result of is recomputed "
                        "by another replica of its stage (default 0.05)")
    t.add_argument("--verifiers", type=int,
                   help="modes spot and full: how many of a stage's other replicas recompute each computation "
                        "drawn, where it has that many (default 2: two colluding replicas cannot pass each "
                        "other's work)")
    t.add_argument("--confirm-rate", type=float,
                   help="modes spot and full: the chance that the coordinator recomputes a computation its "
                        "verifiers all passed, all the same (default 0; what catches colluders that are a "
                        "whole stage where screening does not single them out: where it does, their round's "
                        "checks are all confirmed)")
    t.add_argument("--tolerance", type=float,
                   help="relative difference a recomputation may have from the original (default 1e-3)")
    t.add_argument("--aggregation", choices=("mean", "trimmed", "median", "clip"),
                   help="how a stage's replicas' gradients are combined: the mean (default), a trimmed mean, "
                        "the coordinate-wise median or centered clipping")
    t.add_argument("--adversaries",
                   help='adversary injection: "n03:scale:10:0.5:4,n05:nan" (NODE:KIND[:FROM[:FRACTION[:STRENGTH]]]; '
                        "kinds noise, scale, signflip, lazy, bias, nan, weights, drift, collude, frame)")


def _add_run_tool_parsers(sub: Subparsers) -> None:
    """The commands that watch or change a running `pipeline train`: dashboard, join, status."""
    d = sub.add_parser("dashboard", help="serve the dashboard of a `pipeline train --control DIR` run started "
                                         "elsewhere (live), or of a finished run's --metrics file")
    d.add_argument("--control", default=None, help="the run's --control folder")
    d.add_argument("--metrics", default=None, help="a finished run's metrics file (--metrics of `pipeline train`)")
    d.add_argument("--host", default=None, help="address to listen on (default: the dashboard_host option, 127.0.0.1)")
    d.add_argument("--port", type=int, default=None, help="port (default: the dashboard_port option, 0: a free one)")
    d.set_defaults(handler=run_dashboard)
    j = sub.add_parser("join", help="add nodes to a running `pipeline train` (started with --control)")
    j.add_argument("--control", required=True, help="the run's --control folder")
    j.add_argument("--name", default=None, help="restart this node (one that died) or name the new node")
    j.add_argument("--region", default=None, help="region of a new node (default: the regions in turn)")
    j.add_argument("--count", type=int, default=1, help="how many nodes to add")
    j.add_argument("--timeout", type=float, default=120.0,
                   help="seconds to wait for the run to take the request (it does between iterations)")
    j.set_defaults(handler=run_join)
    inv = sub.add_parser("invite", help="make (or revoke) an invitation through a running training's open door")
    inv.add_argument("--control", required=True, help="the run's --control folder")
    inv.add_argument("--ttl", type=float, default=None, help="seconds the invitation is valid (default 3600)")
    inv.add_argument("--revoke", default=None, metavar="ID", help="revoke this invitation (not used yet)")
    inv.add_argument("--timeout", type=float, default=120.0,
                     help="seconds to wait for the run to take the request (it does between iterations)")
    inv.set_defaults(handler=run_invite)
    nd = sub.add_parser("node", help="serve a running training as one of its nodes, joining through its open door")
    nd.add_argument("--join", required=True, metavar="HOST:PORT", help="the training's open door")
    nd.add_argument("--invite", required=True, metavar="TOKEN", help="an invitation (`roving pipeline invite`)")
    nd.add_argument("--region", default=None, help="the region this node is in (default: the run's choice)")
    nd.add_argument("--device", default=None, help="auto (CUDA when there is one), cpu, cuda, cuda:N")
    nd.add_argument("--threads", type=int, default=None, help="PyTorch threads (default: the run's)")
    nd.add_argument("--coordinator-timeout", type=float, default=60.0, metavar="S",
                    help="leave when the training's coordinator has not answered for S seconds (default 60; "
                         "0: wait for ever)")
    nd.set_defaults(handler=run_node)
    st = sub.add_parser("status", help="where a running `pipeline train --control DIR` is: nodes, stages, events")
    st.add_argument("--control", required=True, help="the run's --control folder")
    st.add_argument("--json", action="store_true", help="print the status as JSON")
    st.set_defaults(handler=run_status)


def run_dashboard(args: argparse.Namespace) -> int:
    from roving import dashboard

    return dashboard.serve_pipeline(args.control, args.metrics, args.host, args.port)


def _start_dashboard(cfg: Any) -> Any:
    """`pipeline train --dashboard`: the dashboard of this process, watching the run's control folder
    (a temporary one when none was given); the configuration with that folder."""
    import dataclasses
    import tempfile

    from roving import dashboard

    if not cfg.control:
        cfg = dataclasses.replace(cfg, control=tempfile.mkdtemp(prefix="roving-control-"))
    dashboard.start()
    dashboard.watch_pipeline(cfg.control, cfg.metrics)
    return cfg


def run_status(args: argparse.Namespace) -> int:
    folder = ControlFolder(args.control)
    path = folder.path / STATUS
    try:
        doc = folder.read_status()
    except FileNotFoundError:
        print(f"error: {args.control} is not the control folder of a `roving pipeline train --control` run "
              f"(no {STATUS} in it)", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and json.JSONDecodeError are ValueErrors
        print(f"error: {path}: not a status file written by `roving pipeline train` ({exc})", file=sys.stderr)
        return 2
    problem = _status_problem(doc)
    if problem:
        print(f"error: {path}: not a status file written by `roving pipeline train` ({problem})", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    by_stage: dict = {}
    for name, stage in doc["nodes"].items():
        by_stage.setdefault(stage, []).append(name)
    loss = doc.get("train_loss")
    print(f"iteration {doc['iterations_done']}/{doc['iterations']}"
          + (f", train loss {loss:.4f}, {doc['iteration_seconds']:.3f} s per iteration" if loss is not None else ""))
    for stage in sorted(by_stage, key=int):
        print(f"  stage {stage}: {', '.join(sorted(by_stage[stage]))}")
    if doc["missing_stages"]:
        print(f"  held by no node (skipped until a node takes them over): {doc['missing_stages']}")
    if doc["starting"]:
        print(f"  starting, will join: {', '.join(doc['starting'])}")
    if doc.get("refining"):
        print("  a fresh plan is being searched in the background (--refine-budget)")
    for e in doc.get("caught") or []:
        print(f"  caught by verification at iteration {e.get('iteration')}: {_verify_line(e)}")
    for e in doc["recent_events"]:
        what = ", ".join(e.get("nodes") or [])
        if e["event"] == "refine":
            what = e["error"] if e.get("error") else ("taken" if e.get("adopted") else "not faster: not taken")
        elif e["event"] == "recovery":
            what = _recovery_line(e)
        elif e["event"] in ("caught", "dispute", "suspect"):
            what = _verify_line(e)
        print(f"  [{e['event']}] at iteration {e.get('iteration')}: {what}")
    return 0


def _verify_line(e: dict) -> str:
    """A verification event of status.json in words: who, which check, the evidence."""
    if e["event"] == "suspect":
        return f"{e.get('node')} (screening: {e.get('check')} at {e.get('boundary')})"
    if e["event"] == "dispute":
        return f"{', '.join(e.get('nodes') or [])}: {e.get('why')}"
    text = f"{e.get('node')} excluded ({e.get('check')} check"
    if e.get("computation"):
        text += f" of {e.get('computed_by')}'s {e['computation']}, stage {e.get('stage')}"
        if isinstance(e.get("mb"), int) and e["mb"] >= 0:  # (a share's, or weights', is the round's)
            text += f", microbatch {e['mb']}"
    if e.get("verifier"):
        text += f"; verifier {e['verifier']}"
    for key, label in (("difference", "its difference"), ("confirmed_difference", "confirmed")):
        if isinstance(e.get(key), (int, float)):
            text += f", {label} {e[key]:.3g}"
    return text + (f"): {e['why']}" if e.get("why") else ")")


def _recovery_line(e: dict) -> str:
    """A "recovery" event of status.json in words: the stage, the policy's choice and its inputs."""
    text = f"stage {e.get('stage')} by {e.get('chosen')} (stage_recovery = {e.get('policy')}"
    if e.get("snapshot_age") is not None:
        text += f", snapshot {e['snapshot_age']} iterations old"
    if e.get("neighbours"):
        norms = e.get("grad_norms") or {}
        text += ", neighbours " + ", ".join(f"{s} (gradient norm {norms.get(s, norms.get(str(s), float('nan'))):.4g})"
                                            for s in e["neighbours"])
    if e.get("why"):
        text += f"; {e['why']}"
    return text + ")" + (f", nodes {', '.join(e['nodes'])}" if e.get("nodes") else "")


_STATUS_KEYS = {"iterations_done": int, "iterations": int, "nodes": dict, "missing_stages": list,
                "starting": list, "recent_events": list}


def _status_problem(doc: Any) -> str:
    """What is wrong with a status.json document for `pipeline status`, or "" when nothing is."""
    if not isinstance(doc, dict):
        return f"it holds a JSON {type(doc).__name__}, not an object"
    for key, kind in _STATUS_KEYS.items():
        if key not in doc:
            return f"it lacks {key}"
        if not isinstance(doc[key], kind):
            return f"its {key} is a {type(doc[key]).__name__}, not a {kind.__name__}"
    if not all(isinstance(v, int) for v in doc["nodes"].values()):
        return "its nodes do not map node names to stage numbers"
    if not all(isinstance(e, dict) and "event" in e for e in doc["recent_events"]):
        return "its recent_events are not events"
    loss = doc.get("train_loss")
    if loss is not None and not (isinstance(loss, (int, float)) and isinstance(doc.get("iteration_seconds"),
                                                                               (int, float))):
        return "its train_loss or iteration_seconds is not a number"
    return ""


def run_join(args: argparse.Namespace) -> int:
    """Drop a join request into the run's control folder and wait for its answer."""
    folder = ControlFolder(args.control)
    if not folder.exists(STATUS):
        print(f"error: {folder.path} is not the control folder of a running `roving pipeline train --control` "
              f"(no {STATUS} in it)", file=sys.stderr)
        return 2
    if args.count < 1:
        print(f"error: --count must be at least 1, got {args.count}", file=sys.stderr)
        return 2
    if args.name is not None and args.count != 1:
        print("error: --name names one node: use it with --count 1", file=sys.stderr)
        return 2
    doc = folder.request_join(args.name, args.region, args.count, args.timeout)
    if doc is None:
        print(f"error: the run did not take the request within {args.timeout:g} s (is it running?)",
              file=sys.stderr)
        return 1
    if "error" in doc:
        print(f"error: {doc['error']}", file=sys.stderr)
        return 2
    print(f"started {', '.join(doc['started'])}: they join the training when ready (see {STATUS})")
    return 0


def run_invite(args: argparse.Namespace) -> int:
    if args.ttl is not None and not args.ttl > 0:
        print(f"error: --ttl must be a positive number of seconds, not {args.ttl:g}", file=sys.stderr)
        return 2
    doc = ControlFolder(args.control).request_invite(args.ttl, args.revoke, args.timeout)
    if doc is None:
        print(f"error: the run did not take the request within {args.timeout:g} s (is it running with "
              f"--control {args.control} --open-join?)", file=sys.stderr)
        return 1
    if "error" in doc:
        print(f"error: {doc['error']}", file=sys.stderr)
        return 2
    if "revoked" in doc:
        print(f"revoked invitation {doc['revoked']}")
        return 0
    print(f"invitation {doc['id']} (single use), for the door at {doc['door']}:")
    print(f"  roving pipeline node --join {doc['door']} --invite {doc['token']}")
    return 0


def run_node(args: argparse.Namespace) -> int:
    import dataclasses
    import os

    from ...transport import session
    from ..errors import CoordinatorLost
    from ..runtime.door import JoinError, credentials_of, join
    from ..runtime.stage_process import stage_main

    if args.coordinator_timeout < 0:
        print(f"error: --coordinator-timeout must be 0 or more seconds, got {args.coordinator_timeout:g}",
              file=sys.stderr)
        return 2
    # a node writes to sockets whose other end may go at any time: EPIPE is an error it handles, never a
    # silent death by SIGPIPE (which the command's output listing sets back to its default)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    seed = os.urandom(32)  # this node's keys: made here, never sent anywhere
    try:
        placement = join(args.join, args.invite, seed, args.region)
    except JoinError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    session.enter(credentials_of(placement, seed), towards=placement.control.node)
    settings = dataclasses.replace(placement.settings, device=args.device or placement.settings.device,
                                   threads=args.threads or placement.settings.threads,
                                   coordinator_timeout=args.coordinator_timeout)
    print(f"joined the training at {args.join} as node {placement.name}; serving until it ends", flush=True)
    try:
        stage_main(settings, placement.control, placement.beats)
    except CoordinatorLost as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"node {placement.name}: the training released it", flush=True)
    return 0


def run_train(args: argparse.Namespace) -> int:
    from .trainer import TrainConfig, run

    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # the coordinator writes to nodes' sockets (as run_node)

    fields = ("model", "network", "nodes", "stages", "skip", "schedule", "skippipe_schedule", "microbatches",
              "samples", "seq_len",
              "iterations", "lr", "eval_every", "backend", "emulate_network", "corpus", "device", "bf16",
              "seed", "checkpoint", "checkpoint_every", "metrics", "plot", "resume", "snapshot_every",
              "dead_after", "start_wait", "stall_after", "refine_budget", "restart", "control", "open_join",
              "stage_recovery",
              "recovery_lr_factor", "auto_snapshot_age", "fail_rate", "fail_hour_iterations", "fail_at",
              "mode", "verify_rate", "verifiers", "confirm_rate", "tolerance", "aggregation", "adversaries")
    overrides = {f: getattr(args, f) for f in fields}
    try:
        if args.config:
            cfg = TrainConfig.from_toml(args.config, **overrides)
        else:
            cfg = TrainConfig.from_dict({}, source="flags", **overrides)
        for option, path in (("--metrics", cfg.metrics), ("--plot", cfg.plot)):
            if path:
                check_output(path, option, make_parents=True)
        if cfg.checkpoint and not cfg.resume:
            check_output(cfg.checkpoint, "--checkpoint", make_parents=True)
        if cfg.control:
            check_output(cfg.control, "--control", make_parents=True, folder=True)
        if args.dashboard:
            cfg = _start_dashboard(cfg)
        note(_resolved_run(cfg, args.config))
        metrics = run(cfg, progress=_show_progress(cfg.iterations))
    except NodeFailed as exc:  # first: a NodeFailed is a PipelineError too, but not bad input
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    its = metrics["iterations"]
    if its:
        mean = sum(r["compute_seconds"] for r in its) / len(its)
        print(f"done: {len(its)} iterations, microbatch phase {mean:.3f} s on average "
              f"(simulator predicted {metrics['predicted_s']:.3f} s)")
    for what, path in (("metrics", cfg.metrics), ("loss plot", cfg.plot), ("checkpoint", cfg.checkpoint)):
        if path:
            print(f"{what}: {path}")
    return 0


def _resolved_run(cfg: Any, source: str | None) -> str:
    """What `pipeline train` is about to run, defaults filled in: one line for stderr."""
    from ... import config as _config

    backend = cfg.backend or f"{_config.current().backend} (the roving configuration's)"
    schedule = "dtfm (full pipelines)" if cfg.schedule == "dtfm" else f"skippipe, skip {cfg.skip:g}"
    return (f"training {cfg.model} on network {cfg.network}: {cfg.nodes} nodes, {cfg.stages} stages, "
            f"{schedule}, {cfg.iterations} iterations, backend {backend}"
            f" ({'from ' + source + ' and flags' if source else 'flags and defaults'})")


def _show_progress(total: int) -> Callable[[dict], None]:
    def show(rec: dict) -> None:
        if rec["event"] == "fault":
            shown = {k: v for k, v in rec.items() if k in ("nodes", "why", "failed", "joined", "moved",
                                                         "missing_stages", "stage", "seconds_lost", "factor",
                                                         "adopted", "error")}
            shown.update({k: round(rec[k], 3) for k in ("iteration_s_before", "iteration_s_refined") if k in rec})
            print(f"  [{rec['kind']}] {shown}", flush=True)
        elif rec["event"] == "iteration":
            print(f"iteration {rec['iteration'] + 1:>4}/{total}  loss {rec['train_loss']:.4f}  "
                  f"{rec['seconds']:.3f} s (microbatches {rec['compute_seconds']:.3f} s, predicted "
                  f"{rec['predicted_seconds']:.3f} s)", flush=True)
        else:
            print(f"evaluation after {rec['iteration']:>4}: validation loss {rec['val_loss']:.4f}  "
                  f"perplexity {rec['perplexity']:.2f}", flush=True)
    return show
