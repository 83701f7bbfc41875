"""roving.shared: large read-only data written once per machine, mapped by workers without a copy, and
removed when its last user lets go (also at session exit: no leaked /dev/shm segments)."""
from __future__ import annotations

import gc
import glob
import importlib
import os
import textwrap
import threading

import numpy as np
import pytest

import roving
from helpers_core import TIMEOUT, finish, run_script, start

_shared = importlib.import_module("roving.shared")  # the module; roving.shared is the function


def segments(token):
    return sorted(os.path.basename(p) for p in glob.glob(f"/dev/shm/rv-{token}*"))


def mapped_from(array) -> str:
    """The file that the memory of ``array`` is mapped from in this process ('' for anonymous memory)."""
    address = array.__array_interface__["data"][0]
    with open("/proc/self/maps") as f:
        for line in f:
            span, *rest = line.split()
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return rest[4] if len(rest) > 4 else ""
    return ""


# -- targets run in children -------------------------------------------------------------------

def read_shared(handle, out, barrier=None):
    arr = handle.get()
    if barrier is not None:
        barrier.wait(TIMEOUT)  # all hold it at once
    out.put((float(arr.sum()), arr.flags.writeable, mapped_from(arr), arr.shape, str(arr.dtype)))


def read_after_event(handle, got, go, out):
    arr = handle.get()
    got.set()
    go.wait(TIMEOUT)
    out.put(float(arr[-1]))


# -- tests ---------------------------------------------------------------------------------------

def test_workers_on_the_creators_machine_map_the_one_segment_read_only_without_a_copy():
    data = np.arange(1_000_000, dtype=np.float32)
    handle = roving.shared(data)
    token = handle._token
    out = roving.Queue()
    procs = [start(read_shared, handle, out) for _ in range(2)]
    results = [out.get(timeout=TIMEOUT) for _ in procs]
    finish(*procs)
    for total, writeable, source, shape, dtype in results:
        assert total == float(data.sum()) and shape == data.shape and dtype == "float32"
        assert writeable is False
        assert source == f"/dev/shm/rv-{token}"  # the child's array lies in the shared segment itself
    assert segments(token) == [f"rv-{token}"]
    assert _shared._server().fetches.get(token, 0) == 0  # nothing was sent over the transport
    mine = handle.get()
    assert mapped_from(mine) == f"/dev/shm/rv-{token}" and np.array_equal(mine, data)
    with pytest.raises(ValueError):
        mine[0] = 1.0
    del mine
    handle.release()
    gc.collect()
    assert segments(token) == []


def test_another_machine_fetches_once_and_its_processes_share_that_copy():
    data = np.linspace(0, 1, 300_000)
    handle = roving.shared(data)
    token = handle._token
    elsewhere = _shared.Shared(token, handle._owner, "another-machine", handle.nbytes)  # as seen remotely
    out = roving.Queue()
    barrier = roving.Barrier(3)
    procs = [start(read_shared, elsewhere, out, barrier) for _ in range(3)]
    results = [out.get(timeout=TIMEOUT) for _ in procs]
    finish(*procs)
    assert _shared._server().fetches[token] == 1  # one transfer for the three processes of that machine
    for total, writeable, source, _, _ in results:
        assert total == pytest.approx(float(data.sum())) and writeable is False
        assert source == f"/dev/shm/rv-{token}-copy"
    assert segments(token) == [f"rv-{token}"]  # the last user of the copy removed it
    handle.release()
    assert segments(token) == []


def test_segment_stays_while_a_user_holds_it_after_the_creator_let_go_and_goes_with_the_last():
    handle = roving.shared(np.full(50_000, 7.0))
    token = handle._token
    got, go, out = roving.Event(), roving.Event(), roving.Queue()
    p = start(read_after_event, handle, got, go, out)
    assert got.wait(TIMEOUT)
    handle.release()
    assert segments(token) == [f"rv-{token}"]  # the child still uses it
    go.set()
    assert out.get(timeout=TIMEOUT) == 7.0
    finish(p)
    assert segments(token) == []
    with pytest.raises(LookupError, match="let go"):
        _shared.Shared(token, handle._owner, handle._machine, handle.nbytes).get()


def test_any_picklable_object_is_shared_and_unpicklable_input_is_a_clear_error():
    obj = {"table": np.ones((300, 300)), "name": "noise", "n": 3}
    handle = roving.shared(obj)
    got = handle.get()
    assert got["name"] == "noise" and got["n"] == 3 and np.array_equal(got["table"], obj["table"])
    assert not got["table"].flags.writeable
    assert np.asarray(roving.shared(np.arange(3))).tolist() == [0, 1, 2]
    with pytest.raises(roving.SerializationError):
        roving.shared(threading.Lock())
    del got
    handle.release()


def test_no_segment_is_left_in_dev_shm_after_a_session_exits_without_releasing(tmp_path):
    script = tmp_path / "leave_it.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        import roving

        def use(handle, out):
            out.put(float(handle.get().sum()))

        if __name__ == "__main__":
            handle = roving.shared(np.ones(100_000, dtype=np.float32))
            out = roving.Queue()
            p = roving.Process(target=use, args=(handle, out))
            p.start()
            print(handle._token, out.get(timeout=30), flush=True)
            p.join(30)
            kept = handle.get()  # still held at exit
    """))
    result = run_script(script, timeout=120)
    assert result.returncode == 0, result.stderr
    token, total = result.stdout.split()
    assert float(total) == 100_000.0
    assert segments(token) == []
