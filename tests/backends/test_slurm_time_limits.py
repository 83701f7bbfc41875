"""Pool workers on the real single-node Slurm meet time limits and preemption as real jobs do
(roving.pool._ending): workers of ``--time=1`` (slurm_time="1") run a map of more work than a generation
of them can take on, with every result once and no retry spent; ``scancel --signal=TERM`` of a worker mid-item
hands its item back; the ``--signal`` warning Slurm sends before the limit arrives and ends the worker
well; preemptions do not exhaust ``max_task_retries`` (the tests run with 1: one counted death would fail
the item)."""
from __future__ import annotations

import os
import subprocess

import pytest

import helpers_backends as hb
import helpers_pool as hp
import roving
from helpers_core import PROGRAMS, ROOT, run_script, wait_until

T = 240


@pytest.mark.parametrize("name", ["local", "slurm"])
def test_pools_ending_their_own_workers_print_nothing_after_the_programs_last_line(name):
    """A pool in a ``with`` block, one closed and joined, one left running at the program's exit: each
    ends its own workers (on Slurm by cancelling their jobs, whose first signal is SIGTERM), which is no
    news to print."""
    run = run_script(PROGRAMS / "pool_ends.py", name, "own", cwd=str(ROOT), timeout=T)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1:] == ["the program's last line"], run.stdout
    assert not [line for line in run.stderr.splitlines() if "pool" in line or "will end" in line], run.stderr


@pytest.mark.parametrize("name", ["local", "slurm"])
def test_workers_the_cluster_ends_are_reported_in_one_line_for_their_pool(name):
    """Both workers of a pool told from outside they will end (SIGTERM, as a time limit or a preemption
    sends): one line for the pool says so, none per worker, and the pool goes on with replacements."""
    run = run_script(PROGRAMS / "pool_ends.py", name, "outside", cwd=str(ROOT), timeout=T)
    assert run.returncode == 0, run.stderr
    said = [line for line in run.stderr.splitlines() if "the cluster ends its workers" in line]
    assert len(said) == 1 and said[0].startswith("roving pool 1: the cluster ends its workers (signal SIGTERM: "
                                                 "a time limit or a preemption), the first within "), run.stderr
    assert "will end within" not in run.stdout + run.stderr
    assert run.stdout.splitlines()[-1:] == ["the program's last line"], run.stdout


@pytest.fixture(autouse=True)
def _slurm():
    hb.require("slurm")  # every test here needs it (those on local too: it runs them on both)


def _started(marker_dir, x):
    return sorted(n for n in os.listdir(marker_dir) if n.startswith(f"started-{x}-"))


def test_workers_of_one_minute_run_a_map_of_over_three_minutes_with_every_result_once_and_no_retry():
    # 200 items of 1 s on 4 workers of slurm_time=1 (a real --time=1: Slurm ends a job at one minute):
    # each worker lives 50 s (the limit less 10 s for the job's own start), ends well from 30 s on (its
    # 20 s of grace), and its replacement starts as it begins to leave. A generation of 4 takes on 120 s
    # of work at most: the other 80 s are its replacements' (20 s each, room for one to start late)
    roving.init(backend="slurm", slurm_time="1", child_output="off")
    with roving.Pool(4, max_task_retries=1) as pool:
        done = pool.starmap(hp.sleep_then_pid, [(x, 1.0) for x in range(200)], chunksize=1)
        figures = pool._disp.figures()
    assert [x for x, _ in done] == list(range(200))  # every result, once, in order
    assert len({pid for _, pid in done}) >= 8  # 50 s of it on 4 workers that take work for 30 s at most
    assert figures["retried"] == 0 and figures["failed"] == 0 and figures["ended_early"] >= 4


def test_scancel_signal_term_of_a_worker_mid_item_hands_the_item_back_and_costs_no_retry(tmp_path):
    roving.init(backend="slurm", worker_grace=2.0, child_output="off")
    with roving.Pool(1, max_task_retries=1) as pool:
        # 20 s while it is to be preempted (well past worker_grace: it cannot finish in its grace), at once
        # on the third start, which is left to complete
        item = pool.apply_async(hp.started_then_sleep_the_first_runs, (0, 20, str(tmp_path), 2))
        for preemption in range(2):  # preempted twice while it runs: twice more than max_task_retries allows
            assert wait_until(lambda: len(_started(tmp_path, 0)) == preemption + 1, T)
            (victim,) = [w for w in pool._pool if w.is_alive()]
            # --full: the batch shell too (the worker is the job's shell: its Python exec'd by the script)
            subprocess.run(["scancel", "--signal=TERM", "--full", str(victim.job.id)], check=True, timeout=30)
            assert wait_until(lambda: not victim.is_alive(), T)
        x, pid = item.get(T)
    assert x == 0 and len(_started(tmp_path, 0)) == 3
    figures = pool._disp.figures()
    assert figures["retried"] == 0 and figures["ended_early"] == 2 and figures["handed_back"] == 2


def test_the_warning_slurm_sends_before_the_time_limit_ends_the_worker_well():
    # worker_lifetime=0: no planned end; only Slurm's --signal=B:USR1@30 (grace 20 + 10) tells the worker,
    # up to 60 s before it is due (Slurm's resolution), so within the job's one minute
    roving.init(backend="slurm", slurm_time="1", worker_lifetime=0, child_output="prefix")
    with roving.Pool(1, max_task_retries=1) as pool:
        first = pool.apply(hp.getpid)
        (worker,) = pool._pool
        assert wait_until(lambda: pool._disp.figures()["ended_early"] >= 1, 90)
        assert wait_until(lambda: any(e["kind"] == "worker-ending" and "(signal SIGUSR1)" in e["text"]
                                      for e in roving.observe.events_since(0)), 30)
        assert wait_until(lambda: pool.apply(hp.getpid) != first, T)  # its replacement serves
        assert pool._disp.figures()["retried"] == 0
