"""What a pipeline node that runs code of its own can put on the wire, and what comes of it.

The writer in each test is a real child process started untrusted (``trusted=False``, as the roster
starts stage processes) that sends bytes of its choosing to an inbox of this process (``mail.Inbox``);
the inbox must never run its code, never take it for anyone else, and refuse what does not fit the
wire's schema, counting it against the writer.
"""
from __future__ import annotations

import json
import math
import os
import pickle
import queue
import struct

import pytest
import torch

import roving
from helpers_core import TIMEOUT
import helpers_untrusted as hu
from roving.pipeline.runtime import codec
from roving.pipeline.runtime import mail
from roving.pipeline import protocol as m
from roving.pipeline.planning.plan import Route
from roving.pipeline.verify.receipts import Receipt
from roving.pipeline.verify.screen import Summary
from roving.pipeline.verify.tensor_id import Screened, TensorId


class _Marker:
    """Unpickling it writes a file: the proof that someone unpickled it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _from_untrusted(letters: list, accept=None, name: str = "n1") -> tuple[list, dict]:
    """Have an untrusted child send ``letters``; what an inbox that knows it as ``name`` makes of them."""
    directory = mail.Directory()
    inbox = mail.Inbox(directory, accept)
    p = roving.Process(target=hu.send_letters, args=(inbox.address, letters), trusted=False, daemon=True)
    p.start()
    directory.add(p.node_id, name)
    p.join(TIMEOUT)
    assert p.exitcode == 0
    got = []
    while True:
        try:
            got.append(inbox.get(timeout=0))
        except queue.Empty:
            break
    return got, inbox.refused()


def _header(msg: m.Message) -> list:
    return json.loads(codec.encode(msg, json_only=True)[0])


def test_a_pickle_that_would_write_a_file_is_never_unpickled_and_its_writer_is_counted(tmp_path):
    marker = str(tmp_path / "marker")
    evil = pickle.dumps(_Marker(marker), protocol=5)
    got, refused = _from_untrusted([[evil], [b"\x80\x05" + evil[2:], *codec.encode(m.Done(0, "x", 1, 2.0))[1:]]])
    assert got == []
    assert refused["n1"][0] == 2 and "JSON" in refused["n1"][1]
    assert not os.path.exists(marker)


def test_the_sender_is_who_the_connection_proved_whatever_the_message_says():
    forged = _header(m.Done(0, "n2", 1, 2.0))
    forged.append("n2")  # a sender on the wire (one field more than Done has) is not the wire's
    got, refused = _from_untrusted([codec.encode(m.Done(0, "n2", 1, 2.0)), [json.dumps(forged).encode()]])
    assert [(type(g).__name__, g.sender) for g in got] == [("Done", "n1")]
    assert refused["n1"][0] == 1 and "field(s) where it has" in refused["n1"][1]


def test_coordinator_messages_from_a_node_are_refused_by_a_stage_process_inbox():
    route = Route("n1", (), ())
    sent = [m.Load(1, 2, {}, None), m.Recheck(0, 1, 1, "forward", {}, None), m.Stop(None), m.Step(0, 1.0, 0.1),
            m.Abort(3), m.Throttle(5.0), m.Peers({}, {}), m.EvidenceRequest(0, (), 1), m.Release(),
            m.Microbatch(0, 1, torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), route)]
    got, refused = _from_untrusted([codec.encode(x) for x in sent], accept=mail.coordinator_only)
    assert got == []
    assert refused["n1"][0] == len(sent)


@pytest.mark.parametrize("bad", [
    m.Norm(0, "n1", 1, -4.0), m.Norm(0, "n1", 1, -math.inf), m.Done(0, "n1", 1, -0.5),
    m.Done(0, "n1", -7, 1.0), m.Done(0, "n1", 1 << 50, 1.0), m.Done(0, "n1", True, 1.0),
    m.Rechecked(0, "n1", 3, -1.0), m.Stepped(0, "n1", {}, -2.0),
])
def test_numbers_out_of_their_bounds_are_refused(bad):
    got, refused = _from_untrusted([codec.encode(bad)])
    count, why = refused["n1"]
    assert got == [] and count == 1 and ("out of bounds" in why or "whole number" in why), why


def test_tensors_of_a_wrong_size_or_dtype_and_oversized_headers_are_refused():
    frames = codec.encode(m.Gradients(0, "n1", torch.ones(4), 1))
    short = [frames[0], bytes(frames[1])[:-4]]
    header = _header(m.Gradients(0, "n1", torch.ones(4), 1))
    header[3][1] = "object"  # [version, kind, round, flat, count, receipt]; flat is [buffer, dtype, shape]
    odd = [json.dumps(header).encode(), frames[1]]
    huge = _header(m.Gradients(0, "n1", torch.ones(4), 1))
    huge[3][2] = [1 << 40, 1 << 40]
    got, refused = _from_untrusted([short, odd, [json.dumps(huge).encode(), frames[1]],
                                    [b"[1," * 100_000 + b"]" * 100_000]])
    assert got == [] and refused["n1"][0] == 4


def test_a_receipt_of_another_node_is_refused_in_a_nodes_message():
    receipt = Receipt(TensorId(0, "activation", 1, 0, "n2"), b"d" * 32, b"m" * 32)
    msg = m.Forward(0, "n1", 1, 0, torch.ones(2, 3), Route("n0", ("n1",), (1,)), receipt)
    got, refused = _from_untrusted([codec.encode(msg)])
    assert got == [] and "receipt of 'n2'" in refused["n1"][1]


def test_a_writer_the_directory_does_not_know_is_refused():
    directory = mail.Directory()
    inbox = mail.Inbox(directory)
    p = roving.Process(target=hu.send_letters, args=(inbox.address, [codec.encode(m.Done(0, "x", 1, 1.0))]),
                       trusted=False, daemon=True)
    p.start()
    p.join(TIMEOUT)
    with pytest.raises(queue.Empty):
        inbox.get(timeout=0)
    assert list(inbox.refused()) == [p.node_id]


def _norm_of_three_rows() -> m.Norm:
    rows = (Screened(TensorId(1, "activation", 0, 0, "b"), Summary((), 1.0, 0.0, 0.5, torch.randn(4))),
            Screened(TensorId(1, "share", -1, -1, "c"), Summary(("zeros",))),
            Screened(TensorId(1, "gradient", 3, 1, "b"), Summary((), -1.0, 0.5, 0.25, torch.randn(3))))
    return m.Norm(1, "a", 0, 2.5, rows, (TensorId(1, "activation", 0, 0, "b"),), {"b": 0.25}, b"c" * 32)


def test_a_screening_report_whose_table_is_out_of_bounds_is_refused_naming_what():
    """A ``Norm``'s screening rows travel as one table (``codec._table``: 7 int64 columns, then 3 float64
    ones, column after column) and one float32 buffer of profiles: a whole number out of its bounds, an
    index beyond what it indexes (the kinds of tensor, the senders' names, the findings), lengths that do
    not add up to the profiles sent, a table whose row count is not its bytes', or a table that names
    another field's buffer is refused; so is a tensor identity of no kind of tensor elsewhere (an evidence
    request's)."""
    frames = codec.encode(_norm_of_three_rows())
    rows = 3
    # the table's columns: round, mb, hop, profile length, what, found, sender (int64), norm, mean, std
    column = {name: i for i, name in enumerate(("round", "mb", "hop", "length", "what", "found", "sender"))}

    def with_entry(row: int, name: str, value: int) -> list:
        table = bytearray(frames[1])
        struct.pack_into("<q", table, (column[name] * rows + row) * 8, value)
        return [frames[0], bytes(table), frames[2]]

    def with_screened(edit) -> list:
        header = json.loads(frames[0])
        edit(header[5])  # [version, kind, round, stage, sq_norm, screened, ...]: [names, [table, rows], profiles]
        return [json.dumps(header).encode(), *frames[1:]]

    wrong_kind = _header(m.EvidenceRequest(1, (TensorId(1, "activation", 0, 0, "b"),), 4))
    wrong_kind[3]["u"][0]["r"][2] = "weights"
    bounds = "not whole numbers within bounds"
    letters = {"a microbatch of 2 ** 40": (with_entry(0, "mb", 1 << 40), bounds),
               "a fifth kind of tensor": (with_entry(1, "what", 4), bounds),
               "a kind of tensor of -1": (with_entry(1, "what", -1), bounds),
               "a sender beyond the names": (with_entry(2, "sender", 2), bounds),
               "a finding beyond FOUND": (with_entry(0, "found", 9), bounds),
               "a profile longer than sent": (with_entry(0, "length", 5), "do not add up"),
               "a profile length of -2": (with_entry(0, "length", -2), bounds),
               "a round of -2": (with_entry(1, "round", -2), bounds),
               "a hop of the least int64": (with_entry(2, "hop", -(1 << 63)), bounds),
               "a table of 4 rows in 3 rows' bytes": (with_screened(lambda r: r[1].__setitem__(1, 4)),
                                                      "a screening table of 4 rows .* in 240 bytes"),
               "a table of 2 rows in 3 rows' bytes": (with_screened(lambda r: r[1].__setitem__(1, 2)),
                                                      "a screening table of 2 rows"),
               "a table of -1 rows": (with_screened(lambda r: r[1].__setitem__(1, -1)), "a screening table of -1"),
               "a row count that is not a number": (with_screened(lambda r: r[1].__setitem__(1, "3")),
                                                    "a screening table of 3 rows"),
               "a table in the profiles' buffer": (with_screened(lambda r: r[1].__setitem__(0, 1)),
                                                   "a screening table of 3 rows .* in 28 bytes"),
               "a table and profiles in one buffer": (with_screened(lambda r: r[2].__setitem__(0, 0)),
                                                      "names no buffer of its own"),
               "a table of no buffer": (with_screened(lambda r: r[1].__setitem__(0, 7)), "names no buffer"),
               "a sender's name that is a number": (with_screened(lambda r: r[0].__setitem__(0, 3)), "not a string"),
               "a report of two parts": (with_screened(lambda r: r.pop()), "not a screening report"),
               "profiles of float64": (with_screened(lambda r: r[2].__setitem__(1, "float64")), "dtype 'float64'"),
               "a tensor of no kind": ([json.dumps(wrong_kind).encode()], "not what a tensor can be")}
    assert len(frames[1]) == rows * 10 * 8
    for why, (letter, says) in letters.items():
        with pytest.raises(codec.Malformed, match=says):
            codec.decode(letter, "a")
            pytest.fail(f"{why}: read")
    got, refused = _from_untrusted([letter for letter, _ in letters.values()])
    assert got == [] and refused["n1"][0] == len(letters), refused


def test_a_screening_report_of_no_rows_reads_back_as_none_and_profiles_without_rows_are_refused():
    """A ``Norm`` with no screening rows reads back with none; one whose (empty) table comes with profiles
    is refused."""
    frames = codec.encode(m.Norm(1, "a", 0, 2.5))
    assert tuple(codec.decode(frames, "a").screened) == ()
    profiles = bytearray(torch.ones(3).numpy().tobytes())
    header = json.loads(frames[0])
    header[5][2][2] = [3]
    with pytest.raises(codec.Malformed, match="profiles sent with no screening row"):
        codec.decode([json.dumps(header).encode(), frames[1], profiles], "a")


def test_a_norms_disputes_cosines_and_digest_of_other_shapes_read_back_as_sent_for_the_coordinator_to_judge():
    """A ``Norm``'s disputes, cosines and combined digest travel in short forms where they have the shape
    a stage process gives them (``TensorId`` records; names to floats; bytes), and in the tagged form
    otherwise: what was sent is what is read, for the coordinator's checks (``reports.well_formed``) to
    judge."""
    odd = [m.Norm(1, "a", 0, 2.5, (), ("activation", 0, 1, "b"), {"b": 1, 3: 0.5}, "not bytes"),
           m.Norm(1, "a", 0, 2.5, (), (TensorId(1, "activation", 0, 0, "b"), 4), [("b", 0.5)], b"c" * 32),
           m.Norm(1, "a", 0, 2.5, (), (), {}, None),
           _norm_of_three_rows()]
    for msg in odd:
        back = codec.decode(codec.encode(msg), "a")
        for name in ("disputes", "cosines", "combined"):
            assert repr(getattr(back, name)) == repr(getattr(msg, name)), name


def test_a_norms_short_forms_that_do_not_fit_are_refused_naming_what():
    """The short forms of a ``Norm``'s disputes (a list of ``TensorId`` records), cosines (``{"c": [names,
    numbers]}``) and digest (base64) are checked as what they stand for: a record of no kind of tensor,
    names and numbers of different lengths, a name that is no string, a number that is not a float,
    bytes that are not base64, a digest that is no one value: each refused, naming what."""
    frames = codec.encode(_norm_of_three_rows())

    def with_field(index: int, value) -> list:
        header = json.loads(frames[0])
        header[index] = value  # [version, kind, round, stage, sq_norm, screened, disputes, cosines, combined]
        return [json.dumps(header).encode(), *frames[1:]]

    letters = {"a dispute of no kind of tensor": (with_field(6, [[1, "weights", 0, 0, "b"]]), "not what a tensor"),
               "a dispute of four fields": (with_field(6, [[1, "activation", 0, 0]]), "TensorId: 4 field"),
               "disputes as a list in the tagged form": (with_field(6, {"m": []}), "not a tuple"),
               "more names than cosines": (with_field(7, {"c": [["b", "c"], [0.5]]}), "of one length"),
               "a name that is a number": (with_field(7, {"c": [[3], [0.5]]}), "names .strings. and numbers"),
               "a cosine that is a string": (with_field(7, {"c": [["b"], ["high"]]}), "names .strings. and numbers"),
               "a cosine that is a whole number": (with_field(7, {"c": [["b"], [1]]}), "names .strings. and numbers"),
               "cosines with another key beside": (with_field(7, {"c": [[], []], "m": []}), "of one length"),
               "a digest that is not base64": (with_field(8, "!!"), "not base64"),
               "a digest of two values": (with_field(8, [1, 2]), "a digest that is not bytes")}
    for why, (letter, says) in letters.items():
        with pytest.raises(codec.Malformed, match=says):
            codec.decode(letter, "a")
            pytest.fail(f"{why}: read")


def test_every_message_of_the_protocol_reads_back_as_it_was_sent():
    route = Route("a", ("b",), (1,))
    receipt = Receipt(TensorId(1, "activation", 0, 0, "a"), b"d" * 32, b"m" * 32)
    samples = [
        m.Forward(1, "a", 0, 0, torch.randn(2, 3, 4, dtype=torch.bfloat16), route, receipt),
        _norm_of_three_rows(),
        m.EvidenceRequest(1, (TensorId(1, "activation", 0, 0, "b"), TensorId.combined(1)), 4),
        m.Stepped(1, "a", {"processed": 2, "trace": [("fwd", 0, 1.0, 2.0)]}, math.nan, b"w" * 32, "cpu"),
        m.EvidenceItems(1, "a", {TensorId(1, "activation", 0, 0, "b"): (torch.ones(2), receipt, False)}, 3),
        m.Exported("a", 0, {"w": torch.ones(2, 2)},
                   {"state": {0: {"step": torch.tensor(3.0)}},
                    "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0]}]}),
    ]
    for msg in samples:
        back = codec.decode(codec.encode(msg), "a")
        assert type(back) is type(msg)
        for name in msg.__dataclass_fields__:
            a, b = getattr(msg, name), getattr(back, name)
            assert repr(a) == repr(b) if not isinstance(a, torch.Tensor) else torch.equal(a, b), name
