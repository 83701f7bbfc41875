"""Population-based training (Jaderberg et al. 2017) of small PyTorch models on roving.

A population of MLPs learns a noisy 2-D regression task, each member with its own SGD learning rate and
momentum. Training goes in rounds; in each round every member trains ``--steps`` minibatches in a pool
worker, starting from a checkpoint on disk and ending by writing a new one. Between rounds:

* exploit: each member in the bottom ``--fraction`` (by validation loss) takes the weights, optimiser
  state and hyperparameters of a random member of the top ``--fraction``;
* explore: it then multiplies each hyperparameter by 0.8 or 1.25 at random.

Fault tolerance comes from the checkpoints plus the Pool: a round's task reads the checkpoint of the
round before and writes one of its own, so running it twice gives the same result. When a worker dies
mid-round (try ``kill -9`` on the pid a round prints), the Pool runs the task again on another worker,
which starts over from the last checkpoint; the population carries on. The task notices a second start
(its start marker is already there) and the round's line says so.

Run ``python examples/pbt.py --help``. Only roving's public API is used, so it runs on any backend.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import tempfile
import time
from typing import List, Optional

import roving as multiprocessing

HYPERPARAMETERS = {"lr": (1e-4, 0.5), "momentum": (0.0, 0.99)}  # explore keeps each inside its range


def make_data(seed: int, n: int = 4096):
    """y = sin(3 x0) cos(2 x1) + x0 x1 + noise, x uniform in [-1, 1]^2; 3/4 train, 1/4 validation."""
    import torch
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 2, generator=g) * 2 - 1
    y = torch.sin(3 * x[:, :1]) * torch.cos(2 * x[:, 1:]) + x[:, :1] * x[:, 1:]
    y = y + 0.05 * torch.randn(n, 1, generator=g)
    cut = 3 * n // 4
    return x[:cut], y[:cut], x[cut:], y[cut:]


def make_model():
    import torch
    return torch.nn.Sequential(torch.nn.Linear(2, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                               torch.nn.Tanh(), torch.nn.Linear(64, 1))


def checkpoint_path(directory: str, member: int, round_: int) -> str:
    return os.path.join(directory, f"member-{member}-round-{round_}.pt")


def train_round(directory: str, member: int, round_: int, start_from: Optional[str], hparams: dict,
                steps: int, batch: int, seed: int) -> dict:
    """One member's round, in a pool worker: load ``start_from`` (None: fresh weights), train, write the
    round's checkpoint (atomically), return the validation loss. Idempotent, so safe to run again."""
    import torch
    torch.set_num_threads(1)
    marker = os.path.join(directory, f"member-{member}-round-{round_}.started")
    restarted = os.path.exists(marker)
    with open(marker, "a") as f:
        f.write(f"{os.getpid()}\n")
    torch.manual_seed(seed * 100_003 + member * 1009 + round_)
    x, y, vx, vy = make_data(seed)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=hparams["lr"], momentum=hparams["momentum"])
    if start_from is not None:
        state = torch.load(start_from)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        for group in opt.param_groups:  # explore may have changed them
            group.update(lr=hparams["lr"], momentum=hparams["momentum"])
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (batch,))
        loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        val = torch.nn.functional.mse_loss(model(vx), vy).item()
    if not math.isfinite(val):
        val = float("inf")  # a diverged member ranks last and is replaced by exploit
    out = checkpoint_path(directory, member, round_)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "hparams": hparams}, out + ".tmp")
    os.replace(out + ".tmp", out)
    return {"member": member, "round": round_, "val_loss": val, "pid": os.getpid(), "restarted": restarted}


def explore(hparams: dict, rng: random.Random) -> dict:
    out = {}
    for name, value in hparams.items():
        low, high = HYPERPARAMETERS[name]
        out[name] = min(high, max(low, value * rng.choice((0.8, 1.25))))
    return out


def run(args: argparse.Namespace) -> dict:
    """Train the population; returns the history of every round (best and per-member losses)."""
    rng = random.Random(args.seed)
    directory = args.checkpoint_dir or tempfile.mkdtemp(prefix="roving-pbt-")
    os.makedirs(directory, exist_ok=True)
    hparams = [{"lr": 10 ** rng.uniform(-3.5, -0.5), "momentum": rng.uniform(0.0, 0.95)}
               for _ in range(args.population)]
    start_from: List[Optional[str]] = [None] * args.population
    history = {"best": [], "median": [], "losses": [], "restarts": 0, "exploits": 0}
    print(f"PBT: {args.population} members, {args.rounds} rounds of {args.steps} steps, {args.workers} "
          f"workers, checkpoints in {directory}", flush=True)
    start = time.perf_counter()
    with multiprocessing.Pool(args.workers) as pool:
        for round_ in range(1, args.rounds + 1):
            tasks = [(directory, m, round_, start_from[m], hparams[m], args.steps, args.batch, args.seed)
                     for m in range(args.population)]
            results = pool.starmap(train_round, tasks, chunksize=1)
            losses = [r["val_loss"] for r in results]
            for r in results:
                if r["restarted"]:
                    history["restarts"] += 1
                    print(f"  member {r['member']}: its worker was lost during round {round_}; the round "
                          f"ran again from the last checkpoint (now in pid {r['pid']})", flush=True)
            order = sorted(range(args.population), key=lambda m: losses[m])
            best = order[0]
            history["best"].append(losses[best])
            history["median"].append(sorted(losses)[len(losses) // 2])
            history["losses"].append(losses)
            print(f"round {round_:3d}  best {losses[best]:.5f} (member {best}, lr {hparams[best]['lr']:.2g}, "
                  f"momentum {hparams[best]['momentum']:.2f})  median {history['median'][-1]:.5f}  "
                  f"{time.perf_counter() - start:6.1f} s", flush=True)

            start_from = [checkpoint_path(directory, m, round_) for m in range(args.population)]
            cut = max(1, int(args.population * args.fraction))
            if round_ < args.rounds:
                for loser in order[-cut:]:
                    winner = rng.choice(order[:cut])
                    start_from[loser] = checkpoint_path(directory, winner, round_)
                    hparams[loser] = explore(hparams[winner], rng)
                    history["exploits"] += 1
            for m in range(args.population):  # only this round's checkpoints are needed from now on
                old = checkpoint_path(directory, m, round_ - 1)
                if os.path.exists(old):
                    os.remove(old)
    history["final_hparams"] = hparams
    history["checkpoint_dir"] = directory
    if args.checkpoint_dir is None:
        shutil.rmtree(directory, ignore_errors=True)
    return history


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--population", type=int, default=8)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=200, help="SGD steps per member per round")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--fraction", type=float, default=0.25, help="bottom/top fraction for exploit")
    p.add_argument("--workers", type=int, default=multiprocessing.cpu_count(), help="pool processes")
    p.add_argument("--checkpoint-dir", default=None, help="kept when given; else a temporary directory")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: Optional[List[str]] = None) -> dict:
    return run(parser().parse_args(argv))


if __name__ == "__main__":
    import pbt  # run as a module so that workers import train_round by reference (see es.py)
    pbt.main()
