"""roving.transport.serialize: large buffers travel as frames of their own; code from __main__ by value."""
from __future__ import annotations

import pickle
import textwrap
import threading

import numpy as np
import pytest

from helpers_core import run_script
from roving.transport.serialize import OOB_THRESHOLD, SerializationError, dumps, loads

BIG = 1 << 20  # well above OOB_THRESHOLD


def roundtrip(obj):
    frames = dumps(obj)
    # rebuild from copies, not from the sender's memory (received frames are writable, as zmq's are)
    return frames, loads([bytes(frames[0]), *(bytearray(f) for f in frames[1:])])


def test_large_numpy_array_travels_out_of_band_in_one_extra_frame():
    array = np.arange(BIG // 8, dtype=np.float64).reshape(256, -1)
    frames, back = roundtrip(array)
    assert len(frames) == 2
    assert len(memoryview(frames[0])) < 1024  # the data is not in the pickle stream
    assert memoryview(frames[1]).nbytes == array.nbytes
    assert back.dtype == array.dtype and back.shape == array.shape and np.array_equal(back, array)


def test_small_numpy_array_stays_in_band():
    array = np.arange(10, dtype=np.int32)
    frames, back = roundtrip(array)
    assert len(frames) == 1
    assert np.array_equal(back, array)


def test_several_arrays_in_one_message_give_one_frame_each():
    arrays = {"a": np.ones(BIG, dtype=np.uint8), "b": np.zeros((512, 512), dtype=np.float32),
              "small": np.arange(3)}
    frames, back = roundtrip(arrays)
    assert len(frames) == 3
    for key, value in arrays.items():
        assert np.array_equal(back[key], value)


def test_non_contiguous_and_fortran_order_arrays_round_trip():
    base = np.arange(BIG // 4, dtype=np.int32).reshape(512, -1)
    for array in (base[:, ::2], base.T, np.asfortranarray(base)):
        _, back = roundtrip(array)
        assert np.array_equal(back, array)


def test_out_of_band_array_is_rebuilt_over_the_received_frame_without_copy():
    array = np.arange(BIG // 8, dtype=np.int64)
    frames = dumps(array)
    received = [bytes(frames[0]), bytearray(frames[1])]
    back = loads(received)
    assert np.shares_memory(back, np.frombuffer(received[1], dtype=np.uint8))


def test_large_bytearray_and_bytes_travel_out_of_band_and_keep_their_type():
    for data in (bytearray(b"x" * BIG), b"y" * BIG):
        frames, back = roundtrip(data)
        assert len(frames) == 2
        assert type(back) is type(data) and back == data


def test_bytes_just_below_and_at_the_threshold():
    below, at = b"b" * (OOB_THRESHOLD - 1), b"a" * OOB_THRESHOLD
    assert len(dumps(below)) == 1
    assert len(dumps(at)) == 2
    assert roundtrip(below)[1] == below and roundtrip(at)[1] == at


def test_large_bytes_nested_in_a_container_round_trip():
    obj = {"payload": b"z" * BIG, "list": [bytearray(b"q" * BIG)]}
    _, back = roundtrip(obj)
    assert back == obj


def test_memoryview_travels_out_of_band_and_keeps_format_and_shape():
    array = np.arange(BIG // 8, dtype=np.float64).reshape(128, -1)
    view = memoryview(array)
    frames, back = roundtrip(view)
    assert len(frames) == 2
    assert isinstance(back, memoryview)
    assert back.format == view.format and back.shape == view.shape
    assert back.tobytes() == view.tobytes()


def test_non_contiguous_memoryview_round_trips():
    data = bytearray(range(256)) * (BIG // 256)
    view = memoryview(data)[::2]
    _, back = roundtrip(view)
    assert back.tobytes() == view.tobytes()


def test_lambdas_and_local_functions_and_classes_travel_by_value():
    def local_function(x):
        return x * 3

    class LocalClass:
        def __init__(self, v):
            self.v = v

    for fn in (lambda x: x + 1, local_function):
        with pytest.raises((pickle.PicklingError, AttributeError)):
            pickle.dumps(fn)  # the standard pickler cannot send these at all
    _, back = roundtrip((lambda x: x + 1, local_function, LocalClass(5), LocalClass))
    assert back[0](1) == 2 and back[1](2) == 6
    assert back[2].v == 5 and back[3](7).v == 7


def test_main_module_function_and_class_load_in_a_fresh_interpreter_without_main(tmp_path):
    sender = tmp_path / "sender.py"
    sender.write_text(textwrap.dedent("""
        import sys
        from roving.transport.serialize import dumps

        SCALE = 10

        def scaled(x):
            return x * SCALE

        class Point:
            def __init__(self, x):
                self.x = x
            def norm(self):
                return abs(self.x)

        if __name__ == "__main__":
            frames = dumps((scaled, Point(-4)))
            with open(sys.argv[1], "wb") as f:
                for frame in frames:
                    data = bytes(frame)
                    f.write(len(data).to_bytes(8, "little") + data)
    """))
    receiver = tmp_path / "receiver.py"
    receiver.write_text(textwrap.dedent("""
        import sys
        from roving.transport.serialize import loads

        frames, data = [], open(sys.argv[1], "rb").read()
        while data:
            n = int.from_bytes(data[:8], "little")
            frames.append(data[8:8 + n])
            data = data[8 + n:]
        fn, point = loads(frames)
        print(fn(4), point.norm())
    """))
    blob = tmp_path / "frames.bin"
    sent = run_script(sender, blob, cwd=tmp_path)
    assert sent.returncode == 0, sent.stderr
    got = run_script(receiver, blob, cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["40", "4"]


def test_module_level_functions_travel_by_reference():
    import helpers_targets

    frames = dumps(helpers_targets.put_value)
    assert len(memoryview(frames[0])) < 200  # a reference (module and name), not code
    assert loads(frames) is helpers_targets.put_value


def test_unpicklable_object_raises_serialization_error_naming_it():
    with pytest.raises(SerializationError) as info:
        dumps({"lock": threading.Lock()})
    assert isinstance(info.value, TypeError)
    assert "lock" in str(info.value).lower() and "dict" in str(info.value)


def test_frames_left_in_reference_cycles_are_freed_by_the_garbage_collector_without_a_crash(tmp_path):
    # CPython 3.12.0/3.12.1 (gh-111049) crashed freeing a cycle that held a memoryview of BytesIO.getbuffer(),
    # later versions report an ignored BufferError from the BytesIO; the collection runs in a fresh
    # interpreter, so that a crash fails this test and not the whole run
    script = tmp_path / "cycles.py"
    script.write_text(textwrap.dedent("""
        import gc
        from roving.transport.serialize import dumps, loads

        for i in range(2000):
            frames = dumps({"i": i, "pad": b"x" * 100})
            assert loads(frames)["i"] == i
            cycle = [frames[0]]
            cycle.append(cycle)
            del frames, cycle
            if i % 100 == 0:
                gc.collect()
        print("collected", gc.collect() >= 0)
    """))
    out = run_script(script)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "collected True"
    assert "Exception ignored" not in out.stderr and "BufferError" not in out.stderr, out.stderr[-2000:]
