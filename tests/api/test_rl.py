"""roving.rl.RovingVectorEnv matches gymnasium's vector envs step for step, and fails cleanly."""
from __future__ import annotations

import numpy as np
import pytest

import gymnasium as gym  # a missing gymnasium fails these tests, loudly

from roving.rl import RovingVectorEnv


def _cartpole():
    return gym.make("CartPole-v1")


class _Exploding(gym.Env):
    observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {"where": "reset"}

    def step(self, action):
        if action == 1:
            raise ValueError("boom")
        return np.zeros(2, np.float32), 1.0, False, False, {}


def test_same_results_as_sync_vector_env_including_autoreset():
    fns = [_cartpole] * 3
    ours, ref = RovingVectorEnv(fns), gym.vector.SyncVectorEnv(fns)
    try:
        assert ours.num_envs == 3 and ours.single_action_space == ref.single_action_space
        assert ours.observation_space == ref.observation_space and ours.action_space == ref.action_space
        assert ours.metadata["autoreset_mode"] == gym.vector.AutoresetMode.NEXT_STEP
        a, b = ours.reset(seed=7), ref.reset(seed=7)
        assert np.array_equal(a[0], b[0])
        rng = np.random.default_rng(0)
        ends = 0
        for _ in range(300):
            actions = rng.integers(0, 2, 3)
            a, b = ours.step(actions), ref.step(actions)
            for x, y in zip(a[:4], b[:4]):
                assert np.array_equal(x, y)
            assert a[4].keys() == b[4].keys()
            ends += int(a[2].sum() + a[3].sum())
        assert ends > 5  # autoreset was exercised
        assert ours.get_attr("spec")[0].id == "CartPole-v1"
    finally:
        ours.close()
        ref.close()
    assert ours.closed


def test_environment_error_raises_in_parent_and_closes():
    env = RovingVectorEnv([_Exploding, _Exploding])
    _, info = env.reset(seed=0)
    assert list(info["where"]) == ["reset", "reset"]
    env.step(np.array([0, 0]))
    with pytest.raises(ValueError, match="boom"):
        env.step(np.array([0, 1]))
    assert env.closed
    env.close()  # idempotent


def test_unclosed_vector_env_kills_its_workers_when_collected():
    import gc
    env = RovingVectorEnv([_cartpole])
    proc = env._procs[0]
    del env
    gc.collect()
    proc.join(10)
    assert not proc.is_alive()
