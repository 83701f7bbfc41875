"""Evolution strategies (Salimans et al. 2017, "Evolution Strategies as a Scalable Alternative to
Reinforcement Learning") on roving: a gymnasium control task solved by a population of perturbed
policies evaluated in pool workers.

How it works, top to bottom:

* A table of Gaussian noise is written once with ``roving.shared``; every worker maps it read-only, so
  a perturbation travels as one integer (where it starts in the table) and a sign.
* Each iteration draws ``--pairs`` offsets; a pair is evaluated as theta + sigma*eps and theta - sigma*eps
  (antithetic sampling) on the same episode seed, so both see the same start.
* Returns are replaced by centred ranks in [-0.5, 0.5]; the gradient estimate
  sum_i rank_i * eps_i / (n * sigma) drives Adam (with a little weight decay).
* Every ``--eval-every`` iterations the unperturbed policy is scored on ``--eval-episodes`` fixed seeds;
  the task counts as *solved* when that score reaches ``--solved`` (Pendulum-v1: -250; the untrained policy
  scores about -1300, a good one about -150).

Run ``python examples/es.py --help``. Only roving's public API is used, so the same program runs on any
backend: ``ROVING_BACKEND=slurm python examples/es.py`` (or ``[tool.roving]`` in pyproject.toml).
"""
from __future__ import annotations

import argparse
import json
import time
from typing import List, Optional, Sequence, Tuple

import numpy as np

import roving as multiprocessing


# -- the policy: a small MLP in numpy, its parameters one flat vector ---------------------------
class Policy:
    """obs -> tanh hidden layers -> action. ``Box`` actions: tanh scaled to the bounds; ``Discrete``:
    argmax. Observations are divided by their bounds where the space has finite ones."""

    def __init__(self, observation_space, action_space, hidden: Sequence[int]) -> None:
        from gymnasium import spaces
        obs_dim = int(np.prod(observation_space.shape))
        self.discrete = isinstance(action_space, spaces.Discrete)
        act_dim = int(action_space.n) if self.discrete else int(np.prod(action_space.shape))
        high = np.asarray(observation_space.high, dtype=np.float32).ravel()
        self.obs_scale = np.where(np.isfinite(high) & (high > 0), 1.0 / np.where(high > 0, high, 1), 1.0)
        if not self.discrete:
            low, high = action_space.low.astype(np.float32), action_space.high.astype(np.float32)
            self.act_mid, self.act_half = (high + low) / 2, (high - low) / 2
        sizes = [obs_dim, *hidden, act_dim]
        self.shapes = [(a, b) for a, b in zip(sizes[:-1], sizes[1:])]
        self.num_params = sum(a * b + b for a, b in self.shapes)

    def init_params(self, rng: np.random.Generator) -> np.ndarray:
        parts = []
        for a, b in self.shapes:
            parts += [rng.standard_normal((a, b)).ravel() / np.sqrt(a), np.zeros(b)]
        return np.concatenate(parts).astype(np.float32)

    def act(self, params: np.ndarray, obs: np.ndarray):
        x = np.asarray(obs, dtype=np.float32).ravel() * self.obs_scale
        i = 0
        for k, (a, b) in enumerate(self.shapes):
            w = params[i:i + a * b].reshape(a, b)
            bias = params[i + a * b:i + a * b + b]
            i += a * b + b
            x = x @ w + bias
            if k < len(self.shapes) - 1:
                x = np.tanh(x)
        if self.discrete:
            return int(np.argmax(x))
        return self.act_mid + self.act_half * np.tanh(x)


def run_episode(env, policy: Policy, params: np.ndarray, seed: int) -> Tuple[float, int]:
    obs, _ = env.reset(seed=seed)
    total, steps, done = 0.0, 0, False
    while not done:
        obs, reward, terminated, truncated, _ = env.step(policy.act(params, obs))
        total += float(reward)
        steps += 1
        done = terminated or truncated
    return total, steps


# -- what a pool worker holds: the environment, the policy and the mapped noise table ------------
_worker: dict = {}


def init_worker(env_id: str, hidden: Sequence[int], noise_handle) -> None:
    import gymnasium as gym
    env = gym.make(env_id)
    _worker.update(env=env, policy=Policy(env.observation_space, env.action_space, hidden),
                   noise=noise_handle.get())  # a read-only view of the shared table: no copy


def evaluate(theta: np.ndarray, sigma: float, offset: int, sign: int, seed: int) -> Tuple[float, int]:
    """Return and length of one episode of theta + sign*sigma*noise[offset:offset+n] (sign 0: theta)."""
    policy, noise = _worker["policy"], _worker["noise"]
    params = theta if sign == 0 else theta + sign * sigma * noise[offset:offset + theta.size]
    return run_episode(_worker["env"], policy, params, seed)


# -- the optimiser and the rank transform ---------------------------------------------------------
class Adam:
    def __init__(self, size: int, lr: float, beta1: float = 0.9, beta2: float = 0.999) -> None:
        self.lr, self.beta1, self.beta2 = lr, beta1, beta2
        self.m, self.v, self.t = np.zeros(size), np.zeros(size), 0

    def step(self, grad: np.ndarray) -> np.ndarray:
        """The update to add to the parameters to ascend ``grad``."""
        self.t += 1
        self.m = self.beta1 * self.m + (1 - self.beta1) * grad
        self.v = self.beta2 * self.v + (1 - self.beta2) * grad * grad
        lr = self.lr * np.sqrt(1 - self.beta2 ** self.t) / (1 - self.beta1 ** self.t)
        return lr * self.m / (np.sqrt(self.v) + 1e-8)


def centred_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks of x scaled to [-0.5, 0.5]: the update is blind to the scale of returns and to outliers."""
    ranks = np.empty(x.size, dtype=np.float64)
    ranks[x.ravel().argsort()] = np.arange(x.size)
    return (ranks / (x.size - 1) - 0.5).reshape(x.shape)


# -- the loop ---------------------------------------------------------------------------------------
def train(args: argparse.Namespace, pool=None) -> dict:
    """Run ES; returns the history (also written to ``--history`` as JSON when given).

    ``pool`` lets a caller (the scaling benchmark) pass any object with ``starmap``; by default a
    roving Pool of ``--workers`` processes is made and closed here.
    """
    import gymnasium as gym
    rng = np.random.default_rng(args.seed)
    noise = np.random.default_rng(args.seed + 1).standard_normal(1 << args.noise_log2, dtype=np.float32)
    probe = gym.make(args.env)
    policy = Policy(probe.observation_space, probe.action_space, args.hidden)
    probe.close()
    theta = policy.init_params(rng)
    n = policy.num_params
    if noise.size < 10 * n:
        raise SystemExit(f"--noise-log2 {args.noise_log2} gives {noise.size} floats; the policy has {n} "
                         "parameters: use a larger table")
    adam = Adam(n, args.lr)
    eval_seeds = [10_000_000 + i for i in range(args.eval_episodes)]
    history = {"iteration": [], "mean": [], "best": [], "evals_per_s": [], "eval_iteration": [],
               "eval_return": [], "solved_at": None, "seconds": []}

    handle = multiprocessing.shared(noise)  # keep the handle until the workers are done
    table = handle.get()  # the parent reads the shared copy too; its own array can go
    del noise
    own_pool = pool is None
    if own_pool:
        pool = multiprocessing.Pool(args.workers, initializer=init_worker,
                                    initargs=(args.env, tuple(args.hidden), handle))
    start = time.perf_counter()
    try:
        def score(it: int) -> float:
            rets = pool.starmap(evaluate, [(theta, 0.0, 0, 0, s) for s in eval_seeds])
            value = float(np.mean([r for r, _ in rets]))
            history["eval_iteration"].append(it)
            history["eval_return"].append(value)
            return value

        print(f"ES on {args.env}: {n} parameters, {2 * args.pairs} evaluations per iteration, "
              f"{args.workers} workers, noise table {handle.nbytes / 2**20:.0f} MiB (shared)", flush=True)
        print(f"iter    0  policy {score(0):8.1f} over {args.eval_episodes} episodes (before training)", flush=True)
        for it in range(1, args.iterations + 1):
            t0 = time.perf_counter()
            offsets = rng.integers(0, table.size - n, size=args.pairs)
            seeds = rng.integers(0, 2**31 - 1, size=args.pairs)
            tasks = [(theta, args.sigma, int(o), sign, int(s)) for o, s in zip(offsets, seeds)
                     for sign in (1, -1)]
            results = pool.starmap(evaluate, tasks, chunksize=args.chunksize)
            returns = np.array([r for r, _ in results]).reshape(args.pairs, 2)
            elapsed = time.perf_counter() - t0

            ranks = centred_ranks(returns)
            weights = ranks[:, 0] - ranks[:, 1]
            grad = sum(w * table[o:o + n] for w, o in zip(weights, offsets)) / (2 * args.pairs * args.sigma)
            theta = (theta + adam.step(grad - args.weight_decay * theta)).astype(np.float32)

            history["iteration"].append(it)
            history["mean"].append(float(returns.mean()))
            history["best"].append(float(returns.max()))
            history["evals_per_s"].append(len(tasks) / elapsed)
            history["seconds"].append(time.perf_counter() - start)
            line = (f"iter {it:4d}  mean {returns.mean():9.1f}  best {returns.max():9.1f}  "
                    f"{len(tasks) / elapsed:7.0f} evals/s  {time.perf_counter() - start:6.1f} s")
            if it % args.eval_every == 0 or it == args.iterations:
                value = score(it)
                line += f"  | policy {value:8.1f} over {args.eval_episodes} episodes"
                if value >= args.solved and history["solved_at"] is None:
                    history["solved_at"] = it
                    line += f"  SOLVED (>= {args.solved:g})"
            print(line, flush=True)
            if history["solved_at"] is not None and args.stop_when_solved:
                break
    finally:
        if own_pool:
            pool.close()
            pool.join()
    history["theta"] = theta.tolist()
    if history["solved_at"] is not None:
        print(f"solved (policy >= {args.solved:g} over {args.eval_episodes} episodes) at iteration "
              f"{history['solved_at']}, {history['seconds'][history['solved_at'] - 1]:.0f} s", flush=True)
    else:
        print(f"not solved: best policy score {max(history['eval_return']):.1f} < {args.solved:g}", flush=True)
    if args.history:
        with open(args.history, "w") as f:
            json.dump(history, f)
    if args.plot:
        plot(history, args.plot, f"ES on {args.env}", args.solved)
    return history


def plot(history: dict, path: str, title: str, solved: Optional[float] = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(history["iteration"], history["mean"], label="population mean", lw=1)
    ax.plot(history["iteration"], history["best"], label="population best", lw=1, alpha=0.6)
    if history["eval_iteration"]:
        ax.plot(history["eval_iteration"], history["eval_return"], "o-", label="policy (evaluation)", lw=2)
    if solved is not None:
        ax.axhline(solved, color="grey", ls="--", lw=1, label=f"solved ({solved:g})")
    ax.set_xlabel("iteration")
    ax.set_ylabel("episode return")
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--env", default="Pendulum-v1", help="gymnasium environment id")
    p.add_argument("--workers", type=int, default=multiprocessing.cpu_count(), help="pool processes")
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--pairs", type=int, default=32, help="antithetic pairs per iteration")
    p.add_argument("--sigma", type=float, default=0.1, help="noise standard deviation")
    p.add_argument("--lr", type=float, default=0.1, help="Adam step size")
    p.add_argument("--weight-decay", type=float, default=0.005)
    p.add_argument("--hidden", type=int, nargs="*", default=[16, 16], help="hidden layer sizes")
    p.add_argument("--noise-log2", type=int, default=22, help="noise table of 2**N float32")
    p.add_argument("--chunksize", type=int, default=None, help="evaluations per pool message")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-episodes", type=int, default=20)
    p.add_argument("--solved", type=float, default=-250.0, help="evaluation return that counts as solved")
    p.add_argument("--stop-when-solved", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="write the learning curve to this PNG")
    p.add_argument("--history", default=None, help="write the history to this JSON file")
    return p


def main(argv: Optional[List[str]] = None) -> dict:
    return train(parser().parse_args(argv))


if __name__ == "__main__":
    # Run as the module ``es``: pool workers (which take on our sys.path) then import these functions by
    # reference instead of receiving them by value, which keeps each task message small. (Functions of
    # ``__main__`` would work too: in a worker they share one namespace, so evaluate() sees what
    # init_worker() set.)
    import es
    es.main()
