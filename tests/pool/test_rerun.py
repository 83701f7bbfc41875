"""A call that failed on a pool worker runs again in the caller's process (roving.debug.rerun,
AsyncResult.rerun_locally, an Executor's future): the same function and pickled arguments, reaching the
same exception here, under a debugger when asked."""
from __future__ import annotations

import os

import pytest

import helpers_pool as hp
import roving
import roving.debug
from roving.futures import Executor


def test_a_failed_map_item_reruns_here_with_the_same_arguments_and_the_same_exception():
    with roving.Pool(2) as pool:
        with pytest.raises(ValueError) as caught:
            pool.starmap(hp.fail_on, [(x, 7) for x in range(10)], chunksize=3)  # item 7: offset 1 of a chunk
        with pytest.raises(ValueError) as mapped:
            pool.map(hp.raise_value_error, ["first message", "second"], chunksize=2)
    assert str(caught.value) == "bad item 7"
    with pytest.raises(ValueError) as again:
        roving.debug.rerun(caught.value)
    assert str(again.value) == "bad item 7"
    with pytest.raises(ValueError, match="^first message$"):
        roving.debug.rerun(mapped.value)
    # it ran here: its traceback is this process's, ending in the function itself
    tb = again.value.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert tb.tb_frame.f_code.co_name == "fail_on" and again.value.__cause__ is None


def test_apply_with_keyword_arguments_and_starmap_rerun_as_they_were_called(tmp_path):
    with roving.Pool(1) as pool:
        result = pool.apply_async(hp.fail_on, (7,), {"bad": 7})
        result.wait(60)
        with pytest.raises(ValueError, match="7"):
            result.rerun_locally()
        star = pool.starmap_async(hp.add, [(1, 2), (3, "x")])
        star.wait(60)
        with pytest.raises(TypeError) as again:
            star.rerun_locally()
        assert "unsupported operand" in str(again.value) or "can only concatenate" in str(again.value)


def test_the_arguments_are_those_the_worker_got_not_the_callers_objects_changed_since():
    box = [3]
    with roving.Pool(1) as pool:
        result = pool.apply_async(hp.fail_on, (box,), {"bad": [3]})
        result.wait(60)
        box[0] = 4  # changed after the call: the rerun still has [3]
        with pytest.raises(ValueError, match=r"\[3\]"):
            result.rerun_locally()


def test_a_rerun_that_succeeds_returns_its_value_and_pdb_runs_it_under_the_debugger(monkeypatch):
    calls = []
    import pdb

    monkeypatch.setattr(pdb, "runcall", lambda f, *a, **k: calls.append((f.__name__, a, k)) or f(*a, **k))
    with roving.Pool(1) as pool:
        result = pool.apply_async(hp.fail_if_pid_is_not, (os.getpid(),))
        result.wait(60)
        assert not result.successful()
        assert result.rerun_locally(pdb=True) == "ran in the caller"  # here the pid matches
    assert calls == [("fail_if_pid_is_not", (os.getpid(),), {})]


def test_an_executors_failed_future_reruns_here():
    with Executor(max_workers=1) as ex:
        future = ex.submit(hp.fail_on, 5, bad=5)
        with pytest.raises(ValueError):
            future.result(60)
    with pytest.raises(ValueError, match="5"):
        roving.debug.rerun(future)


def test_what_is_not_a_failed_pool_call_is_refused_with_a_clear_error():
    with pytest.raises(LookupError, match="no failed pool call is known"):
        roving.debug.rerun(ValueError("made here"))
    with pytest.raises(TypeError, match="not int"):
        roving.debug.rerun(3)
    with roving.Pool(1) as pool:
        ok = pool.apply_async(abs, (-1,))
        ok.wait(60)
        with pytest.raises(ValueError, match="the call succeeded"):
            ok.rerun_locally()


def test_an_item_whose_workers_died_reruns_here_too():
    roving.init(child_output="off")
    with roving.Pool(1, max_task_retries=1) as pool:
        result = pool.apply_async(hp.die_unless_pid_is, (os.getpid(),))
        with pytest.raises(roving.WorkerLostError):
            result.get(120)
        assert result.rerun_locally() == "survived in the caller"
