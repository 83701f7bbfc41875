"""PPO on CartPole-v1 with its environments in roving processes.

``roving.rl.RovingVectorEnv`` is a drop-in for ``gymnasium.vector.AsyncVectorEnv``: the same
constructor argument (a list of functions that make an environment), the same ``reset``/``step``
results and the same autoreset (``NEXT_STEP``: the step after an episode ends resets that environment and
its action is ignored). Swap the one line that builds the vector env and this loop runs on
``AsyncVectorEnv`` unchanged (``--vector async``).

The PPO loop is the usual one (Schulman et al. 2017): rollouts of ``--rollout`` steps in each of
``--envs`` environments, GAE(lambda), clipped surrogate, a few epochs of minibatches. Steps that only
reset an environment are masked out of the loss. Progress per update: environment steps so far, mean
return of the episodes that ended in the update, steps/s.

Run ``python examples/vec_env.py --help``; any roving backend works.
"""
from __future__ import annotations

import argparse
import time
from typing import List, Optional

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from roving.rl import RovingVectorEnv


def make_env(env_id: str):
    return lambda: gym.make(env_id)


class ActorCritic(nn.Module):
    def __init__(self, obs_dim: int, n_actions: int, hidden: int = 64) -> None:
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                   nn.Linear(hidden, n_actions))
        self.critic = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                    nn.Linear(hidden, 1))

    def dist(self, obs: torch.Tensor) -> torch.distributions.Categorical:
        return torch.distributions.Categorical(logits=self.actor(obs))

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(obs).squeeze(-1)


def train(args: argparse.Namespace) -> dict:
    """Run PPO; returns the mean episode return of each update (NaN when no episode ended in it)."""
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    fns = [make_env(args.env) for _ in range(args.envs)]
    envs = RovingVectorEnv(fns) if args.vector == "roving" else gym.vector.AsyncVectorEnv(fns)
    model = ActorCritic(envs.single_observation_space.shape[0], envs.single_action_space.n)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-5)
    T, N = args.rollout, args.envs
    history = {"steps": [], "mean_return": [], "returns": []}
    print(f"PPO on {args.env}: {N} environments in {type(envs).__name__}, {T} steps per rollout", flush=True)

    obs, _ = envs.reset(seed=args.seed)
    resetting = np.zeros(N, dtype=bool)  # True where this step only resets the environment (NEXT_STEP)
    running = np.zeros(N)
    steps, start = 0, time.perf_counter()
    try:
        for update in range(1, args.updates + 1):
            b_obs = torch.zeros(T, N, envs.single_observation_space.shape[0])
            b_act, b_logp, b_val, b_rew, b_done, b_valid = (torch.zeros(T, N) for _ in range(6))
            finished: List[float] = []
            for t in range(T):
                o = torch.as_tensor(obs, dtype=torch.float32)
                with torch.no_grad():
                    d = model.dist(o)
                    action = d.sample()
                    b_logp[t], b_val[t] = d.log_prob(action), model.value(o)
                b_obs[t], b_act[t] = o, action
                b_valid[t] = torch.as_tensor(~resetting, dtype=torch.float32)
                obs, reward, terminated, truncated, _ = envs.step(action.numpy())
                done = terminated | truncated
                b_rew[t] = torch.as_tensor(reward, dtype=torch.float32)
                b_done[t] = torch.as_tensor(done, dtype=torch.float32)  # truncation treated as an end
                running += np.where(resetting, 0.0, reward)
                for i in np.flatnonzero(done):
                    finished.append(running[i])
                    running[i] = 0.0
                resetting = done
                steps += int(b_valid[t].sum())  # reset-only steps are not environment steps

            with torch.no_grad():  # GAE; a reset step starts a fresh chain (the step before it is an end)
                next_value = model.value(torch.as_tensor(obs, dtype=torch.float32))
                adv = torch.zeros(T, N)
                last = torch.zeros(N)
                for t in reversed(range(T)):
                    nxt = next_value if t == T - 1 else b_val[t + 1]
                    keep = 1.0 - b_done[t]
                    delta = b_rew[t] + args.gamma * nxt * keep - b_val[t]
                    last = (delta + args.gamma * args.lam * keep * last) * b_valid[t]
                    adv[t] = last
                ret = adv + b_val

            valid = b_valid.flatten().bool()
            f_obs, f_act, f_logp = b_obs.flatten(0, 1)[valid], b_act.flatten()[valid], b_logp.flatten()[valid]
            f_adv, f_ret = adv.flatten()[valid], ret.flatten()[valid]
            for _ in range(args.epochs):
                for idx in torch.randperm(f_obs.shape[0]).split(args.minibatch):
                    d = model.dist(f_obs[idx])
                    ratio = (d.log_prob(f_act[idx]) - f_logp[idx]).exp()
                    a = f_adv[idx]
                    a = (a - a.mean()) / (a.std() + 1e-8)
                    policy_loss = -torch.min(ratio * a, ratio.clamp(1 - args.clip, 1 + args.clip) * a).mean()
                    value_loss = 0.5 * (model.value(f_obs[idx]) - f_ret[idx]).pow(2).mean()
                    loss = policy_loss + 0.5 * value_loss - args.entropy * d.entropy().mean()
                    opt.zero_grad()
                    loss.backward()
                    nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                    opt.step()

            mean = float(np.mean(finished)) if finished else float("nan")
            history["steps"].append(steps)
            history["mean_return"].append(mean)
            history["returns"].append(finished)
            print(f"update {update:3d}  steps {steps:6d}  episodes {len(finished):3d}  mean return {mean:6.1f}  "
                  f"{steps / (time.perf_counter() - start):6.0f} steps/s", flush=True)
    finally:
        envs.close()
    return history


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--env", default="CartPole-v1", help="a gymnasium environment with Discrete actions")
    p.add_argument("--vector", choices=["roving", "async"], default="roving",
                   help="RovingVectorEnv, or gymnasium's AsyncVectorEnv for comparison")
    p.add_argument("--envs", type=int, default=4)
    p.add_argument("--rollout", type=int, default=128, help="steps per environment per update")
    p.add_argument("--updates", type=int, default=20)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--minibatch", type=int, default=128)
    p.add_argument("--lr", type=float, default=2.5e-3)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--entropy", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: Optional[List[str]] = None) -> dict:
    return train(parser().parse_args(argv))


if __name__ == "__main__":
    main()
