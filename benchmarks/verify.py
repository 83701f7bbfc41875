"""Verification of untrusted nodes (issue 32), measured on this machine: what each adversary does to
training with verification off and on, how soon it is caught, whether honest nodes are ever blamed, and
what verification costs. Everything side by side in one run:

    PYTHONPATH=src python benchmarks/verify.py all --out benchmarks/results

``adversaries``: one clean run, then for each adversary kind (``adversary.KINDS``) the same run with one
node of 8 lying from iteration ``--start`` on (``collude``: the two nodes of stage 1, which has 2 replicas
in this plan, so the two are the whole stage: what the replicas' rechecks cannot catch, shown as such,
then again with the coordinator confirming half and all of what they pass (``confirm_rate`` 0.5, 1); and
"collude in the largest stage": two replicas of the stage with the most; ``drift``: a node of the stage with
the most replicas; ``--kinds`` runs only those named), once with
verification off and once on (``mode = "spot"``, ``verify_rate`` 0.05, the defaults). Same plan, data
and seed for all (the planner shares out a fixed count of evaluations). Figures: the final validation
loss (whole model), the final loss with half of the stages after 0 dropped (``evaluate``), how many
iterations after it started lying the node was caught, and the blames of honest nodes.

``clean``: honest runs of ``--clean-iterations`` (200) in mode "full" (every computation recomputed:
the most chances of a false blame) for 3 seeds on each of 2 networks (gcp12 and aws10: different plans,
so different routes, replicas and stage loads; links not emulated); counts the blames (target: 0). To
fit this machine, a smaller run (``CLEAN``: 6 nodes, 3 stages, 4 microbatches of 2 samples of 16 tokens).

``overhead``: the same honest run in modes off, screen, and spot at 1%, 5% and 10% (and full), in turn,
``--rounds`` times; the median iteration time of each, after ``WARMUP`` iterations. ``--overhead-model
large`` runs it on a wider model (``LARGE``: dim 256, 128 tokens, 8 samples a microbatch), where a
stage's compute, not the per-message costs, makes up the iteration.

``paired``: the overhead of ``--modes`` (by default ``PAIRED``: screen, spot at 5%, the two with
targets; ``spot:0.05:1``: spot at 5% with ``confirm_rate`` 1), each run between two runs with
verification off, ``--pairs`` times, on ``--overhead-model`` (its ratio to the two beside it: the
machine's drift cancels; ``paired``'s docstring); in time an iteration and in CPU seconds an iteration
(the coordinator's and every node's, from ``/proc``: on a machine whose cores the nodes share, what
verification adds to the work, less moved by how the scheduler interleaves it); and verification's own
CPU as the run counts it (``Evidence.cpu`` of every node by part, the coordinator's audit), against the
CPU of the off runs beside it: the work verification adds, without the runs' drift.

``parts``: one run in mode "screen" of ``--overhead-iterations`` on ``--overhead-model``: verification's
own CPU an iteration by part (as ``paired`` counts it), and its share of the run's CPU an iteration (the
run's own, with verification on: a quick look at where the work goes, not an overhead against an off
run; ``paired`` is that).

``aggregation``: the cost and the protection of each rule of ``aggregate`` (no training): for 3, 5 and 8
replicas' shares of 1,000,000 floats (honest ones: a common gradient plus noise of the same norm), the
median time to combine them, and, with one replica sending ``scale`` (x100), ``signflip``, ``noise`` (x10
the norm) or a NaN, how far the result lands from the honest replicas' mean, over the honest
replicas' spread (their mean distance to it).

``digest``: what screening and receipts cost per tensor, without training: the seconds to digest a tensor
of 1 MiB (``receipts.digest``, BLAKE3) against SHA-256 and blake2b (the digests before it), and to summarise it
(``screen.summarize``), interleaved, the median of ``--repeats``; with the bytes a second of each.

Writes ``verify_<what>.json`` (every run's figures) under ``--out`` and prints Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from roving.pipeline.verify.adversary import KINDS
from roving.pipeline.verify.aggregate import RULES, combine
from roving.pipeline.run.trainer import Trainer, TrainConfig, prepare

BASE = dict(model="tiny", layers=8, dim=64, seq_len=32, samples=4, network="gcp12", nodes=8, stages=4, skip=0.25,
            microbatches=8, in_flight=2, emulate_network=False, eval_every=1000, eval_batches=8, lr=3e-3,
            min_lr=3e-4, warmup=3, planner_budget=30.0, planner_evals=800, replan_budget=5.0, replan_evals=200,
            speed=2e-4, clip=1.0, timeout=300.0, threads=1)
WARMUP = 3
LARGE = dict(dim=256, seq_len=128, samples=8, microbatches=8)
CLEAN = dict(layers=6, nodes=6, stages=3, microbatches=4, samples=2, seq_len=16, eval_batches=2)


def train(iterations: int, seed: int, mode: str = "off", rate: float = 0.05, liars: str = "",
          **over) -> dict:
    """One run: its metrics, plus who was caught when, and seconds."""
    cfg = TrainConfig(**{**BASE, **over, "iterations": iterations, "seed": seed, "mode": mode,
                         "verify_rate": rate})
    prep = prepare(cfg)
    if callable(liars):
        liars = liars(prep.plan.allocation)
    prep.config.adversaries = liars
    t0 = time.time()
    cpu: dict[int, float] = {}

    def progress(rec: dict) -> None:  # the CPU of the iterations timed: after the warm-up, to the last
        if rec.get("event") == "iteration" and rec["iteration"] in (min(WARMUP, iterations) - 1, iterations - 1):
            cpu[rec["iteration"]] = cpu_seconds(t)

    with Trainer(prep, progress) as t:
        metrics = t.train()
        totals = dict(t.verifier.totals)
    caught = {e["node"]: e["iteration"] for e in metrics["events"] if e["event"] == "caught"}
    its = metrics["iterations"]
    own: dict[str, float] = {}  # verification's own CPU an iteration, as the run counts it, by part
    for r in its[WARMUP:]:
        v = r.get("verify", {})
        for part, sec in [("audit", v.get("cpu_seconds", 0.0)), *v.get("node_cpu_seconds", {}).items()]:
            own[part] = own.get(part, 0.0) + sec / max(1, len(its) - WARMUP)
    times = [r["seconds"] for r in its[WARMUP:]] or [r["seconds"] for r in its]
    final = metrics["evaluations"][-1]
    return {"mode": mode, "rate": rate, "confirm_rate": cfg.confirm_rate, "seed": seed, "liars": liars,
            "caught": caught, "totals": totals,
            "val_loss": final["val_loss"], "val_loss_dropped": final["val_loss_half_stages_dropped"],
            "dropped_stages": final["dropped_stages"], "iteration_s": statistics.median(times),
            "train_loss": [r["train_loss"] for r in its], "wall_s": time.time() - t0,
            "cpu_s": (cpu[iterations - 1] - cpu[min(WARMUP, iterations) - 1]) / max(1, iterations - WARMUP)
            if len(cpu) == 2 else math.nan,
            "verify_cpu_s": own, "allocation": dict(prep.plan.allocation),
            "disputes": sum(1 for e in metrics["events"] if e["event"] == "dispute"),
            "suspects": sorted({e["node"] for e in metrics["events"] if e["event"] == "suspect"})}


def cpu_seconds(t: Trainer) -> float:
    """The CPU seconds the run's processes used so far: this one (the coordinator) and every node's
    (``/proc``: a node's process is not this one's child, so its time is read there)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = time.process_time()
    for proc in t.roster.procs.values():
        try:
            with open(f"/proc/{proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, TypeError):
            continue  # gone (or never started): counted up to where it was last read
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


#: the cases of ``adversaries`` beyond one per kind: (name, kind, of the largest stage, settings of the
#: "on" run besides mode spot).
MORE = [("collude in the largest stage", "collude", True, {}),
        ("collude, confirm_rate 0.5", "collude", False, {"confirm_rate": 0.5}),
        ("collude, confirm_rate 1", "collude", False, {"confirm_rate": 1.0})]


def liars_for(kind: str, start: int, largest: bool = False):
    """The adversaries of ``kind``: the first node of stage 1 (``collude``: both nodes of stage 1, the
    whole stage in this plan; ``drift``: the first node of the stage with the most replicas, which the
    replicas' weights check needs 3 of); ``largest``: of the stage with the most replicas (``collude``:
    its first two)."""
    def pick(alloc: dict[str, int]) -> str:
        stage = 1
        if kind == "drift" or largest:
            sizes = {s: sum(1 for x in alloc.values() if x == s) for s in sorted(set(alloc.values()))}
            stage = max(sizes, key=lambda s: (sizes[s], -s))
        nodes = sorted(n for n, s in alloc.items() if s == stage)
        chosen = nodes[:2] if kind == "collude" else nodes[:1]
        return ", ".join(f"{n}:{kind}:{start}" for n in chosen)
    return pick


def adversaries(iterations: int, start: int, seed: int, kinds: list[str] | None = None) -> dict:
    out = {"clean": train(iterations, seed, "off")}
    print(f"clean: val loss {out['clean']['val_loss']:.4f} ({out['clean']['wall_s']:.0f} s)", flush=True)
    kinds = kinds or KINDS
    cases = [(k, k, False, {}) for k in kinds] + [case for case in MORE if case[1] in kinds]
    for name, kind, largest, settings in cases:
        for mode in ("off", "spot"):
            r = out[f"{name} {mode}"] = train(iterations, seed, mode, liars=liars_for(kind, start, largest),
                                              **(settings if mode == "spot" else {}))
            print(f"{name} {mode}: val loss {r['val_loss']:.4f}, caught {r['caught']} ({r['wall_s']:.0f} s)",
                  flush=True)
    return out


def clean(iterations: int, seeds: list[int]) -> dict:
    out = {}
    for network in ("gcp12", "aws10"):
        for seed in seeds:
            r = out[f"{network} seed {seed}"] = train(iterations, seed, "full", network=network, **CLEAN)
            print(f"clean {network} seed {seed}: blamed {r['caught'] or 'nobody'}, disputes {r['disputes']}, "
                  f"{r['totals']['checks']} checks ({r['wall_s']:.0f} s)", flush=True)
    return out


OVERHEAD = [("off", 0.0), ("screen", 0.0), ("spot", 0.01), ("spot", 0.05), ("spot", 0.10), ("full", 1.0)]


def overhead(iterations: int, rounds: int, seed: int, model: str = "small") -> dict:
    out: dict[str, list] = {}
    over = LARGE if model == "large" else {}
    for rnd in range(rounds):
        for mode, rate in OVERHEAD:
            name = mode if mode != "spot" else f"spot {rate:.0%}"
            r = train(iterations, seed, mode, rate, **over)
            out.setdefault(name, []).append(r)
            print(f"round {rnd}: {name}: {r['iteration_s'] * 1000:.0f} ms per iteration, "
                  f"{r['totals']['rechecks']} rechecks", flush=True)
    return out


def parts(iterations: int, seed: int, model: str = "large") -> dict:
    r = train(iterations, seed, "screen", 0.0, **(LARGE if model == "large" else {}))
    own = sum(r["verify_cpu_s"].values())
    print(f"screen: {r['iteration_s'] * 1000:.0f} ms an iteration, {r['cpu_s']:.3f} CPU s an iteration, "
          f"verification's own {own * 1000:.1f} ms ({own / r['cpu_s']:.2%}): "
          + ", ".join(f"{k} {v * 1000:.1f}" for k, v in sorted(r["verify_cpu_s"].items())), flush=True)
    return r


PAIRED = [("screen", 0.0, 0.0), ("spot", 0.05, 0.0)]


def _mode_name(r: dict) -> str:
    name = r["mode"] if r["mode"] != "spot" else f"spot {r['rate']:.0%}"
    return name + (f", confirm_rate {r['confirm_rate']:g}" if r.get("confirm_rate") else "")


def paired(iterations: int, pairs: int, seed: int, model: str = "large",
           modes: list[tuple[str, float, float]] | None = None) -> dict:
    """Each mode of ``modes`` (``PAIRED``) run between two runs with verification off, ``pairs`` times (off, screen,
    off, spot 5%, off, ...): each mode run's ratio to the mean of the two off runs beside it. This
    machine's speed drifts by a quarter from minute to minute (at a5dae62: off at 2.1 s and 2.9 s an
    iteration in two rounds of the same command); a ratio to its neighbours cancels the drift slower
    than a run."""
    over = LARGE if model == "large" else {}
    seq: list[tuple[str, float, float]] = [("off", 0.0, 0.0)]
    for _ in range(pairs):
        for mode in modes or PAIRED:
            seq += [mode, ("off", 0.0, 0.0)]
    runs = []
    for mode, rate, confirm in seq:
        r = train(iterations, seed, mode, rate, confirm_rate=confirm, **over)
        runs.append(r)
        print(f"{_mode_name(r)}: {r['iteration_s'] * 1000:.0f} ms per iteration, {r['cpu_s']:.2f} CPU s", flush=True)
    out: dict[str, list] = {}
    for i in range(1, len(runs), 2):
        r = runs[i]
        name = _mode_name(r)
        beside = (runs[i - 1]["iteration_s"] + runs[i + 1]["iteration_s"]) / 2
        cpu_beside = (runs[i - 1]["cpu_s"] + runs[i + 1]["cpu_s"]) / 2
        out.setdefault(name, []).append({"ratio": r["iteration_s"] / beside, "run": r,
                                         "off_beside_s": beside, "cpu_ratio": r["cpu_s"] / cpu_beside,
                                         "cpu_beside_s": cpu_beside})
    return {"runs": runs, "ratios": out}


def aggregation(size: int = 1_000_000, repeats: int = 7) -> dict:
    out: dict = {}
    gen = torch.Generator().manual_seed(0)
    common = torch.randn(size, generator=gen)
    for n in (3, 5, 8):
        honest = [common + torch.randn(size, generator=gen) for _ in range(n)]
        mean = torch.stack(honest).mean(0)
        spread = statistics.mean(float((h - mean).norm()) for h in honest)
        row: dict = {}
        for rule in RULES:
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                combine(honest, [1] * n, n, rule)
                times.append(time.perf_counter() - t0)
            attacks = {}
            for kind in ("scale", "signflip", "noise", "nan"):
                bad = honest[0].clone()
                if kind == "scale":
                    bad *= 100
                elif kind == "signflip":
                    bad = -bad * 10
                elif kind == "noise":
                    bad = torch.randn(size, generator=gen) * 10 * float(bad.norm()) / size ** 0.5
                else:
                    bad[7] = math.nan
                got = combine([bad] + honest[1:], [1] * n, n, rule)
                honest_mean = torch.stack(honest[1:]).mean(0)
                dist = float((got - honest_mean).norm())
                attacks[kind] = dist / spread if math.isfinite(dist) else math.inf
            row[rule] = {"seconds": statistics.median(times), "off_by": attacks}
        out[str(n)] = row
        print(f"aggregation, {n} replicas: " + ", ".join(f"{r} {v['seconds'] * 1000:.1f} ms" for r, v in row.items()),
              flush=True)
    return out


def digests(repeats: int = 30, mib: int = 1) -> dict:
    """Seconds per tensor of ``mib`` MiB: the receipt's digest (BLAKE3), SHA-256's and blake2b's (the
    digests before it, made as they were), a screening summary."""
    import hashlib

    from roving.pipeline.verify import receipts
    from roving.pipeline.verify.screen import summarize

    t = torch.randn(mib * 262144, generator=torch.Generator().manual_seed(0))

    def blake2b(x: torch.Tensor) -> bytes:  # the digest before SHA-256 (until 5da6054)
        h = hashlib.blake2b(f"{x.dtype}:{tuple(x.shape)}".encode(), digest_size=16)
        h.update(x.view(-1).view(torch.uint8).numpy().data)
        return h.digest()

    def sha256(x: torch.Tensor) -> bytes:  # the digest before BLAKE3 (5da6054 to ff41722)
        h = hashlib.sha256(f"{x.dtype}:{tuple(x.shape)}".encode())
        h.update(x.view(-1).view(torch.uint8).numpy().data)
        return h.digest()

    ways = {"blake3 (receipts.digest)": receipts.digest, "sha256": sha256, "blake2b": blake2b,
            "summarize": summarize}
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(repeats):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            fn(t)
            times[name].append(time.perf_counter() - t0)
    out = {}
    for name, ts in times.items():
        sec = statistics.median(ts)
        out[name] = {"seconds": sec, "bytes_per_s": t.numel() * 4 / sec}
        print(f"{name}: {sec * 1000:.3f} ms per {mib} MiB, {t.numel() * 4 / sec / 1e9:.2f} GB/s", flush=True)
    return out


def tables(res: dict, start: int) -> None:
    if "adversaries" in res:
        a = res["adversaries"]
        c = a["clean"]
        print("\n| adversary | val loss off | val loss on | on vs clean | off vs clean "
              "| caught (iterations after start) | honest blamed | loss, half the stages dropped: on vs clean |")
        print("|---|---|---|---|---|---|---|---|")
        print(f"| none (clean) | {c['val_loss']:.4f} | | | | | | {c['val_loss_dropped']:.4f} |")
        for kind in (k for k in list(KINDS) + [case[0] for case in MORE] if f"{k} off" in a):
            off, on = a[f"{kind} off"], a[f"{kind} spot"]
            liars = [e.split(":")[0] for e in on["liars"].split(", ")]
            late = [on["caught"][n] - start for n in liars if n in on["caught"]]
            honest = sorted(set(on["caught"]) - set(liars))
            caught = ", ".join(str(x) for x in late) if late else "not caught"
            if len(late) < len(liars) and late:
                caught += f" ({len(liars) - len(late)} not caught)"
            print(f"| {kind} | {_loss(off['val_loss'])} | {_loss(on['val_loss'])} "
                  f"| {_pct(on['val_loss'], c['val_loss'])} "
                  f"| {_pct(off['val_loss'], c['val_loss'])} | {caught} | {len(honest)} "
                  f"| {_pct(on['val_loss_dropped'], c['val_loss_dropped'])} |")
    if "clean" in res:
        print("\n| clean run | iterations | checks | rechecks | blamed | disputes | largest difference passed |")
        print("|---|---|---|---|---|---|---|")
        for name, r in res["clean"].items():
            print(f"| {name} | {len(r['train_loss'])} | {r['totals']['checks']} | {r['totals']['rechecks']} "
                  f"| {len(r['caught'])} | {r['disputes']} | {r['totals']['max_difference']:.2g} |")
    if "aggregation" in res:
        print("\n| replicas | rule | combine (ms) | one bad replica: distance from the honest mean / honest spread "
              "(scale, signflip, noise, nan) |")
        print("|---|---|---|---|")
        for n, row in res["aggregation"].items():
            for rule, v in row.items():
                off = ", ".join(f"{x:.2f}" if math.isfinite(x) else "inf" for x in v["off_by"].values())
                print(f"| {n} | {rule} | {v['seconds'] * 1000:.1f} | {off} |")
    if "overhead" in res:
        o = res["overhead"]
        base = statistics.median(r["iteration_s"] for r in o["off"])
        print("\n| mode | median iteration (ms) | vs off | rechecks per iteration |")
        print("|---|---|---|---|")
        for name, runs in o.items():
            s = statistics.median(r["iteration_s"] for r in runs)
            per = statistics.mean(r["totals"]["rechecks"] / max(1, len(r["train_loss"])) for r in runs)
            print(f"| {name} | {s * 1000:.0f} | {s / base - 1:+.1%} | {per:.1f} |")
    if "paired" in res:
        print("\n| mode | time vs the off runs beside it: median (each pair) | its iterations (ms) | off beside (ms) "
              "| CPU vs the off runs beside it: median (each pair) | its CPU an iteration (s) | audit after the "
              "averaging (s an iteration) |")
        print("|---|---|---|---|---|---|---|")
        for name, pairs in res["paired"]["ratios"].items():
            med = statistics.median(p["ratio"] for p in pairs)
            each = ", ".join(f"{p['ratio'] - 1:+.1%}" for p in pairs)
            its = ", ".join(f"{p['run']['iteration_s'] * 1000:.0f}" for p in pairs)
            offs = ", ".join(f"{p['off_beside_s'] * 1000:.0f}" for p in pairs)
            cmed = statistics.median(p["cpu_ratio"] for p in pairs)
            ceach = ", ".join(f"{p['cpu_ratio'] - 1:+.1%}" for p in pairs)
            cpu = ", ".join(f"{p['run']['cpu_s']:.2f}" for p in pairs)
            audit = ", ".join(f"{p['run']['totals']['seconds'] / max(1, len(p['run']['train_loss'])):.2f}"
                              for p in pairs)
            print(f"| {name} | {med - 1:+.1%} ({each}) | {its} | {offs} | {cmed - 1:+.1%} ({ceach}) | {cpu} | "
                  f"{audit} |")
        # what the run itself counted as verification's CPU (the nodes' by part, the coordinator's audit):
        # its share of the CPU of the off runs beside it is the added work, without the drift between runs
        print("\n| mode | verification's own CPU an iteration, of the off runs' CPU beside it: median (each) "
              "| its parts, median (ms an iteration) |")
        print("|---|---|---|")
        for name, pairs in res["paired"]["ratios"].items():
            shares = [sum(p["run"]["verify_cpu_s"].values()) / p["cpu_beside_s"] for p in pairs]
            parts = sorted({k for p in pairs for k in p["run"]["verify_cpu_s"]})
            each = ", ".join(f"{x:.1%}" for x in shares)
            split = ", ".join(f"{k} {statistics.median(p['run']['verify_cpu_s'].get(k, 0.0) for p in pairs) * 1000:.0f}"
                              for k in parts)
            print(f"| {name} | {statistics.median(shares):.1%} ({each}) | {split} |")


def _loss(x: float) -> str:
    return f"{x:.4f}" if math.isfinite(x) else str(x)


def _rate(text: str) -> bool:
    try:
        return 0.0 < float(text) <= 1.0
    except ValueError:
        return False


def _pct(x: float, ref: float) -> str:
    return f"{x / ref - 1:+.1%}" if math.isfinite(x) else "diverged (not finite)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("adversaries", "clean", "overhead", "paired", "parts", "aggregation", "digest",
                                     "all"))
    ap.add_argument("--iterations", type=int, default=40, help="iterations of each adversary run")
    ap.add_argument("--start", type=int, default=5, help="the iteration adversaries start lying at")
    ap.add_argument("--kinds", default=",".join(KINDS), help="the adversary kinds to run (adversaries)")
    ap.add_argument("--clean-iterations", type=int, default=200)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--overhead-iterations", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=3, help="of each mode between two off runs (paired)")
    ap.add_argument("--modes", default="screen,spot:0.05",
                    help="the modes of paired: MODE[:RATE[:CONFIRM_RATE]], comma-separated (default: "
                         "screen,spot:0.05)")
    ap.add_argument("--overhead-model", choices=("small", "large"), default="small")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=30, help="of each digest and summary (digest)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    res: dict = {"command": " ".join(["python", "benchmarks/verify.py"] + (argv if argv is not None else sys.argv[1:])),
                 "base": BASE}
    if args.what in ("digest", "all"):
        res["digest"] = digests(args.repeats)
    if args.what in ("aggregation", "all"):
        res["aggregation"] = aggregation()
    if args.what in ("adversaries", "all"):
        kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
        if set(kinds) - set(KINDS):
            bad = ", ".join(sorted(set(kinds) - set(KINDS)))
            ap.error(f"--kinds: {bad} not a kind; the kinds are {', '.join(KINDS)}")
        res["adversaries"] = adversaries(args.iterations, args.start, args.seed, kinds)
    if args.what in ("overhead", "all"):
        res["overhead"] = overhead(args.overhead_iterations, args.rounds, args.seed, args.overhead_model)
    if args.what == "paired":
        modes = []
        for item in (x.strip() for x in args.modes.split(",") if x.strip()):
            mode, _, rest = item.partition(":")
            rate, _, confirm = rest.partition(":")
            if mode not in ("screen", "spot", "full") or (rate and not _rate(rate)) or \
                    (confirm and not _rate(confirm)):
                ap.error(f"--modes: {item!r} is not MODE[:RATE[:CONFIRM_RATE]] with MODE screen, spot or full "
                         "and the rates in (0, 1]")
            modes.append((mode, float(rate) if rate else (1.0 if mode == "full" else 0.0),
                          float(confirm) if confirm else 0.0))
        res["paired"] = paired(args.overhead_iterations, args.pairs, args.seed, args.overhead_model, modes)
    if args.what == "parts":
        res["parts"] = parts(args.overhead_iterations, args.seed, args.overhead_model)
    if args.what in ("clean", "all"):
        res["clean"] = clean(args.clean_iterations, [int(s) for s in args.seeds.split(",")])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"verify_{args.what}.json").write_text(json.dumps(res, indent=1, default=str))
    tables(res, args.start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
