"""Pools on the real single-node Slurm start as one job array (issue 22): one `sbatch --array` call for the
pool (counted by a wrapper on PATH that logs each call and execs the real sbatch), task ids
``<array>_<index>`` everywhere a job id goes (squeue, scancel, `roving ps/logs/cancel`), a killed task
replaced alone, growing by arrays, arrays cut at MaxArraySize, limits and refusals as clear errors, and
back-off while Slurm says it is busy.

Workers ask for one CPU and 100 MB each: the test node declares 32 CPUs (scripts/cluster/slurm.sh), so a
pool of 32 can be admitted whole.
"""
from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
import sys
import time

import pytest

import helpers_backends as hb
import helpers_pool as hp
import helpers_targets as ht
import roving
from helpers_core import wait_until
from roving import backends
from roving.pool import PoolStartError
from roving.transport import session as _session

T = 120  # bound on every wait here: 32 interpreters start on 2 cores


@pytest.fixture(autouse=True)
def _slurm():
    hb.require("slurm")


def _sbatch_wrapper(tmp_path, monkeypatch, before: str = "") -> "callable":
    """Put an `sbatch` on PATH that logs each call (its --array option, or "single") and then runs
    ``before`` (sh) and execs the real sbatch; returns a function that reads the log."""
    real = shutil.which("sbatch")
    assert real, "Slurm's sbatch is not on PATH"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "sbatch.log"
    (bin_dir / "sbatch").write_text(
        "#!/bin/sh\n"
        "arr=single\n"
        'for a in "$@"; do case "$a" in --array=*) arr="$a";; esac; done\n'
        f"echo \"$arr\" >> {shlex.quote(str(log))}\n"
        f"{before}\n"
        f'exec {shlex.quote(real)} "$@"\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return lambda: log.read_text().split() if log.exists() else []


@pytest.fixture
def sbatch_calls(tmp_path, monkeypatch):
    return _sbatch_wrapper(tmp_path, monkeypatch)


def _tasks(array_id: str) -> dict:
    """squeue's view of an array: task id -> (job name, state, reason)."""
    out = subprocess.run(["squeue", "-h", "-r", "-t", "all", "-j", array_id,
                          "-O", "JobArrayID:|,Name:|,State:|,Reason:|"],
                         capture_output=True, text=True, timeout=30).stdout
    rows = [[p.strip() for p in line.split("|")] for line in out.splitlines()]
    return {r[0]: tuple(r[1:4]) for r in rows if len(r) >= 4}


def _live(pool):
    return [w for w in pool._workers.values() if not w.retiring and w.ident is not None]


def _use_slurm(**options):
    roving.init(backend="slurm", cpu=1, memory="100M", **options)


def test_a_pool_of_32_is_one_sbatch_array_listed_under_the_sessions_name_and_admitted_whole(sbatch_calls):
    _use_slurm()
    with roving.Pool(32) as p:
        ids = [proc.job.id for proc in p._pool]
        assert sbatch_calls() == ["--array=0-31"]  # one submission for the whole pool
        array = ids[0].split("_")[0]
        assert ids == [f"{array}_{i}" for i in range(32)]
        tasks = _tasks(array)
        assert sorted(tasks) == sorted(ids)
        assert {name for name, _, _ in tasks.values()} == {f"roving-{_session.current().tag}"}
        got = p.map(hp.slurm_array_task, [0.05] * 64, chunksize=1)
        assert {a for a, _ in got} == {array} and {int(t) for _, t in got} <= set(range(32))
        # the node holds all 32 at once (1 CPU each of its 32)
        assert wait_until(lambda: all(s == "RUNNING" for _, s, _ in _tasks(array).values()), T), _tasks(array)
        assert wait_until(lambda: len(_live(p)) == 32, T), len(_live(p))
    assert sbatch_calls() == ["--array=0-31"]  # and nothing else was submitted
    assert wait_until(lambda: all(s in ("CANCELLED", "COMPLETED") for _, s, _ in _tasks(array).values()), 60)


def test_a_killed_array_task_is_replaced_alone_and_every_item_completes_exactly_once(sbatch_calls, tmp_path):
    _use_slurm()
    runs = tmp_path / "runs"
    runs.mkdir()
    with roving.Pool(4) as p:
        array = p._pool[0].job.id.split("_")[0]
        assert wait_until(lambda: len(_live(p)) == 4, T)
        r = p.starmap_async(hp.slow_square_counting, [(x, 0.3, str(runs)) for x in range(40)], chunksize=1)
        victim = None
        assert wait_until(lambda: any(w.units for w in _live(p)), T)
        for w in _live(p):
            if w.units:
                victim = w.proc.job.id
                break
        assert victim and victim.startswith(f"{array}_")
        subprocess.run(["scancel", victim], check=True, timeout=30)
        assert r.get(T) == [x * x for x in range(40)]
        # slow_square_counting leaves a file when an item completes: each once, the killed one's too
        done = sorted(int(name.split(".")[0]) for name in os.listdir(runs))
        assert done == list(range(40))
        assert wait_until(lambda: len(_live(p)) == 4, T)
        states = _tasks(array)
        assert states[victim][1] == "CANCELLED"
        assert all(s == "RUNNING" for t, (_, s, _) in states.items() if t != victim), states  # only it
    assert sbatch_calls() == ["--array=0-3", "single"]  # the replacement: one job, alone


def test_resize_up_adds_an_array(sbatch_calls):
    _use_slurm()
    with roving.Pool(2) as p:
        assert sbatch_calls() == ["--array=0-1"]
        p.resize(6)
        assert wait_until(lambda: len(p._pool) == 6, T)
        assert sbatch_calls() == ["--array=0-1", "--array=0-3"]
        arrays = {proc.job.id.split("_")[0] for proc in p._pool}
        assert len(arrays) == 2
        assert p.map(hp.square, range(30)) == [x * x for x in range(30)]


def test_one_job_each_with_slurm_array_false(sbatch_calls):
    _use_slurm(slurm_array=False)
    with roving.Pool(3) as p:
        assert sbatch_calls() == ["single"] * 3
        assert all("_" not in proc.job.id for proc in p._pool)
        assert p.map(hp.square, range(6)) == [0, 1, 4, 9, 16, 25]


def test_a_pool_larger_than_max_array_size_is_cut_into_several_arrays(sbatch_calls, monkeypatch):
    _use_slurm()
    backend = backends.get("slurm")
    assert backend._limit("MaxArraySize", 0) == 1001  # what this cluster says (scontrol show config)
    monkeypatch.setitem(backend._cluster_settings(), "MaxArraySize", "4")
    with roving.Pool(10) as p:
        assert sbatch_calls() == ["--array=0-3", "--array=0-3", "--array=0-1"]
        assert len({proc.job.id.split("_")[0] for proc in p._pool}) == 3
        assert p.map(hp.square, range(20)) == [x * x for x in range(20)]


def test_an_array_whose_script_is_longer_than_one_argument_allows_is_still_one_sbatch(sbatch_calls):
    """600 tasks with 300 bytes of their own each: a script of about 200 KiB, more than the kernel's 128 KiB
    for one argument (sbatch --wrap failed with E2BIG); held (--hold), so nothing runs, then cancelled."""
    _use_slurm(slurm_options="--hold")
    backend = backends.get("slurm")
    session = backends.JobSession(_session.current().tag, "ROVING_TEST_SECRET", "ROVING_TEST_SECRET_FILE")
    specs = [backends.JobSpec(name=f"big-{i}", command=["/bin/true"], env={"PATH": os.environ["PATH"],
                              "ROVING_TEST_OWN": f"{i:04d}" * 75}, cwd="/tmp", session=session, output="off")
             for i in range(600)]
    script = sum(len(f"ROVING_TEST_OWN={s.env['ROVING_TEST_OWN']}") for s in specs)
    assert script > 128 * 1024
    jobs = backend.submit_many(specs)
    try:
        assert not [j for j in jobs if isinstance(j, Exception)][:1]
        array = jobs[0].id.split("_")[0]
        assert [j.id for j in jobs] == [f"{array}_{i}" for i in range(600)]
        assert sbatch_calls() == ["--array=0-599"]
    finally:
        backend.cancel_ids(sorted({j.id.split("_")[0] for j in jobs if not isinstance(j, Exception)}))


def test_more_workers_than_max_job_count_is_a_clear_error_before_anything_is_submitted(sbatch_calls, monkeypatch):
    _use_slurm(pool_start_failures=1)
    backend = backends.get("slurm")
    assert backend._limit("MaxJobCount", 0) == 10000
    monkeypatch.setitem(backend._cluster_settings(), "MaxJobCount", "6")
    p = roving.Pool(8)  # the pool is refused at once (its first submission); every call says why
    try:
        with pytest.raises(PoolStartError, match=r"8 jobs at once are more than this Slurm cluster holds "
                                                 r"\(MaxJobCount = 6"):
            p.map(hp.square, range(3))
    finally:
        p.terminate()
    assert sbatch_calls() == []


def test_an_array_slurm_refuses_names_the_limit_and_slurms_words(tmp_path, monkeypatch):
    calls = _sbatch_wrapper(tmp_path, monkeypatch, before=(
        'case "$arr" in --array=*) echo "sbatch: error: Batch job submission failed: Invalid job array '
        'specification" >&2; exit 1;; esac'))
    _use_slurm(pool_start_failures=1)
    p = roving.Pool(3)
    try:
        with pytest.raises(PoolStartError) as info:
            p.apply(hp.square, (2,))
    finally:
        p.terminate()
    text = str(info.value)
    assert "Slurm refused an array of 3 task(s)" in text and "MaxArraySize = 1001" in text
    assert "Invalid job array specification" in text
    assert calls() == ["--array=0-2"]  # a hard refusal is not retried


def test_sbatch_is_retried_with_backoff_while_slurm_is_busy_and_slurms_words_are_logged(tmp_path, monkeypatch,
                                                                                      caplog):
    count = tmp_path / "count"
    calls = _sbatch_wrapper(tmp_path, monkeypatch, before=(
        f'n=$(cat {count} 2>/dev/null || echo 0); echo $((n+1)) > {count}\n'
        'if [ "$n" -lt 2 ]; then echo "sbatch: error: Batch job submission failed: Resource temporarily '
        'unavailable" >&2; exit 1; fi'))
    _use_slurm()
    caplog.set_level(logging.WARNING, logger="roving.backends.throttle")
    t0 = time.monotonic()
    with roving.Pool(3) as p:
        assert time.monotonic() - t0 >= 1.5  # waited 0.5 s, then 1 s
        assert calls() == ["--array=0-2"] * 3
        assert p.map(hp.square, range(6)) == [0, 1, 4, 9, 16, 25]
    busy = [r.getMessage() for r in caplog.records if "busy" in r.getMessage()]
    assert len(busy) == 2 and all("Resource temporarily unavailable" in m for m in busy), busy
    assert "trying again in 0.5 s" in busy[0] and "trying again in 1.0 s" in busy[1]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "roving.cli", *args], capture_output=True, text=True, timeout=120)


def test_roving_ps_logs_and_cancel_take_array_task_ids():
    _use_slurm()
    with roving.Pool(3) as p:
        ids = [proc.job.id for proc in p._pool]
        array = ids[0].split("_")[0]
        assert wait_until(lambda: len(_live(p)) == 3, T)
        ps = _cli("ps", "--backend", "slurm").stdout
        lines = {line.split()[0]: line for line in ps.splitlines() if line.startswith(f"{array}_")}
        assert sorted(lines) == sorted(ids), ps
        assert all(_session.current().tag in line for line in lines.values())
        marker = f"array-marker-{os.getpid()}"
        for _ in range(6):  # on every worker, most likely
            p.apply(ht.print_lines, ([marker], []))
        assert wait_until(lambda: any(marker in _cli("logs", "--backend", "slurm", i).stdout for i in ids), 60)
        victim = next(proc for proc in p._pool if proc.job.id == ids[1])
        r = _cli("cancel", "--backend", "slurm", ids[1])
        assert r.returncode == 0 and f"cancelled {ids[1]}" in r.stdout, (r.stdout, r.stderr)
        victim.join(30)
        assert victim.exitcode == -15
        assert _tasks(array)[ids[0]][1] == "RUNNING"  # only that task
        r = _cli("cancel", "--backend", "slurm", f"{array}_999")  # no such task: refused, nothing cancelled
        assert r.returncode != 0 and f"{array}_999" in r.stdout + r.stderr, (r.stdout, r.stderr)
        assert _tasks(array)[ids[2]][1] == "RUNNING"
        r = _cli("cancel", "--backend", "slurm", array)  # the array's own id: all its tasks
        assert r.returncode == 0, r.stderr
        assert wait_until(lambda: all(s == "CANCELLED" for _, s, _ in _tasks(array).values()), 60)


def test_array_task_output_is_prefixed_and_roving_own_cancels_are_not_printed(capfd):
    _use_slurm()
    marker = f"prefixed-{os.getpid()}"
    seen = []

    def read():
        out, err = capfd.readouterr()
        seen.append((out, err))
        return "".join(o for o, _ in seen), "".join(e for _, e in seen)

    with roving.Pool(2) as p:
        array = p._pool[0].job.id.split("_")[0]
        p.apply(ht.print_lines, ([marker], []))
        assert wait_until(lambda: marker in read()[0], 30), read()
        line = next(t for t in read()[0].splitlines() if marker in t)
        assert line.startswith("[PoolWorker-") and line.endswith(f"] {marker}"), line
    assert wait_until(lambda: all(s == "CANCELLED" for _, s, _ in _tasks(array).values()), 60)
    time.sleep(1.5)  # the output followers read to the end
    err = read()[1]
    assert "CANCELLED" not in err, err  # slurmstepd's line of a task roving ended itself is not shown


def test_the_tasks_of_a_parent_killed_with_sigkill_are_cancelled(tmp_path):
    from helpers_core import PROGRAMS
    import signal

    out = tmp_path / "ids"
    proc = subprocess.Popen([sys.executable, str(PROGRAMS / "slurm_array_parent.py"), str(out), "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: out.exists() or proc.poll() is not None, T), "the parent did not start"
        assert out.exists(), proc.communicate(timeout=30)
        pid, *ids = out.read_text().split()
        array = ids[0].split("_")[0]
        assert ids == [f"{array}_{i}" for i in range(3)]
        assert all(s == "RUNNING" for _, s, _ in _tasks(array).values()), _tasks(array)
        os.kill(int(pid), signal.SIGKILL)
        proc.communicate(timeout=30)
        # the watcher cancels every task the parent left (its pipe closed)
        assert wait_until(lambda: all(s == "CANCELLED" for _, s, _ in _tasks(array).values()), 60), _tasks(array)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)


def test_with_child_output_files_each_array_task_writes_its_own_log(tmp_path):
    log_dir = tmp_path / "logs"
    _use_slurm(child_output="files", log_dir=str(log_dir))
    with roving.Pool(2) as p:
        names = [proc.name for proc in p._pool]
        assert all("_" in proc.job.id for proc in p._pool)
        for i in range(6):
            p.apply(ht.print_lines, ([f"line-{i}-{os.getpid()}"], []))

        def logged():
            return {n: (log_dir / f"{n}.log").read_text() if (log_dir / f"{n}.log").exists() else "" for n in names}
        assert wait_until(lambda: sum(t.count(f"-{os.getpid()}") for t in logged().values()) == 6, 30), logged()
        assert sorted(set(os.listdir(log_dir))) == sorted(f"{n}.log" for n in names)
        assert all(oct((log_dir / f"{n}.log").stat().st_mode & 0o777) == oct(0o600) for n in names
                   if (log_dir / f"{n}.log").exists())


def test_a_pending_array_is_logged_once_not_once_per_task(caplog):
    roving.init(backend="slurm", cpu=32, memory="100M", pending_warning=0.5)  # the whole node each: 1 runs
    caplog.set_level(logging.WARNING, logger="roving.backends.slurm")

    def warnings():
        return [r.getMessage() for r in caplog.records if "has been pending" in r.getMessage()]

    with roving.Pool(4) as p:
        array = p._pool[0].job.id.split("_")[0]
        assert wait_until(lambda: warnings(), 30), _tasks(array)
        time.sleep(2)  # the upkeep keeps asking about every task meanwhile
        assert len(warnings()) == 1, warnings()
        assert f"Slurm job {array}_" in warnings()[0] and "other pending tasks of this array" in warnings()[0]
        assert sum(s == "PENDING" for _, s, _ in _tasks(array).values()) >= 3
        p.terminate()


def test_a_worker_that_says_hello_before_its_submission_returned_is_not_lost(tmp_path, monkeypatch):
    """One job each: sbatch (a wrapper) returns only once the job runs and 5 s more, so the worker's first
    word reaches the pool before its submission has returned. The pool knows its workers before any of
    their jobs exists, so the worker is not ignored (it was, and the pool waited on it for ever)."""
    real = shutil.which("sbatch")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        "#!/bin/sh\n"
        f'out=$({shlex.quote(real)} "$@") || exit $?\n'
        'id=${out%%;*}\n'
        'for i in $(seq 150); do [ "$(squeue -h -j "$id" -o %T)" = RUNNING ] && break; sleep 0.2; done\n'
        "sleep 5\n"
        'echo "$out"\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    _use_slurm(slurm_array=False)
    with roving.Pool(2) as p:
        assert wait_until(lambda: len(_live(p)) == 2, 60), [(w.id, w.ident) for w in p._workers.values()]
        assert p.map(hp.square, range(4)) == [0, 1, 4, 9]
