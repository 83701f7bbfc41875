"""The examples learn: ES on Pendulum, PBT (also through a killed worker), PPO on RovingVectorEnv.

Each runs on tiny, seeded settings. The margins were checked against controls that cannot learn
(ES with its ranks shuffled: improvements of -295..+258 over 5 seeds, against +366..+552 when learning).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import gymnasium  # noqa: F401  (the examples need it and torch: a missing one fails here, loudly)
import torch  # noqa: F401

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))  # pool workers take on this sys.path, so they import the examples too


def test_es_improves_pendulum_policy_over_fixed_seed(tmp_path):
    import es
    png = tmp_path / "curve.png"
    history = es.main(["--workers", "2", "--iterations", "25", "--pairs", "32", "--eval-every", "25",
                       "--eval-episodes", "10", "--seed", "0", "--plot", str(png)])
    before, after = history["eval_return"][0], history["eval_return"][-1]
    assert history["eval_iteration"] == [0, 25]
    assert after > before + 350, (before, after)
    assert png.stat().st_size > 10_000


def test_es_help_runs():
    out = subprocess.run([sys.executable, str(EXAMPLES / "es.py"), "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "--pairs" in out.stdout


def test_pbt_population_learns(tmp_path):
    import pbt
    history = pbt.main(["--workers", "2", "--population", "4", "--rounds", "4", "--steps", "150",
                        "--checkpoint-dir", str(tmp_path), "--seed", "0"])
    assert history["exploits"] == 3  # one loser per round but the last
    # the population as a whole learns, not only its luckiest member
    assert history["median"][-1] < 0.2 * history["median"][0], history["median"]
    assert history["best"][-1] < 0.01, history["best"]  # near the noise floor (0.05 ** 2 = 0.0025)
    assert history["restarts"] == 0


def test_pbt_survives_a_worker_killed_mid_round(tmp_path):
    """kill -9 the worker running member 0's round 2: the round runs again from round 1's checkpoint."""
    # 500 steps: a member's round lasts over a second on a loaded machine, against the few milliseconds
    # between its marker and the kill; nothing here asks for more training
    proc = subprocess.Popen([sys.executable, str(EXAMPLES / "pbt.py"), "--workers", "2", "--population", "4",
                             "--rounds", "4", "--steps", "500", "--checkpoint-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marker = tmp_path / "member-0-round-2.started"
    deadline = time.monotonic() + 120
    while not marker.exists() or not marker.read_text().strip():
        assert proc.poll() is None and time.monotonic() < deadline, "round 2 never started"
        time.sleep(0.02)
    victim = int(marker.read_text().split()[0])
    os.kill(victim, signal.SIGKILL)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    assert "member 0: its worker was lost during round 2" in out, out
    assert "round   4" in out, out
    pids = marker.read_text().split()
    assert len(pids) == 2 and int(pids[1]) != victim  # ran again, on another worker
    assert (tmp_path / "member-0-round-4.pt").exists()


def test_ppo_on_roving_vector_env_improves_cartpole():
    import vec_env
    history = vec_env.main(["--envs", "4", "--rollout", "128", "--updates", "12", "--seed", "0"])
    returns = history["returns"]
    first = np.mean(returns[0] + returns[1])
    last = np.mean([r for update in returns[-3:] for r in update])
    assert first < 40, first  # a random CartPole policy lasts about 20 steps
    assert last > first + 100, (first, last)  # seeds 0-3 gave +137..+197
