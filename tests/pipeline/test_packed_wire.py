"""The packed layout of the pipeline's wire (``runtime/packed.py``): the small messages as one struct, read
back with every check of the JSON form, and what does not fit refused, naming what."""
from __future__ import annotations

import math
import struct

import pytest

from roving.pipeline import protocol as m
from roving.pipeline.runtime import codec
from roving.pipeline.runtime.packed import MARK, MAX_ITEMS, MAX_STATS

_TRACE = [("fwd", 0, 1.5, 2.5), ("bwd", 0, 2.5, 3.0), ("mb", 1, 3.0, 3.25)]


def _packed_samples() -> list[m.Message]:
    return [m.Done(3, "a", 2, 0.5), m.Beat("a", 4), m.Rechecked(3, "a", 7, math.inf), m.Loaded("a", 2),
            m.Progress(3, "a", (0, 1, 2, 1, 4, 0), ()), m.Failed("a", "Traceback ü\n  boom"), m.Stopped("a"),
            m.Released("a"), m.Step(3, 0.5, 1e-3), m.Abort(3), m.ProgressRequest(3), m.Export(), m.Release(),
            m.Throttle(2.0), m.ShowWeights(3),
            m.Stepped(3, "a", {"processed": 3, "compute_s": 0.25, "peak_in_flight": 2, "verify_cpu_s": 0.5,
                               "trace": _TRACE}, 1.25, b"w" * 32, "cpu"),
            m.Stepped(3, "a", {}, math.nan, None, ""), m.Stepped(3, "a", {"trace": []}, 0.0, b"", "cuda:0")]


def _same(a: m.Message, b: m.Message) -> bool:
    return type(a) is type(b) and repr(a) == repr(b)


def test_every_small_message_is_written_packed_and_reads_back_as_it_was_sent():
    for msg in _packed_samples():
        frames = codec.encode(msg)
        assert len(frames) == 1 and frames[0][0] == MARK, msg
        back = codec.decode(frames, getattr(msg, "sender", None) and "a")
        assert _same(back, msg), (back, msg)


def test_a_stepped_keeps_its_statistics_in_their_order_its_trace_last_as_tuples():
    stats = {"compute_s": 0.25, "processed": 3, "trace": _TRACE, "peak_in_flight": 2}
    back = codec.decode(codec.encode(m.Stepped(3, "a", stats, 1.0, None, "cpu")), "a")
    assert list(back.stats) == ["compute_s", "processed", "peak_in_flight", "trace"]
    assert back.stats["trace"] == _TRACE and all(type(t) is tuple for t in back.stats["trace"])
    assert type(back.stats["processed"]) is int and type(back.stats["compute_s"]) is float


@pytest.mark.parametrize("msg", [
    m.Stepped(3, "a", {"note": "text"}, 1.0, None, "cpu"),          # a statistic that is not a number
    m.Stepped(3, "a", {"a\0b": 1}, 1.0, None, "cpu"),               # a name with a NUL
    m.Stepped(3, "a", {"trace": [("fwd", 0.5, 1.0, 2.0)]}, 1.0, None, "cpu"),  # a microbatch not whole
    m.Stepped(3, "a", {"trace": [("fwd", 0, 1.0)]}, 1.0, None, "cpu"),         # a row of three
    m.Stepped(3, "a", {"n": 1 << 70}, 1.0, None, "cpu"),            # beyond int64
    m.Stepped(3, "a", {}, 1.0, "digest", "cpu"),                     # a digest that is not bytes
    m.Done(3, "a", True, 0.5), m.Done(3, "a", 1 << 70, 0.5), m.Progress(3, "a", (1, "x"), ()),
])
def test_a_message_of_a_shape_the_packed_layout_does_not_carry_goes_as_json_and_is_judged_as_before(msg):
    frames = codec.encode(msg)
    assert bytes(frames[0][:1]) == b"["
    json_only = codec.encode(msg, json_only=True)
    assert frames == json_only
    try:
        back = codec.decode(frames, "a")
    except codec.Malformed:
        return  # refused as the JSON form always refused it
    assert _same(back, msg)


def _header(msg: m.Message) -> bytes:
    return bytes(codec.encode(msg)[0])


def _done(rnd: int, mb: int, loss: float) -> bytes:
    tag = _header(m.Done(0, "a", 0, 0.0))[1]
    return struct.pack("<BBqqd", MARK, tag, rnd, mb, loss)


@pytest.mark.parametrize("frames, says", [
    ([_done(1, -2, 0.5)], "Done.mb: -2 is not a whole number"),
    ([_done(1 << 45, 0, 0.5)], "Done.round: .* is not a whole number"),
    ([_done(1, 0, -0.5)], "Done.loss: -0.5 is out of bounds"),
    ([_done(1, 0, 0.5)[:-1]], "Done: a packed header of 25 bytes"),
    ([_done(1, 0, 0.5) + b"\0"], "Done: a packed header of 27 bytes"),
    ([_done(1, 0, 0.5), b"extra"], "Done: 1 buffer"),
    ([bytes((MARK, 250)) + b"\0" * 24], "no kind this wire knows .tag 250"),
    ([struct.pack("<BBI", MARK, _header(m.Failed("a", ""))[1], 2) + b"\xff\xfe"], "Failed.traceback: .*not UTF-8"),
    ([struct.pack("<BBI", MARK, _header(m.Failed("a", ""))[1], 9) + b"short"], "Failed.traceback: 9 bytes where 5"),
    ([struct.pack("<BBI", MARK, _header(m.Failed("a", ""))[1], 5000) + b"x" * 5000], "more than 4096 characters"),
    ([struct.pack("<BBqII", MARK, _header(m.Progress(0, "a"))[1], 1, 1, 0) + struct.pack("<q", -5)],
     "Progress.received: a number out of bounds"),
    ([struct.pack("<BBqII", MARK, _header(m.Progress(0, "a"))[1], 1, 2, 0) + struct.pack("<q", 1)],
     "Progress.received: 16 bytes where 8"),
])
def test_a_packed_header_that_does_not_fit_its_message_is_refused_naming_what(frames, says):
    with pytest.raises(codec.Malformed, match=says):
        codec.decode(frames, "a")


def test_a_packed_message_with_a_sender_read_without_one_is_refused():
    with pytest.raises(codec.Malformed, match="needs a sender"):
        codec.decode([_done(1, 0, 0.5)], None)


def _stepped(rnd: int = 1, norm: float = 1.0, weights: int = 0xFFFFFFFF, rows: int = 0, text: bytes = b"\0cpu",
             body: bytes = b"", numbers: bytes = b"") -> list[bytes]:
    tag = _header(m.Stepped(0, "a", {}, 1.0, None, ""))[1]
    return [struct.pack("<BBqdIII", MARK, tag, rnd, norm, weights, rows, len(text)) + body + text + numbers]


@pytest.mark.parametrize("frames, says", [
    (_stepped(norm=-1.0), "Stepped.grad_norm: -1.0 is out of bounds"),
    (_stepped(rnd=-3), "Stepped.round: -3 is not a whole number"),
    (_stepped(text=b"qx\0cpu\0a\0b", numbers=bytes(16)), "numbers of kinds 'qx'"),
    (_stepped(text=b"q\0cpu\0a\0b"), "4 names for 1 statistics"),
    (_stepped(text=b"q\0cpu\0a"), "that its parts do not fit"),  # the number's 8 bytes missing
    (_stepped(rows=3, text=b"\0cpu\0fwd"), "3 names for 0 statistics and 2 trace rows"),
    (_stepped(weights=64), "a text of 4 bytes where 0 are left"),
    (_stepped(text=b"\0\xff\xfe"), "not UTF-8"),
    (_stepped(text=b"\0" + b"c" * 5000), "a platform's name of at most 4096"),
])
def test_a_packed_stepped_that_does_not_fit_is_refused_naming_what(frames, says):
    with pytest.raises(codec.Malformed, match=says):
        codec.decode(frames, "a")


def test_a_packed_stepped_whose_trace_fits_reads_back_as_its_rows():
    back = codec.decode(_stepped(rows=2, text=b"q\0cpu\0n\0fwd", numbers=struct.pack("<qddq", 4, 1.0, 2.0, 9)), "a")
    assert back.stats == {"n": 9, "trace": [("fwd", 4, 1.0, 2.0)]} and back.platform == "cpu"


def test_a_tuple_longer_than_the_packed_layout_carries_goes_as_json_and_reads_back_as_sent():
    msg = m.Progress(3, "a", tuple(range(MAX_ITEMS + 1)), ())
    frames = codec.encode(msg)
    assert bytes(frames[0][:1]) == b"["
    assert _same(codec.decode(frames, "a"), msg)


def test_a_packed_header_that_claims_more_numbers_than_the_layout_carries_is_refused_before_any_struct():
    tag = _header(m.Progress(0, "a"))[1]
    many = MAX_ITEMS + 1
    frames = [struct.pack("<BBqII", MARK, tag, 1, many, 0) + bytes(8 * many)]
    with pytest.raises(codec.Malformed, match=f"Progress.received: {many} whole numbers packed"):
        codec.decode(frames, "a")
    with pytest.raises(codec.Malformed, match="statistics and .* trace rows packed"):
        codec.decode(_stepped(rows=MAX_ITEMS + 2, text=b"\0cpu" + b"\0fwd" * (MAX_ITEMS + 1),
                              body=b""), "a")
    with pytest.raises(codec.Malformed, match=f"{MAX_STATS + 1} statistics"):
        codec.decode(_stepped(text=b"q" * (MAX_STATS + 1) + b"\0cpu" + b"\0n" * (MAX_STATS + 1)), "a")
