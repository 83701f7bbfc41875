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
    # as seen remotely
    elsewhere = _shared.Shared(token, handle._owner, "another-machine", handle.nbytes, handle._check)
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
        _shared.Shared(token, handle._owner, handle._machine, handle.nbytes, handle._check).get()


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


# -- files planted by someone else are never unpickled ----------------------------------------

class Payload:
    """Unpickling this creates ``marker``: a stand-in for code an attacker would run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant(path, check, marker, uid=None, mode=0o600):
    """Write at ``path`` a file laid out as a ready segment whose one frame is a Payload pickle."""
    frames = _shared.dumps(Payload(marker))
    size, spans = _shared._layout(frames)
    data = bytearray(size)
    _shared._write_header(data, _shared._READY, spans, check)
    for (offset, n), frame in zip(spans, frames):
        data[offset:offset + n] = memoryview(frame).cast("B")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, bytes(data))
        os.fchmod(fd, mode)
        if uid is not None:
            os.fchown(fd, uid, -1)
    finally:
        os.close(fd)


def released_handle():
    """A handle whose data every user let go of: its name in /dev/shm is free for anyone."""
    handle = roving.shared(np.arange(10))
    copy = _shared.Shared(handle._token, handle._owner, handle._machine, handle.nbytes, handle._check)
    handle.release()
    assert segments(handle._token) == []
    return copy


NOBODY = 65534


@pytest.mark.parametrize("how", ["another user's", "group-writable", "wrong check value", "symlink"])
def test_a_file_planted_under_a_released_name_is_a_lookup_error_and_runs_nothing(tmp_path, how):
    handle = released_handle()
    path = f"/dev/shm/rv-{handle._token}"
    marker = tmp_path / "payload-ran"
    try:
        if how == "another user's":
            plant(path, handle._check, marker, uid=NOBODY)
        elif how == "group-writable":
            plant(path, handle._check, marker, mode=0o620)
        elif how == "wrong check value":
            plant(path, os.urandom(len(handle._check)), marker)
        else:
            target = f"/dev/shm/rv-target-{handle._token}"
            plant(target, handle._check, marker)
            os.symlink(target, path)
        with pytest.raises(LookupError, match=handle._token):
            handle.get(timeout=5)
        assert not marker.exists()
    finally:
        for p in glob.glob(f"/dev/shm/rv-*{handle._token}*"):
            os.unlink(p)


def test_a_file_planted_under_a_name_not_yet_created_is_a_lookup_error_and_runs_nothing(tmp_path):
    handle = roving.shared(np.arange(10))
    elsewhere = _shared.Shared(handle._token, handle._owner, "another-machine", handle.nbytes, handle._check)
    path = f"/dev/shm/rv-{handle._token}-copy"  # where that machine's copy would go
    marker = tmp_path / "payload-ran"
    plant(path, handle._check, marker, uid=NOBODY)
    try:
        with pytest.raises(LookupError, match="belongs to uid"):
            elsewhere.get(timeout=5)
        assert not marker.exists()
        assert _shared._server().fetches.get(handle._token, 0) == 0
    finally:
        os.unlink(path)
        handle.release()


def test_the_planted_file_would_run_if_it_passed_the_checks(tmp_path):
    # The control for the tests above: the same file, ours, private and with the handle's check value,
    # is read (so what stops them is each check, not a malformed file).
    handle = released_handle()
    path = f"/dev/shm/rv-{handle._token}"
    marker = tmp_path / "payload-ran"
    plant(path, handle._check, marker)
    try:
        handle.get(timeout=5)
        assert marker.exists()
    finally:
        handle.release()
        gc.collect()
        if os.path.exists(path):
            os.unlink(path)


def test_segments_are_created_private_to_this_user():
    handle = roving.shared(np.arange(10))
    st = os.stat(f"/dev/shm/rv-{handle._token}")
    assert st.st_uid == os.getuid() and st.st_mode & 0o777 == 0o600
    handle.release()
