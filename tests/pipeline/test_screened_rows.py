"""A ``Norm``'s screening rows as the wire reads them (``rows.ScreenedRows``): a sequence of the rows the
node sent, made when asked for."""
from __future__ import annotations

import pytest
import torch

from roving.pipeline import protocol as m
from roving.pipeline.runtime import codec
from roving.pipeline.verify.rows import ScreenedRows
from roving.pipeline.verify.screen import Summary
from roving.pipeline.verify.tensor_id import Screened, TensorId


def _sent() -> tuple[Screened, ...]:
    return (Screened(TensorId(2, "activation", 0, 1, "b"), Summary((), 1.0, 0.5, -0.25, torch.arange(4.0))),
            Screened(TensorId(2, "share", -1, -1, "c"), Summary(("unchanged",))),
            Screened(TensorId(2, "gradient", 3, 2, "d"), Summary((), 2.0, 0.0, 0.125, torch.empty(0))),
            Screened(TensorId(2, "activation", 1, 1, "b"), Summary((), -1.0, 0.25, 0.5, torch.tensor([7.0, 8.0]))))


def _read(rows: tuple[Screened, ...]) -> ScreenedRows:
    screened = codec.decode(codec.encode(m.Norm(2, "a", 0, 1.0, rows)), "a").screened
    assert type(screened) is ScreenedRows
    return screened


def _same(a: Screened, b: Screened) -> bool:
    pa, pb = a.summary.profile, b.summary.profile
    return (a.tensor == b.tensor and a.summary.found == b.summary.found
            and (a.summary.norm, a.summary.mean, a.summary.std) == (b.summary.norm, b.summary.mean, b.summary.std)
            and (pa is None and pb is None or pa is not None and pb is not None and torch.equal(pa, pb)))


def test_rows_read_off_the_wire_index_iterate_and_print_as_the_tuple_sent():
    sent = _sent()
    rows = _read(sent)
    assert len(rows) == len(sent) and repr(rows) == repr(sent)
    assert all(_same(a, b) for a, b in zip(rows, sent, strict=True))
    assert all(_same(rows[i], sent[i]) for i in range(-len(sent), len(sent)))
    assert all(_same(a, b) for a, b in zip(rows[1:3], sent[1:3], strict=True)) and type(rows[1:3]) is tuple
    assert all(type(r) is Screened and type(r.tensor) is TensorId and type(r.summary) is Summary for r in rows)
    with pytest.raises(IndexError, match="row 4 of 4"):
        rows[4]
    with pytest.raises(IndexError):
        rows[-5]


def test_each_row_read_is_a_new_one_whose_profile_is_a_view_of_the_profiles_received():
    rows = _read(_sent())
    first, again = rows[0], rows[0]
    assert first is not again and first.summary.profile.data_ptr() == rows.profiles.data_ptr()
    assert rows[3].summary.profile.tolist() == [7.0, 8.0] and rows[2].summary.profile.shape == (0,)
    assert rows[1].summary.profile is None


def test_rows_read_off_the_wire_equal_the_tuple_sent_without_profiles_and_are_not_hashable():
    sent = tuple(Screened(TensorId(2, "share", -1, -1, n), Summary(("zeros",))) for n in "bcd")
    rows = _read(sent)
    assert rows == sent and rows == _read(sent) and rows != sent[:2] and rows != list(sent)
    with pytest.raises(TypeError):
        hash(rows)


def test_a_table_knows_whether_every_row_is_of_one_round():
    rows = _read(_sent())
    assert rows.of_round(2) and not rows.of_round(3)
