"""Process behaviours checked the way CPython's own multiprocessing tests check them, on the local
backend and on the real single-node Slurm (tests/support/helpers_backends.py: a Slurm that is not running fails)."""
from __future__ import annotations

import gc
import os
import time
import weakref

import pytest

import roving
import helpers_parity
from helpers_backends import require
from helpers_core import TIMEOUT


@pytest.fixture(params=["local", "slurm"])
def backend(request):
    require(request.param)
    roving.init(backend=request.param)
    return request.param


def test_child_waits_for_its_non_daemonic_threads_before_it_exits(backend):
    evt = roving.Event()
    proc = roving.Process(target=helpers_parity.set_event_from_a_thread_and_return, args=(evt, 1.0))
    proc.start()
    proc.join(TIMEOUT)
    assert proc.exitcode == 0
    assert evt.is_set(), "the child exited before its non-daemonic thread set the event"


def test_process_object_is_freed_after_join_close_and_del(backend):
    proc = roving.Process(target=helpers_parity.put_five, args=(roving.Queue(), b"x"))
    proc.start()
    proc.join(TIMEOUT)
    assert proc.exitcode == 0
    proc.close()
    wr = weakref.ref(proc)
    del proc
    gc.collect()
    assert wr() is None, f"something still holds the Process: {gc.get_referrers(wr())!r:.300}"


def test_process_object_is_freed_when_deleted_after_join_without_close(backend):
    proc = roving.Process(target=helpers_parity.put_five, args=(roving.Queue(), b"x"))
    proc.start()
    proc.join(TIMEOUT)
    wr = weakref.ref(proc)
    del proc
    gc.collect()
    assert wr() is None


def test_start_drops_the_target_and_arguments_as_multiprocessing_does(backend):
    # multiprocessing's test_lose_target_ref: neither the target nor an argument survives start()
    c = helpers_parity.Dummy()
    wr = weakref.ref(c)
    q = roving.Queue()
    proc = roving.Process(target=c, args=(q, c))
    del c
    proc.start()
    proc.join(TIMEOUT)
    gc.collect()
    assert wr() is None
    assert q.get(timeout=TIMEOUT) == 5
    for name in ("_target", "_args", "_kwargs"):
        assert not hasattr(proc, name)


class _Big(bytearray):
    pass


def test_a_large_argument_is_freed_in_the_parent_after_start(backend):
    big = _Big(16 << 20)
    wr = weakref.ref(big)
    q = roving.Queue()
    proc = roving.Process(target=helpers_parity.put_five, kwargs={"q": q, "big": big})
    del big
    proc.start()
    gc.collect()
    assert wr() is None, "the parent still holds the argument after start()"
    proc.join(TIMEOUT)
    assert proc.exitcode == 0 and q.get(timeout=TIMEOUT) == 5


def test_stdlib_current_and_parent_process_describe_the_roving_child(backend):
    q = roving.Queue()
    proc = roving.Process(target=helpers_parity.report_stdlib_identity, args=(q,), name="worker-7")
    proc.start()
    got = q.get(timeout=TIMEOUT)
    proc.join(TIMEOUT)
    assert got["name"] == got["roving_name"] == got["log_process_name"] == "worker-7"
    assert got["pid"] == got["ident"] == got["roving_pid"]
    if backend == "local":
        assert got["pid"] == proc.pid
    assert got["parent_name"] == "MainProcess"
    assert got["parent_pid"] == os.getpid()
    assert got["parent_alive"] is True
    # on purpose: the standard library keeps its own authkey and daemon flag (docs/guides/multiprocessing.md)
    assert got["same_authkey"] is False and got["daemon"] is False


def test_renaming_the_roving_child_renames_the_stdlib_one_too(backend):
    q = roving.Queue()
    proc = roving.Process(target=helpers_parity.rename_and_report, args=(q, "renamed"))
    proc.start()
    assert q.get(timeout=TIMEOUT) == "renamed"
    proc.join(TIMEOUT)


def test_a_process_freed_without_close_gives_back_its_sentinel(backend):
    proc = roving.Process(target=helpers_parity.put_five, args=(roving.Queue(), b"x"))
    proc.start()
    fd = proc.sentinel
    what = _fd_target(fd)  # a pidfd (local) or a pipe (slurm): the number alone may be reused
    proc.join(TIMEOUT)
    del proc
    gc.collect()
    deadline = time.monotonic() + TIMEOUT
    while _fd_target(fd) == what and time.monotonic() < deadline:
        time.sleep(0.05)  # the reaper's thread closes it
    assert _fd_target(fd) != what


def _fd_target(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def test_manager_server_with_a_call_still_blocked_ends_by_itself_at_shutdown():
    # the server's threads serving clients are not waited for (multiprocessing's are daemonic): the
    # server process ends with code 0 rather than being terminated after shutdown's timeout
    from roving.managers import AsyncManager

    manager = AsyncManager()
    manager.start()
    q = manager.Queue()
    q.get()  # a call that blocks in the server for ever
    time.sleep(0.5)  # let it reach the server (the test passes either way if it had not)
    manager.shutdown()
    assert manager._process.exitcode == 0
