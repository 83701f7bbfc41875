"""Inside a Slurm allocation a pool's workers start as one job step (issue 22): a roving program run with
`sbatch` (waited for until its job has ended) on the real single-node Slurm
(tests/support/programs/slurm_step_program.py) makes a Pool on the slurm backend; an `srun` wrapper on
PATH logs each call's --ntasks and execs the real srun, and the program reads `squeue --steps` itself.
Proven here: one srun call (one step of N tasks, named for the session) for a pool of N, each worker a
task of that step (SLURM_STEP_ID, SLURM_PROCID), each item's result and output line once, a killed task
replaced by a new step of one task with its items run exactly once, `resize` up adding a step, and a pool
larger than the allocation a clear error naming the sizes.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

import helpers_backends as hb
from helpers_core import PROGRAMS, SUPPORT_DIR, wait_until
from roving.backends.slurm import step as slurm_step

T = 240  # bound on one program: its pool's interpreters start on 2 cores


_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
          "DEADLINE"}


def _wait_for_job(job: str, timeout: float) -> tuple:
    """Wait until batch job ``job`` has ended (and is no longer completing); its state and exit code as
    ``scontrol show job`` says them (``COMPLETED``, ``0:0``). Not ``sbatch --wait``: that polls after 2, 10
    and 42 s, so a job of 3 s took 10 s and one of 11 s took 42. The job is cancelled if it outlasts
    ``timeout``."""
    seen = {}

    def ended() -> bool:
        shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30)
        seen.update(dict(f.split("=", 1) for f in shown.stdout.split() if "=" in f))
        seen["said"] = shown.stdout + shown.stderr
        return seen.get("JobState") in _ENDED

    if not wait_until(ended, timeout, interval=0.1):
        subprocess.run(["scancel", job], timeout=30)
        raise AssertionError(f"job {job} not ended after {timeout} s: {seen.get('said')}")
    return seen["JobState"], seen.get("ExitCode")


def _run_in_allocation(tmp_path, mode: str, n: int, ntasks: int = 8, *extra: str, then: str = ""):
    """Run the program with ``sbatch --ntasks=ntasks`` until its job ends; (what it wrote, its output, srun
    calls: ``--ntasks=N`` of each, or ``kill`` for one that signals a task). With ``then`` (sh), the program runs
    in the background as $prog, and the batch script goes on with ``then``."""
    hb.require("slurm")
    real = shutil.which("srun")
    assert real, "Slurm's srun is not on PATH"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "srun.log"
    (bin_dir / "srun").write_text(
        "#!/bin/sh\n"
        "n=none\n"
        'for a in "$@"; do case "$a" in --ntasks=*) n="$a";; kill) n=kill;; esac; done\n'
        f'echo "$n" >> {shlex.quote(str(calls))}\n'
        f'exec {shlex.quote(real)} "$@"\n')
    (bin_dir / "srun").chmod(0o755)
    out, result = tmp_path / "job.out", tmp_path / "result.json"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join([str(SUPPORT_DIR), *sys.path])}
    env.pop("SLURM_JOB_ID", None)
    command = shlex.join([sys.executable, str(PROGRAMS / "slurm_step_program.py"), str(result), mode, str(n), *extra])
    script = f"{command} & prog=$!\n{then}" if then else command
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--ntasks={ntasks}", "--job-name=roving-step-test", f"--output={out}",
         f"--chdir={tmp_path}", "--wrap", script],
        env=env, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, f"sbatch: {submitted.stdout}{submitted.stderr}"
    state, exit_code = _wait_for_job(submitted.stdout.strip().split(";")[0], T)
    text = out.read_text() if out.exists() else ""
    assert (state, exit_code) == ("COMPLETED", "0:0"), f"job {state}, exit code {exit_code}\n--- job output:\n{text}"
    assert result.exists(), text
    return json.loads(result.read_text()), text, calls.read_text().split() if calls.exists() else []


def test_a_pool_of_6_inside_an_allocation_is_one_srun_step_of_6_tasks_and_each_result_comes_once(tmp_path):
    got, output, calls = _run_in_allocation(tmp_path, "map", 6)
    assert calls == ["--ntasks=6"], calls  # one srun for the whole pool
    assert got["cpu_count"] == 8  # the allocation's CPUs (sbatch --ntasks=8), not the node's 32
    assert got["connected"]
    ((step_id, name, tasks),) = got["steps"]  # one step of the allocation, of 6 tasks, under the session
    assert step_id.startswith(got["job"] + ".") and tasks == "6" and re.fullmatch(r"roving-[0-9a-f]+", name)
    results = got["results"]
    assert [r[0] for r in results] == [x * x for x in range(24)]
    assert {r[1] for r in results} == {got["job"]} and {f"{r[1]}.{r[2]}" for r in results} == {step_id}
    assert {r[3] for r in results} <= {str(i) for i in range(6)} and len({r[3] for r in results}) >= 2
    assert len(set(got["ids"])) == 6
    # each item's line, printed by its task, shown once with its process's name (srun --label demuxed)
    for x in range(24):
        lines = re.findall(rf"^\[PoolWorker-\d+-\d+\] item {x} on task \d+$", output, re.M)
        assert len(lines) == 1, (x, output)
    assert "@roving-step-" not in output  # the task script's own lines are never shown
    assert "Killed" not in output and "srun:" not in output


def test_a_killed_task_is_replaced_by_a_step_of_one_and_its_items_run_exactly_once(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    got, output, calls = _run_in_allocation(tmp_path, "kill", 4, 8, str(runs))
    assert got["connected"] and got["replaced"], output
    assert got["exitcode"] == -9  # the task's own exit, told apart from the step's other tasks
    assert got["results"] == [x * x for x in range(40)]
    done = sorted(int(name.split(".")[0]) for name in os.listdir(runs))
    assert done == list(range(40))  # each item completed once, the killed worker's too
    assert calls == ["--ntasks=4", "--ntasks=1"], calls  # the replacement: a new step of one task
    ((first, _, tasks),) = got["steps_before"]
    assert tasks == "4"
    after = {s[0]: s[2] for s in got["steps_after"]}
    assert after.get(first) == "4", after  # the other three tasks went on in their step
    assert sorted(after.values()) == ["1", "4"], after
    assert got["victim"] not in got["ids_after"]
    assert got["steps_gone"]


def test_a_task_on_another_host_is_signalled_through_srun_there_and_replaced(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    got, output, calls = _run_in_allocation(tmp_path, "killremote", 4, 8, str(runs))
    assert got["replaced"] and got["exitcode"] == -9, output
    assert got["results"] == [x * x for x in range(40)]
    assert sorted(int(name.split(".")[0]) for name in os.listdir(runs)) == list(range(40))
    assert [c for c in calls if c != "kill"] == ["--ntasks=4", "--ntasks=1"], calls
    # the victim alone: a one-task srun on its host; the pool's end, which signals every worker: one
    # scancel of each step instead of an srun per task
    assert calls == ["--ntasks=4", "kill", "--ntasks=1"], calls
    assert got["steps_gone"]


def test_a_parent_killed_with_sigkill_leaves_no_step_of_its_pool_behind(tmp_path):
    result = tmp_path / "result.json"
    then = (f"for i in $(seq 1200); do [ -e {shlex.quote(str(result))} ] && break; sleep 0.1; done\n"
            "kill -9 $prog\n"
            "for i in $(seq 600); do\n"
            "  squeue -h -s -j $SLURM_JOB_ID -o %j | grep -q '^roving-' || { echo steps-gone; exit 0; }\n"
            "  sleep 0.1\n"
            "done\n"
            "echo steps-left; squeue -s -j $SLURM_JOB_ID; exit 1\n")
    got, output, calls = _run_in_allocation(tmp_path, "hold", 3, 8, then=then)
    assert got["connected"] and [s[2] for s in got["steps"]] == ["3"], got
    assert "steps-gone" in output, output
    assert calls == ["--ntasks=3"], calls


def test_resize_up_inside_an_allocation_adds_a_step(tmp_path):
    got, _, calls = _run_in_allocation(tmp_path, "resize", 6)
    assert got["connected"]
    assert calls == ["--ntasks=2", "--ntasks=4"], calls
    assert sorted(s[2] for s in got["steps"]) == ["2", "4"]
    assert got["results"] == [x * x for x in range(30)]


def test_a_pool_larger_than_the_allocation_is_a_clear_error_naming_the_sizes(tmp_path):
    got, _, calls = _run_in_allocation(tmp_path, "toobig", 10, 8)
    error = got["error"]
    assert error is not None
    assert "10 process(es) of 1 CPU(s) each do not fit allocation" in error, error
    assert f"allocation {got['job']} (8 CPU(s) on 1 node(s)" in error and "room for 8" in error, error
    assert calls == [], calls  # nothing was started


def test_a_lone_process_is_a_step_of_one_with_its_own_exit_code_log_file_and_srun_refusals_in_srun_words(tmp_path):
    got, output, calls = _run_in_allocation(tmp_path, "process", 3)
    assert got["exitcode"] == 3
    assert re.search(r"^\[lone\] said by the lone process$", output, re.M), output
    assert got["logged_exitcode"] == 0 and got["logged"] == "said by the lone process\n"
    refused = got["refused"]
    assert refused and refused.startswith(
        "SlurmError: srun could not start a step of 1 (refused) in allocation "), refused
    assert "--no-such-srun-option" in refused, refused
    assert calls == ["--ntasks=1"] * 3, calls


def test_allocation_cpus_reads_slurms_form_and_names_a_bad_value():
    assert slurm_step.allocation_cpus("4(x2),2") == [4, 4, 2]
    assert slurm_step.allocation_cpus("8") == [8]
    with pytest.raises(ValueError, match=r"SLURM_JOB_CPUS_PER_NODE='4x2' is not of Slurm's form"):
        slurm_step.allocation_cpus("4x2")


def test_fit_error_counts_the_tasks_already_running_and_cpus_per_task():
    assert slurm_step.fit_error("7", [4, 4], 2, 4, 0) is None
    assert "room for 4 such task(s), 2 CPU(s) are held" in slurm_step.fit_error("7", [4, 4], 2, 4, 2)
    assert "more than any node of allocation 7" in slurm_step.fit_error("7", [4, 4], 6, 1, 0)


def test_a_step_too_long_for_one_argument_is_cut_into_several():
    parts = slurm_step.step_chunks(10, lambda a, b: (b - a) * 30_000)
    assert [len(p) for p in parts] == [2, 2, 3, 3]  # halved until each fits
    assert all((len(p) * 30_000 <= slurm_step.MAX_SCRIPT) for p in parts)
    assert [i for p in parts for i in p] == list(range(10))
