"""benchmarks/es_scaling.py compares like with like: every framework's pool does the same ES work.

Its figures are only a comparison if roving's pool and multiprocessing's evaluate the same episodes
(roving's workers map the noise table with roving.shared, multiprocessing's rebuild it from its seed),
if ``--episode-steps`` really shortens the episodes in the workers, and if no iteration is timed before
every worker is up (and, with ``--worker-sessions own``, in a scheduling group of its own).
"""
from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

import gymnasium  # noqa: F401  (the benchmark needs it: a missing one fails here, loudly)

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # pool workers take on this sys.path, so they import it too

import es_scaling  # noqa: E402

#: Pendulum-v1's reward per step lies in [-(pi^2 + 0.1 * 8^2 + 0.001 * 2^2), 0] = [-16.27, 0].
WORST_STEP = -16.28


def settings(steps):
    return argparse.Namespace(iterations=3, pairs=4, noise_log2=14, episode_steps=steps, own_sessions=True)


def test_roving_and_multiprocessing_do_the_same_shortened_work():
    steps = 7
    means = {}
    for framework in ("roving", "multiprocessing"):
        placement, history = {}, {}
        times = es_scaling.time_iterations(framework, 2, settings(steps), placement, history)
        assert len(times) == 2 and all(t > 0 for t in times), times  # 3 iterations, the first left out
        assert placement == {"hosts": {socket.gethostname(): 2}, "groups": 2}, placement
        means[framework] = history["mean"]
    assert len(means["roving"]) == 3
    assert means["roving"] == means["multiprocessing"]
    # every episode was cut at 7 steps: no mean return can be below 7 of the worst steps ...
    assert min(means["roving"]) >= steps * WORST_STEP, means
    # ... which the environment's own 200-step episodes of the same policies are (the bound discriminates)
    control = {}
    es_scaling.time_iterations("multiprocessing", 1, settings(None), None, control)
    assert max(control["mean"]) < steps * WORST_STEP, control["mean"]
