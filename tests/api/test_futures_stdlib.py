"""roving.futures.Executor beside concurrent.futures.ProcessPoolExecutor where a call fails on its trip
(pickled here, unpickled in the worker, run, its result pickled there and unpickled here), where a worker
dies during shutdown, what each keeps of a finished call, what shutdown(cancel_futures=True) reaches, and
a submit at interpreter exit: the same program on both executors, asserting that they agree, or differ
exactly as roving's module docstring says (roving survives what breaks the standard library's executor)."""
from __future__ import annotations

import concurrent.futures as cf
import gc
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from concurrent.futures.process import BrokenProcessPool, _RemoteTraceback

import pytest

import helpers_futures_stdlib as fx
import roving
import roving.futures
from helpers_core import SUPPORT_DIR, TIMEOUT, wait_until
from roving.futures import Executor

KINDS = ["stdlib", "roving"]


def _stdlib(*args, **kwargs):
    kwargs.setdefault("mp_context", multiprocessing.get_context("spawn"))  # the test process runs threads
    return cf.ProcessPoolExecutor(*args, **kwargs)


@pytest.fixture(params=KINDS)
def make(request):
    """A factory of executors of one kind (roving's on the local backend); each is shut down after."""
    if request.param == "roving":
        roving.init(backend="local")
    factory = _stdlib if request.param == "stdlib" else Executor
    made = []

    def new(*args, **kwargs):
        ex = factory(*args, **kwargs)
        made.append(ex)
        return ex

    new.kind = request.param
    yield new
    for ex in made:
        ex.shutdown(wait=True, cancel_futures=True)


def _shutdown_returns(ex, limit=2 * TIMEOUT):
    """shutdown(wait=True) in a thread: whether it returned within ``limit`` seconds."""
    t = threading.Thread(target=ex.shutdown, kwargs={"wait": True}, daemon=True)
    t.start()
    t.join(limit)
    return not t.is_alive()


def _remote_text(exc):
    assert type(exc.__cause__) is _RemoteTraceback, type(exc.__cause__)
    return str(exc.__cause__)


# -- what reaches the future ----------------------------------------------------------------------
def test_a_remote_exceptions_cause_is_the_standard_librarys_remote_traceback(make):
    ex = make(1)
    exc = ex.submit(fx.raise_value_error, "raised on purpose").exception(TIMEOUT)
    assert type(exc) is ValueError and str(exc) == "raised on purpose"
    text = _remote_text(exc)
    assert "Traceback (most recent call last)" in text and "raise_value_error" in text
    assert "raise ValueError(message)" in text


def test_a_result_that_cannot_be_pickled_is_the_pickling_error_with_its_remote_traceback(make):
    ex = make(1)
    exc = ex.submit(fx.return_lock).exception(TIMEOUT)
    assert type(exc) is TypeError and "cannot pickle '_thread.lock' object" in str(exc)
    assert "Traceback (most recent call last)" in _remote_text(exc)
    exc = ex.submit(fx.return_instance, fx.ErrorAtPickle).exception(TIMEOUT)
    assert type(exc) is pickle.PicklingError and str(exc) == "refused on purpose"
    assert "__reduce__" in _remote_text(exc)
    assert ex.submit(fx.identity, 5).result(TIMEOUT) == 5  # neither breaks the executor


def test_a_call_that_cannot_be_unpickled_in_the_worker_is_a_broken_process_pool(make):
    ex = make(1)
    f = ex.submit(fx.identity, fx.ErrorAtUnpickle())
    with pytest.raises(BrokenProcessPool):
        f.result(TIMEOUT)
    if make.kind == "stdlib":  # its worker died of it: no cause, and the executor is broken
        assert f.exception().__cause__ is None
        with pytest.raises(BrokenProcessPool):
            ex.submit(fx.identity, 5).result(TIMEOUT)
    else:  # roving's says why, and goes on (its module docstring)
        cause = f.exception().__cause__
        assert type(cause) is pickle.UnpicklingError and str(cause) == "refused on purpose"
        assert "_raise_unpickling" in _remote_text(cause)
        assert ex.submit(fx.identity, 5).result(TIMEOUT) == 5


@pytest.mark.parametrize("what", [fx.ErrorAtUnpickle, fx.ExitAtUnpickle])
def test_a_result_that_cannot_be_unpickled_here_is_a_broken_process_pool_and_shutdown_returns(make, what):
    ex = make(1)
    f = ex.submit(fx.return_instance, what)
    with pytest.raises(BrokenProcessPool):
        f.result(TIMEOUT)
    cause = f.exception().__cause__
    if make.kind == "stdlib":  # its result thread's traceback, as text
        assert type(cause) is _RemoteTraceback
        assert ("_exit" if what is fx.ExitAtUnpickle else "_raise_unpickling") in str(cause)
    else:  # the error itself (it happened here); and the executor goes on
        assert type(cause) is (pickle.UnpicklingError if what is fx.ErrorAtUnpickle else SystemExit)
        assert ex.submit(fx.identity, 5).result(TIMEOUT) == 5
    assert _shutdown_returns(ex)


def test_a_call_whose_workers_all_died_is_caught_as_a_broken_process_pool(make):
    kwargs = {"max_task_retries": 1} if make.kind == "roving" else {}
    ex = make(1, **kwargs)
    f = ex.submit(fx.sleep_then_kill, 0.0)
    with pytest.raises(BrokenProcessPool):
        f.result(2 * TIMEOUT)
    if make.kind == "roving":  # roving's own error too, and the executor goes on
        assert isinstance(f.exception(), roving.WorkerLostError)
        assert isinstance(f.exception(), roving.futures.WorkerLostError)
        assert ex.submit(fx.identity, 5).result(TIMEOUT) == 5


# -- shutdown -------------------------------------------------------------------------------------
def test_shutdown_returns_when_a_worker_dies_while_it_shuts_down(make):
    ex = make(2)
    assert list(ex.map(fx.identity, range(4), timeout=2 * TIMEOUT)) == list(range(4))
    dying = ex.submit(fx.sleep_then_kill, 0.3)
    others = [ex.submit(fx.sleep_then_return, 0.1, i) for i in range(4)]
    assert _shutdown_returns(ex)
    assert all(f.done() for f in [dying, *others])
    with pytest.raises(BrokenProcessPool):  # roving's after max_task_retries workers died, as WorkerLostError
        dying.result(0)
    for i, f in enumerate(others):  # the standard library's may break them too; roving's run them
        if make.kind == "roving":
            assert f.result(0) == i
        else:
            assert f.exception(0) is None and f.result(0) == i or isinstance(f.exception(0), BrokenProcessPool)


def test_shutdown_cancel_futures_cancels_every_call_not_handed_to_a_worker(make, tmp_path):
    ex = make(1)
    assert ex.submit(fx.identity, 1).result(2 * TIMEOUT) == 1
    gate = tmp_path / "gate"
    blocker = ex.submit(fx.wait_for, str(gate))
    rest = [ex.submit(fx.identity, i) for i in range(60)]
    assert wait_until(blocker.running, TIMEOUT, interval=0.01)
    ex.shutdown(wait=False, cancel_futures=True)
    # the standard library cancels on a thread of its own: all but those handed over (2 at most)
    assert wait_until(lambda: sum(f.cancelled() for f in rest) >= len(rest) - 2, TIMEOUT, interval=0.01)
    gate.touch()
    assert blocker.result(TIMEOUT) == "done"
    cf.wait([f for f in rest if not f.cancelled()], timeout=TIMEOUT)
    ran = [i for i, f in enumerate(rest) if not f.cancelled()]
    # the calls that were not cancelled are the first, those handed over: max_workers + 1 at most, one of
    # them the blocker (roving's), or besides it (the standard library's worker took it from the queue)
    assert ran == list(range(len(ran))) and len(ran) <= 2, ran
    assert [rest[i].result(0) for i in ran] == ran


# -- what is kept of a finished call ----------------------------------------------------------------
def _collected(ref, limit=TIMEOUT):
    deadline = time.monotonic() + limit
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    return ref() is None


def test_a_calls_function_and_arguments_are_let_go_once_it_is_done_without_a_collection(make, tmp_path):
    ex = make(2)
    assert ex.submit(fx.identity, 1).result(2 * TIMEOUT) == 1
    gc.disable()  # refcounts only: nothing of a finished call may sit in a reference cycle
    try:
        obj = fx.Argument()  # a bound method (CPython's test_no_stale_references), the future dropped
        ref = weakref.ref(obj)
        ex.submit(obj.method)
        del obj
        assert _collected(ref)
        # an argument that cannot be pickled: the standard library's executor keeps the last one, even
        # after a collection (3.11 and 3.13); roving's lets it go at the next collection (the pickling
        # error's traceback holds the frames that held it, in a cycle with the pool's result)
        unpicklable = ("unpicklable",) if make.kind == "roving" else ()
        for how in ("submit", "raises", "map", "chunks", "cancelled", *unpicklable):
            obj = fx.Argument()
            ref = weakref.ref(obj)
            if how == "unpicklable":
                obj.lock = threading.Lock()
                assert isinstance(ex.submit(fx.identity, obj).exception(TIMEOUT), TypeError)
            elif how == "submit":
                assert isinstance(ex.submit(fx.identity, obj).result(TIMEOUT), fx.Argument)
            elif how == "raises":
                assert isinstance(ex.submit(fx.raise_value_error, obj).exception(TIMEOUT), ValueError)
            elif how == "map":
                assert len(list(ex.map(fx.identity, [obj, 1, obj], timeout=TIMEOUT))) == 3
            elif how == "chunks":
                assert len(list(ex.map(fx.identity, [obj, 1, obj, 2], chunksize=3, timeout=TIMEOUT))) == 4
            else:
                gate = tmp_path / "gate"
                blockers = [ex.submit(fx.wait_for, str(gate)) for _ in range(6)]
                f = ex.submit(fx.identity, obj)
                assert f.cancel()
                del f
                gate.touch()
                assert [b.result(TIMEOUT) for b in blockers] == ["done"] * 6
                gate.unlink()
            del obj
            if how == "unpicklable":
                gc.collect()
            assert _collected(ref), how
    finally:
        gc.enable()


# -- at interpreter exit ----------------------------------------------------------------------------
_LATE = """
import atexit, sys, threading
sys.path[:0] = {path!r}
import helpers_futures_stdlib as fx
{make}

def late():
    try:
        f = ex.submit(fx.identity, None)
        print("submitted:", f.result(30), flush=True)
    except RuntimeError as exc:
        print("RuntimeError:", exc, flush=True)

if __name__ == "__main__":
    {before}
    ex = make()
    assert ex.submit(fx.identity, 42).result(60) == 42
    {after}
"""
_MAKERS = {
    "stdlib": "from concurrent.futures import ProcessPoolExecutor\nimport multiprocessing\n"
              "def make(): return ProcessPoolExecutor(2, mp_context=multiprocessing.get_context('spawn'))",
    "roving": "from roving.futures import Executor\n"
              "def make(): return Executor(2)",
}


def _run_program(code, tmp_path, timeout=3 * TIMEOUT):
    """Run ``code`` in a fresh interpreter, in a session of its own; what it printed, or "hung" when it
    did not end within ``timeout`` seconds. Whatever it leaves running (workers of a broken executor)
    is killed after."""
    out = tmp_path / "out.txt"
    with open(out, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=sink,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        proc.wait(timeout)
        ended = True
    except subprocess.TimeoutExpired:
        ended = False
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    return out.read_text().strip() if ended else "hung"


@pytest.mark.parametrize("when", ["atexit handler registered first", "atexit handler registered last",
                                  "thread still running"])
def test_a_submit_at_interpreter_exit_raises_runtime_error(when, tmp_path):
    before = "atexit.register(late)" if when == "atexit handler registered first" else "pass"
    after = {"atexit handler registered last": "atexit.register(late)",
             "thread still running": "threading.Timer(0.5, late).start()"}.get(when, "pass")
    outs = {}
    for kind, maker in _MAKERS.items():
        outs[kind] = _run_program(_LATE.format(path=[str(SUPPORT_DIR), *sys.path], make=maker, before=before,
                                               after=after), tmp_path)
    assert outs["stdlib"] == "RuntimeError: cannot schedule new futures after shutdown", outs
    assert outs["roving"] == outs["stdlib"], outs


# ROVING_CONNECT_TIMEOUT=5: where the node's stream listener cannot start a thread for a handshake it drops
# the connection, which a worker takes for a busy listener and tries again until min(connect_timeout, 10 s)
# before it keeps to ZeroMQ; the default 30 s would have each such run wait out those 10 s
_NO_THREADS = """
import os, sys, threading
os.environ["ROVING_CONNECT_TIMEOUT"] = "5"
sys.path[:0] = {path!r}
import helpers_futures_stdlib as fx
{make}

if __name__ == "__main__":
    name = "_start_joinable_thread" if hasattr(threading, "_start_joinable_thread") else "_start_new_thread"
    real, made = getattr(threading, name), [0]

    def start(*args, **kwargs):  # as at interpreter finalization, after the first {allowed} thread(s)
        if made[0] >= {allowed}:
            raise RuntimeError("can't create new thread at interpreter shutdown")
        made[0] += 1
        return real(*args, **kwargs)

    setattr(threading, name, start)
    ex = make()
    try:
        print("results:", list(ex.map(fx.identity, [1] * 10, timeout=60)), flush=True)
    except Exception as exc:
        print(type(exc).__name__ + ":", exc, flush=True)
    os._exit(0)  # what is asked is the submit's answer; an exit without threads is another matter
"""


@pytest.mark.parametrize("allowed", range(9))
def test_a_submit_that_cannot_make_its_threads_raises_instead_of_hanging(allowed, tmp_path):
    """Thread creation fails after the first ``allowed`` threads, wherever roving would make the next (the
    executor's, the pool's, the node's stream listener): the calls raise RuntimeError, or run (on what
    threads there are), and never hang."""
    outs = {}
    for kind, maker in _MAKERS.items():
        if kind == "stdlib" and allowed:  # 3.11's hangs here (3.12 and later raise BrokenProcessPool)
            continue
        outs[kind] = _run_program(_NO_THREADS.format(path=[str(SUPPORT_DIR), *sys.path], make=maker,
                                                     allowed=allowed), tmp_path)
    refused = "RuntimeError: can't create new thread at interpreter shutdown"
    assert outs["roving"] in (refused, f"results: {[1] * 10}"), outs
    if allowed == 0:  # nothing to run on: both refuse
        assert outs["roving"] == outs["stdlib"] == refused, outs
