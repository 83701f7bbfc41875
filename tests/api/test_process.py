"""Process and the module functions around it behave as in multiprocessing."""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import re
import select
import signal
import sys
import textwrap
import threading
import time

import pytest

import helpers_targets as h
import roving
from helpers_core import TIMEOUT, read_log, run_script, start


def test_start_join_and_exitcode_zero_with_result_through_queue():
    q = roving.Queue()
    p = start(h.put_value, q, {"answer": 42})
    assert q.get(timeout=TIMEOUT) == {"answer": 42}
    p.join(TIMEOUT)
    assert p.exitcode == 0
    assert not p.is_alive()


def test_target_return_value_is_ignored_and_exitcode_is_zero():
    p = start(h.return_normally)
    p.join(TIMEOUT)
    assert p.exitcode == 0


def test_subclass_overriding_run_runs_in_child():
    q = roving.Queue()
    p = h.DoublingProcess(q, 21)
    p.start()
    kind, value, name = q.get(timeout=TIMEOUT)
    p.join(TIMEOUT)
    assert (kind, value, name) == ("run override", 42, p.name)
    assert p.exitcode == 0


def test_join_with_timeout_returns_while_child_runs_and_exitcode_stays_none():
    p = start(h.sleep_for, 60)
    p.join(0.2)
    assert p.is_alive()
    assert p.exitcode is None
    p.kill()
    p.join(TIMEOUT)
    assert p.exitcode == -signal.SIGKILL


def test_terminate_ends_child_with_exitcode_minus_sigterm():
    p = start(h.sleep_for, 60)
    assert p.is_alive()
    p.terminate()
    p.join(TIMEOUT)
    assert p.exitcode == -signal.SIGTERM == -15
    assert not p.is_alive()


def test_kill_ends_child_with_exitcode_minus_sigkill():
    p = start(h.sleep_for, 60)
    p.kill()
    p.join(TIMEOUT)
    assert p.exitcode == -signal.SIGKILL == -9


def test_sys_exit_sets_exitcode_like_multiprocessing(log_dir):
    cases = {"int": (3, 3), "none": (None, 0), "zero": (0, 0), "message": ("bye now", 1)}
    procs = {key: start(h.exit_with, arg, name=f"exit-{key}") for key, (arg, _) in cases.items()}
    for key, (_, expected) in cases.items():
        procs[key].join(TIMEOUT)
        assert procs[key].exitcode == expected, key
    # multiprocessing prints a non-integer SystemExit argument to stderr
    assert "bye now" in read_log(log_dir, "exit-message")


def test_child_raising_prints_traceback_and_exits_with_1(log_dir):
    p = start(h.raise_value_error, "something broke in the child", name="raiser")
    p.join(TIMEOUT)
    assert p.exitcode == 1
    log = read_log(log_dir, "raiser")
    assert "Traceback (most recent call last)" in log
    assert "ValueError: something broke in the child" in log
    assert "raise_value_error" in log


def test_pid_name_and_daemon_are_seen_alike_by_parent_and_child():
    q = roving.Queue()
    p = roving.Process(target=h.report_identity, args=(q,), name="worker-x", daemon=True)
    assert p.pid is None
    assert p.name == "worker-x" and p.daemon is True
    p.start()
    info = q.get(timeout=TIMEOUT)
    p.join(TIMEOUT)
    assert info["name"] == "worker-x"
    assert info["daemon"] is True
    assert info["pid"] == info["os_pid"] == p.pid
    assert p.ident == p.pid
    assert isinstance(p.pid, int) and p.pid != os.getpid()


def test_parent_process_in_child_is_the_caller_and_none_in_main():
    assert roving.parent_process() is None
    assert roving.current_process().name == "MainProcess"
    assert roving.current_process().pid == os.getpid()
    q = roving.Queue()
    p = start(h.report_identity, q)
    info = q.get(timeout=TIMEOUT)
    p.join(TIMEOUT)
    assert info["parent_name"] == "MainProcess"
    assert info["parent_pid"] == os.getpid()
    assert info["parent_alive"] is True


def test_default_names_are_process_n_with_increasing_n():
    a, b = roving.Process(target=h.return_normally), roving.Process(target=h.return_normally)
    assert a.name.startswith("Process-") and b.name.startswith("Process-")
    assert int(b.name.split("-")[1]) == int(a.name.split("-")[1]) + 1


def test_name_setter_rejects_non_string_and_daemon_cannot_change_after_start():
    p = roving.Process(target=h.sleep_for, args=(60,))
    p.name = "renamed"
    assert p.name == "renamed"
    with pytest.raises(TypeError):
        p.name = 3
    p.daemon = True
    assert p.daemon
    p.start()
    with pytest.raises(AssertionError):
        p.daemon = False
    p.kill()
    p.join(TIMEOUT)


def test_authkey_is_bytes_and_shared_by_the_child():
    q = roving.Queue()
    p = start(h.report_identity, q)
    info = q.get(timeout=TIMEOUT)
    p.join(TIMEOUT)
    assert isinstance(p.authkey, bytes) and len(p.authkey) >= 16
    assert info["authkey"] == roving.current_process().authkey == p.authkey


def test_sentinel_is_not_readable_while_running_and_readable_after_exit_via_select_and_wait():
    p = start(h.sleep_for, 60)
    assert select.select([p.sentinel], [], [], 0)[0] == []
    assert multiprocessing.connection.wait([p.sentinel], timeout=0) == []
    p.terminate()
    ready, _, _ = select.select([p.sentinel], [], [], TIMEOUT)
    assert ready == [p.sentinel]
    assert multiprocessing.connection.wait([p.sentinel], timeout=TIMEOUT) == [p.sentinel]
    p.join(TIMEOUT)
    assert p.exitcode == -15


def test_sentinel_before_start_raises_value_error():
    with pytest.raises(ValueError):
        roving.Process(target=h.return_normally).sentinel  # noqa: B018  (the read is what raises)


def test_sentinels_of_several_children_via_connection_wait_report_the_one_that_ended():
    sleeper = start(h.sleep_for, 60)
    quick = start(h.return_normally)
    ready = multiprocessing.connection.wait([sleeper.sentinel, quick.sentinel], timeout=TIMEOUT)
    assert ready == [quick.sentinel]
    sleeper.kill()
    sleeper.join(TIMEOUT)
    quick.join(TIMEOUT)


def test_start_twice_raises_assertion_error():
    p = start(h.return_normally)
    with pytest.raises(AssertionError):
        p.start()
    p.join(TIMEOUT)


def test_join_before_start_raises_assertion_error():
    with pytest.raises(AssertionError):
        roving.Process(target=h.return_normally).join(0.1)


def test_close_while_running_raises_then_close_after_join_makes_object_unusable():
    p = start(h.sleep_for, 60)
    with pytest.raises(ValueError):
        p.close()
    p.kill()
    p.join(TIMEOUT)
    p.close()
    p.close()  # closing twice is allowed
    for use in (lambda: p.is_alive(), lambda: p.exitcode, lambda: p.pid, lambda: p.join(0),
                lambda: p.sentinel, lambda: p.start()):
        with pytest.raises(ValueError):
            use()


def test_active_children_lists_running_children_and_drops_ended_ones():
    p = start(h.sleep_for, 60)
    done = start(h.return_normally)
    done.join(TIMEOUT)
    children = roving.active_children()
    assert p in children
    assert done not in children
    p.kill()
    p.join(TIMEOUT)
    assert p not in roving.active_children()


def test_child_is_reaped_without_join_once_it_ends():
    p = start(h.return_normally)
    ready = multiprocessing.connection.wait([p.sentinel], timeout=TIMEOUT)
    assert ready == [p.sentinel]
    assert not p.is_alive()
    assert p.exitcode == 0
    assert p not in roving.active_children()


def test_cpu_count_is_a_positive_int():
    n = roving.cpu_count()
    assert isinstance(n, int) and n >= 1


def test_get_context_gives_a_working_process_and_queue_for_each_start_method():
    for method in ("spawn", "fork", "forkserver"):
        ctx = roving.get_context(method)
        assert ctx.get_start_method() == method
    ctx = roving.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=h.put_value, args=(q, "via context"))
    p.start()
    assert q.get(timeout=TIMEOUT) == "via context"
    p.join(TIMEOUT)
    assert p.exitcode == 0
    with pytest.raises(ValueError):
        roving.get_context("no-such-method")


def test_set_start_method_once_then_runtime_error_unless_forced():
    roving.set_start_method("spawn")
    assert roving.get_start_method() == "spawn"
    with pytest.raises(RuntimeError):
        roving.set_start_method("fork")
    roving.set_start_method("fork", force=True)
    assert roving.get_start_method() == "fork"
    assert roving.get_context().get_start_method() == "fork"
    with pytest.raises(ValueError):
        roving.set_start_method("bogus", force=True)
    assert set(roving.get_all_start_methods()) >= {"spawn", "fork", "forkserver"}


def test_unpicklable_target_is_a_serialization_error_at_start_naming_it():
    lock = threading.Lock()
    p = roving.Process(target=lock.acquire)
    before = set(roving.active_children())
    with pytest.raises(roving.SerializationError) as info:
        p.start()
    assert isinstance(info.value, TypeError)
    assert "target" in str(info.value)
    assert set(roving.active_children()) == before


def test_failed_start_leaves_pid_none_as_before_start():
    p = roving.Process(target=threading.Lock().acquire)
    with pytest.raises(roving.SerializationError):
        p.start()
    assert p.pid is None  # multiprocessing: no process was created, so there is no pid


def test_unpicklable_argument_is_a_serialization_error_at_start_naming_it():
    p = roving.Process(target=h.put_value, args=(roving.Queue(), threading.Lock()))
    with pytest.raises(TypeError) as info:
        p.start()
    assert isinstance(info.value, roving.SerializationError)
    message = str(info.value)
    assert "argument 1" in message and "lock" in message.lower()
    p2 = roving.Process(target=h.put_value, kwargs={"q": roving.Queue(), "value": threading.Lock()})
    with pytest.raises(roving.SerializationError, match="keyword argument 'value'"):
        p2.start()


def test_child_that_cannot_import_its_targets_module_exits_1_showing_the_import_error(tmp_path, log_dir):
    moddir = tmp_path / "vanishing"
    moddir.mkdir()
    (moddir / "vanishing_target_mod.py").write_text("def target():\n    print('should never run')\n")
    sys.path.insert(0, str(moddir))
    sys.dont_write_bytecode, saved = True, sys.dont_write_bytecode
    try:
        import vanishing_target_mod
        p = roving.Process(target=vanishing_target_mod.target, name="no-import")
        # the module's file disappears before the child imports it
        (moddir / "vanishing_target_mod.py").unlink()
        p.start()
        p.join(TIMEOUT)
    finally:
        sys.dont_write_bytecode = saved
        sys.path.remove(str(moddir))
        sys.modules.pop("vanishing_target_mod", None)
    assert p.exitcode == 1
    log = read_log(log_dir, "no-import")
    assert "ModuleNotFoundError" in log or "ImportError" in log
    assert "vanishing_target_mod" in log
    assert "should never run" not in log


def test_main_module_functions_lambdas_and_local_classes_run_in_children_by_value(tmp_path):
    script = tmp_path / "by_value_main.py"
    script.write_text(textwrap.dedent("""
        import roving

        def main_function(q, x):
            q.put(("main function", x + 1))

        def make_local():
            class Local:
                def __init__(self, v):
                    self.v = v
            return Local

        if __name__ == "__main__":
            q = roving.Queue()
            Local = make_local()
            procs = [roving.Process(target=main_function, args=(q, 1)),
                     roving.Process(target=lambda q: q.put(("lambda", 2)), args=(q,)),
                     roving.Process(target=lambda q, obj: q.put(("local class", obj.v)),
                                    args=(q, Local(3)))]
            for p in procs:
                p.start()
            got = sorted(q.get(timeout=30) for _ in procs)
            for p in procs:
                p.join(30)
            print(got, [p.exitcode for p in procs])
    """))
    result = run_script(script, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[('lambda', 2), ('local class', 3), ('main function', 2)] [0, 0, 0]"


# -- child output ------------------------------------------------------------------------------

def _read_until(capfd, expected_out, expected_err):
    """Collect captured output until every expected text is there (bounded), then return it."""
    import time

    out = err = ""
    deadline = time.monotonic() + TIMEOUT
    while True:
        o, e = capfd.readouterr()
        out, err = out + o, err + e
        if all(t in out for t in expected_out) and all(t in err for t in expected_err):
            return out, err
        if time.monotonic() > deadline:
            return out, err
        time.sleep(0.05)


def test_child_output_prefix_puts_process_name_before_each_stdout_and_stderr_line(capfd):
    roving.init(child_output="prefix")
    p = roving.Process(target=h.print_lines, args=(["out one", "out two"], ["err one"]))
    p.start()
    p.join(TIMEOUT)
    assert p.exitcode == 0
    tag = f"[{p.name}] "
    out, err = _read_until(capfd, [tag + "out one\n", tag + "out two\n"], [tag + "err one\n"])
    assert out.splitlines() == [tag + "out one", tag + "out two"]
    assert err.splitlines() == [tag + "err one"]


def test_child_output_prefix_is_the_default_and_shows_a_childs_traceback_on_stderr(capfd):
    p = start(h.raise_value_error, "visible failure")
    p.join(TIMEOUT)
    assert p.exitcode == 1
    tag = f"[{p.name}] "
    _, err = _read_until(capfd, [], [tag + "ValueError: visible failure"])
    assert tag + "ValueError: visible failure" in err
    assert tag + "Traceback (most recent call last):" in err


def test_child_output_files_writes_one_log_per_process_in_log_dir(log_dir, capfd):
    a = roving.Process(target=h.print_lines, args=(["from a"], ["a err"]), name="alpha")
    b = roving.Process(target=h.print_lines, args=(["from b"], []), name="beta")
    a.start()
    b.start()
    a.join(TIMEOUT)
    b.join(TIMEOUT)
    assert sorted(os.listdir(log_dir)) == ["alpha.log", "beta.log"]
    assert read_log(log_dir, "alpha").splitlines() == ["from a", "a err"]
    assert read_log(log_dir, "beta").splitlines() == ["from b"]
    out, err = capfd.readouterr()
    assert "from a" not in out + err and "from b" not in out + err


def test_child_output_off_discards_output_and_writes_no_files(tmp_path, capfd):
    roving.init(child_output="off", log_dir=str(tmp_path / "logs"))
    p = roving.Process(target=h.print_lines, args=(["silenced out"], ["silenced err"]))
    p.start()
    p.join(TIMEOUT)
    assert p.exitcode == 0
    # a sibling with prefix output is the proof that capture works: its line arrives, the silenced ones not
    roving.init(child_output="prefix")
    q = roving.Process(target=h.print_lines, args=(["marker line"], []))
    q.start()
    q.join(TIMEOUT)
    out, err = _read_until(capfd, ["marker line"], [])
    assert "marker line" in out
    assert "silenced" not in out + err
    assert not (tmp_path / "logs").exists()


def test_a_roving_object_given_to_a_process_of_the_standard_librarys_multiprocessing_is_refused_at_its_start():
    """Such a process is no member of the roving session: it could not authenticate to use the object,
    and whoever waits on the object here would wait until their timeout. Its start says so at once."""
    manager = roving.Manager()
    a, b = roving.Pipe()
    objects = {"Queue": roving.Queue(), "Pipe's Connection": a, "Lock": roving.Lock(), "Event": roving.Event(),
               "RawValue": roving.Value("i", 0), "manager proxy (list)": manager.list()}
    try:
        for method in ("spawn", "forkserver"):
            ctx = multiprocessing.get_context(method)
            for what, obj in objects.items():
                p = ctx.Process(target=print, args=(obj,))
                started = time.monotonic()
                with pytest.raises(RuntimeError, match=rf"this {re.escape(what)} cannot be given to a process that "
                                                       "the standard library's multiprocessing starts.*roving.Process"):
                    p.start()
                assert time.monotonic() - started < 10
        q = roving.Queue()  # roving's own children still take them
        p = roving.Process(target=h.put_value, args=(q, "through"))
        p.start()
        assert q.get(timeout=TIMEOUT) == "through"
        p.join(TIMEOUT)
    finally:
        manager.shutdown()
