"""Manager, its shared types across processes, custom registered types, asynchronous handles collected in
any order, and a manager whose server died."""
from __future__ import annotations

import gc
import queue
import time

import pytest

import roving
from roving import managers
from roving.managers import AsyncManager, BaseManager, BaseProxy, ServerGone, SyncManager
from helpers_core import TIMEOUT, finish, start


# -- targets run in children ---------------------------------------------------------------------

def change_containers(lst, dct, ns, value, arr):
    lst.append("child")
    lst[0] = "first"
    dct["child"] = [1, 2]
    dct.update(extra=3)
    ns.seen = ns.x + 1
    value.value = value.value * 10
    arr[1] = 9.5


def consume_queues(q, jq, out):
    out.put(q.get(timeout=TIMEOUT) * 2)
    item = jq.get(timeout=TIMEOUT)
    out.put(item)
    jq.task_done()


def use_sync_objects(lock, rlock, sem, bsem, event, cond, barrier, counter, out):
    for _ in range(50):
        with lock:
            counter.value = counter.value + 1
    with rlock:
        with rlock:
            pass
    out.put(sem.acquire(timeout=TIMEOUT))
    sem.release()
    out.put(bsem.acquire(False))
    bsem.release()
    out.put(event.wait(TIMEOUT))
    with cond:
        cond.notify_all()
    out.put(barrier.wait(TIMEOUT))


def call_after_event(proxy, event, out):
    out.put("ready")  # the proxy has been rebuilt here, with its reference at the server
    event.wait(TIMEOUT)  # a roving Event, homed at the test process
    t0 = time.monotonic()
    try:
        proxy.append(1)
        out.put(("no error", time.monotonic() - t0))
    except Exception as exc:
        out.put((type(exc).__name__, time.monotonic() - t0))


def square(x):
    return x * x


class Counter:
    def __init__(self, start=0):
        self.n = start

    def add(self, k=1):
        self.n += k
        return self.n

    def value(self):
        return self.n

    def fail(self):
        raise KeyError("boom")

    def child(self):
        return Counter(self.n * 100)

    def slow(self, delay, tag):
        time.sleep(delay)
        return tag


class Env:
    """An environment whose step only makes sense after a reset: the log says what ran, in order."""

    def __init__(self):
        self.log = None

    def reset(self, delay):
        time.sleep(delay)  # a reset that takes a while: a step run beside it would come first
        self.log = []
        return "reset"

    def step(self, action, delay):
        time.sleep(delay)
        if self.log is None:
            raise RuntimeError("step before reset")
        self.log.append(action)
        return list(self.log)


class CounterProxy(BaseProxy):
    _exposed_ = ("add", "value", "fail", "child", "slow")
    _method_to_typeid_ = {"child": "Counter"}

    def add(self, k=1):
        return self._callmethod("add", (k,))

    def value(self):
        return self._callmethod("value")

    def fail(self):
        return self._callmethod("fail")

    def child(self):
        return self._callmethod("child")

    def slow(self, delay, tag):
        return self._callmethod("slow", (delay, tag))


class MyManager(BaseManager):
    pass


MyManager.register("Counter", Counter, CounterProxy)
MyManager.register("hidden_counter", Counter, exposed=("value",))


class MyAsyncManager(AsyncManager):
    pass


MyAsyncManager.register("Counter", Counter, CounterProxy)
MyAsyncManager.register("Env", Env)


def add_from_child(counter, n):
    for _ in range(n):
        counter.add()


# -- SyncManager's types across processes -----------------------------------------------------------

def test_list_dict_namespace_value_array_changed_in_a_child_are_seen_by_the_parent():
    with roving.Manager() as m:
        lst, dct, ns = m.list(["a", "b"]), m.dict({"k": 1}), m.Namespace(x=1)
        value, arr = m.Value("i", 4), m.Array("d", [0.0, 0.0])
        finish(start(change_containers, lst, dct, ns, value, arr))
        assert lst[:] == ["first", "b", "child"] and len(lst) == 3 and list(lst) == ["first", "b", "child"]
        assert dict(dct.items()) == {"k": 1, "child": [1, 2], "extra": 3}
        assert sorted(dct) == ["child", "extra", "k"] and "k" in dct and dct.get("zz", 5) == 5
        assert ns.seen == 2 and value.value == 40 and arr[1] == 9.5 and len(arr) == 2
        lst += ["more"]
        assert lst[-1] == "more" and str(lst) == repr(["first", "b", "child", "more"])
        with pytest.raises(IndexError):
            lst[99]
        with pytest.raises(KeyError):
            dct["missing"]
        with pytest.raises(AttributeError):
            ns.missing  # noqa: B018  (the read is what raises)


def test_queue_and_joinable_queue_through_a_manager_across_processes():
    with roving.Manager() as m:
        q, jq, out = m.Queue(), m.JoinableQueue(), m.Queue()
        p = start(consume_queues, q, jq, out)
        q.put(21)
        jq.put("job")
        assert out.get(timeout=TIMEOUT) == 42 and out.get(timeout=TIMEOUT) == "job"
        jq.join()  # returns because the child called task_done
        finish(p)
        with pytest.raises(queue.Empty):
            q.get(timeout=0.1)


def test_locks_semaphores_event_condition_barrier_of_a_manager_across_processes():
    with roving.Manager() as m:
        lock, rlock, sem, bsem = m.Lock(), m.RLock(), m.Semaphore(1), m.BoundedSemaphore(1)
        event, cond, barrier, counter = m.Event(), m.Condition(), m.Barrier(2), m.Value("i", 0)
        out = m.Queue()
        p = start(use_sync_objects, lock, rlock, sem, bsem, event, cond, barrier, counter, out)
        for _ in range(50):
            with lock:
                counter.value = counter.value + 1
        assert out.get(timeout=TIMEOUT) is True and out.get(timeout=TIMEOUT) is True
        with cond:
            event.set()
            assert cond.wait(TIMEOUT) is True  # notified by the child
        index = barrier.wait(TIMEOUT)
        assert out.get(timeout=TIMEOUT) is True  # the child's event.wait()
        assert sorted([index, out.get(timeout=TIMEOUT)]) == [0, 1]
        finish(p)
        assert counter.value == 100
        assert barrier.parties == 2 and not barrier.broken
        with pytest.raises(ValueError):
            bsem.release()
        with pytest.raises(RuntimeError):
            rlock.release()  # threading.RLock: cannot release un-acquired lock


def test_pool_of_a_manager_maps_and_its_async_results_are_proxies():
    with roving.Manager() as m:
        with m.Pool(1) as pool:
            assert pool.map(square, range(5)) == [0, 1, 4, 9, 16]
            res = pool.apply_async(square, (7,))
            assert isinstance(res, BaseProxy) and res.get(TIMEOUT) == 49
            assert sorted(pool.imap_unordered(square, [1, 2])) == [1, 4]


# -- custom types, proxies, lifetime ------------------------------------------------------------------

def test_registered_custom_type_with_its_proxy_method_to_typeid_and_exposed_limits():
    with MyManager() as m:
        counter = m.Counter(5)
        procs = [start(add_from_child, counter, 10) for _ in range(2)]
        finish(*procs)
        assert counter.value() == 25
        child = counter.child()
        assert isinstance(child, CounterProxy) and child.value() == 2500
        with pytest.raises(KeyError, match="boom"):
            counter.fail()
        hidden = m.hidden_counter(3)
        assert hidden.value() == 3 and not hasattr(hidden, "add")
        with pytest.raises(AttributeError, match="not in the list of allowed methods"):
            hidden._callmethod("add")


def test_objects_are_freed_when_their_last_proxy_goes_and_connect_reaches_a_running_manager():
    with roving.Manager() as m:
        lst = m.list([1])
        assert m._number_of_objects() == 1
        other = SyncManager(address=m.address)
        other.connect()
        d = other.dict(a=1)
        assert d["a"] == 1 and m._number_of_objects() == 2
        del lst, d
        gc.collect()
        deadline = time.monotonic() + TIMEOUT
        while m._number_of_objects() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert m._number_of_objects() == 0


def test_manager_bad_uses_raise_clear_errors():
    m = SyncManager()
    with pytest.raises(RuntimeError, match="not started"):
        m.list()
    with pytest.raises(ValueError, match="connect"):
        SyncManager(address=("127.0.0.1", 1)).start()
    with pytest.raises(ValueError):
        SyncManager.register("not an identifier", list)
    with pytest.raises(TypeError):
        SyncManager(authkey="text")
    with pytest.raises(ValueError):
        SyncManager().connect()
    m.start()
    m.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        m.list()


# -- asynchronous manager ------------------------------------------------------------------------------

def test_async_handles_are_collected_out_of_order_each_with_its_own_result():
    with MyAsyncManager() as m:
        counter = m.Counter(0)
        slow = counter.slow(1.0, "slow")
        fast = managers.asynchronous(counter.sync).slow(0.0, "fast")  # another proxy: runs beside it
        assert fast.result(TIMEOUT) == "fast"
        assert not slow.done()  # the slow one is still running: results did not come in call order
        handles = [counter.add(1) for _ in range(10)]
        assert sorted(h.result(TIMEOUT) for h in reversed(handles)) == list(range(1, 11))
        assert slow.result(TIMEOUT) == "slow"
        with pytest.raises(KeyError):
            counter.fail().result(TIMEOUT)
        with pytest.raises(TimeoutError):
            counter.slow(0.5, "late").result(0.1)
        q = m.Queue()
        got = q.get(timeout=TIMEOUT)  # would deadlock if every proxy's calls ran one after another
        managers.asynchronous(q.sync).put("item").result(TIMEOUT)
        assert got.result(TIMEOUT) == "item"
        assert counter.sync.value() == 10


def test_the_calls_of_one_async_proxy_run_in_the_order_they_were_made():
    """reset() then step()s: each call runs after the one before it has returned, every time, although
    the earlier calls take longer (run side by side, the later ones would finish first)."""
    with MyAsyncManager() as m:
        env = m.Env()
        for _ in range(20):
            reset = env.reset(0.01)
            steps = [env.step(i, (5 - i) * 0.002) for i in range(5)]
            assert reset.result(TIMEOUT) == "reset"
            assert [h.result(TIMEOUT) for h in steps] == [list(range(i + 1)) for i in range(5)]


def test_the_calls_of_two_async_proxies_run_concurrently_even_on_one_object():
    """Both halves of a two-party barrier pass only if the two proxies' waits run at the same time."""
    with MyAsyncManager() as m:
        barrier = m.Barrier(2)
        other = managers.asynchronous(barrier.sync)
        first, second = barrier.wait(TIMEOUT), other.wait(TIMEOUT)
        assert sorted([first.result(TIMEOUT), second.result(TIMEOUT)]) == [0, 1]
        held = m.Queue()
        got = held.get(timeout=TIMEOUT)  # blocks its own proxy's later calls only
        beside = managers.asynchronous(held.sync)
        assert [beside.qsize().result(TIMEOUT) for _ in range(3)] == [0, 0, 0] and not got.done()
        beside.put("item").result(TIMEOUT)
        assert got.result(TIMEOUT) == "item"


def test_asynchronous_wraps_an_ordinary_proxy_and_rejects_unexposed_names():
    with roving.Manager() as m:
        d = m.dict()
        ad = managers.asynchronous(d)
        handles = [ad.__setitem__(i, i * i) for i in range(5)]
        for h in handles[::-1]:
            assert h.result(TIMEOUT) is None
        assert ad.__getitem__(3).result(TIMEOUT) == 9 and d[4] == 16
        with pytest.raises(AttributeError):
            ad.not_a_method  # noqa: B018  (the read is what raises)
        with pytest.raises(TypeError):
            managers.asynchronous([1])


# -- a dead server -------------------------------------------------------------------------------------

def test_every_call_raises_promptly_when_the_server_died_here_and_in_another_process():
    m = roving.Manager()
    lst = m.list()
    event, out = roving.Event(), roving.Queue()
    p = start(call_after_event, lst, event, out)
    assert out.get(timeout=TIMEOUT) == "ready"
    lst.append(0)
    m._process.kill()
    m._process.join(TIMEOUT)
    event.set()
    t0 = time.monotonic()
    with pytest.raises(ServerGone, match="gone"):
        lst.append(1)
    assert time.monotonic() - t0 < 2  # this process saw its child end
    t0 = time.monotonic()
    with pytest.raises(ConnectionError):
        len(lst)
    assert time.monotonic() - t0 < 1
    kind, waited = out.get(timeout=TIMEOUT)
    finish(p)
    assert kind == "ServerGone" and waited < 15
    m.shutdown()


def _walk_while_changing(lst):
    """Iterate a list proxy while the shared list changes; what each step sees."""
    seen = []
    it = iter(lst)
    seen.append(next(it))
    lst[1] = "changed"
    lst.append("appended")
    seen.append(next(it))
    lst.pop(0)
    seen.extend(it)
    return seen


def test_iterating_a_list_proxy_walks_the_shared_list_as_multiprocessing_s_does():
    import multiprocessing

    with multiprocessing.get_context("spawn").Manager() as mp_manager:
        expected = _walk_while_changing(mp_manager.list([0, 1, 2, 3]))
    with roving.Manager() as m:
        got = _walk_while_changing(m.list([0, 1, 2, 3]))
        assert list(m.list(["a", "b"])) == ["a", "b"] and list(m.list()) == []
    assert expected == [0, "changed", 3, "appended"]
    assert got == expected


def fill_nested(shelf, key, n):
    """In a child: reach a dict proxy through the dict proxy that holds it, and change it there."""
    shelf[key]["from child"] = n


def test_a_dict_proxy_stored_in_a_dict_proxy_comes_back_as_a_proxy_of_the_same_dict():
    with roving.Manager() as m:
        fruit, tools = m.dict(apples=3), m.dict(saws=1)
        shelf = m.dict(fruit=fruit)  # given to the constructor
        shelf["tools"] = tools  # and stored by a call
        shelf["tools"]["hammers"] = 2
        shelf["fruit"]["apples"] += 1
        assert dict(tools.items()) == {"saws": 1, "hammers": 2} and fruit["apples"] == 4
        finish(start(fill_nested, shelf, "fruit", 7))
        assert fruit["from child"] == 7
        del fruit, tools  # the shelf's references keep both alive
        gc.collect()
        assert shelf["fruit"]["apples"] == 4 and shelf["tools"]["saws"] == 1
        tools = shelf["tools"]
        shelf.clear()  # now only this proxy holds the tools
        assert len(shelf) == 0 and tools["hammers"] == 2
        rows = m.list([tools, [1, 2]])
        assert rows[0]["saws"] == 1 and rows[1] == [1, 2] and isinstance(rows[1], list)
        cond = m.Condition(m.Lock())  # a lock given to a Condition is still the lock itself
        with cond:
            assert cond.wait(0.05) is False


def test_a_queue_proxy_stored_in_a_list_proxy_comes_back_as_a_proxy_of_the_same_queue():
    with roving.Manager() as m:
        q, lst = m.Queue(), m.list()
        lst.append(q)
        lst[0].put("through the list")
        assert q.get(timeout=TIMEOUT) == "through the list"
        q.put("direct")
        assert lst[0].get(timeout=TIMEOUT) == "direct"


@pytest.mark.parametrize("where", ["function", "global"])
def test_a_program_that_never_shuts_its_manager_down_exits_and_its_server_ends(where):
    from helpers_core import pid_running, run_script, wait_until, PROGRAMS

    result = run_script(PROGRAMS / "manager_never_shut_down.py", where, timeout=90)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "result 42" in lines, result.stdout
    server = int(next(line.split()[1] for line in lines if line.startswith("server ")))
    assert wait_until(lambda: not pid_running(server), TIMEOUT), f"the server (pid {server}) still runs"
