"""A ``Norm``'s screening rows as the wire brings them (``runtime.codec``): one table of columns, each row
made a ``tensor_id.Screened`` only when it is asked for.

A node's report holds a row per tensor it received (a ``TensorId`` and its ``screen.Summary``); read
into three objects a row, a report of 8 rows cost the reader more than all its checks. The table keeps
the columns as they came (numbers, indices into ``WHATS``, ``FOUND`` and the senders' names, one buffer
of profiles) and is a sequence of ``Screened`` like the tuple a node sends: its rows compare, print and
iterate as those of that tuple would. What a whole report is asked (every row of one round, every
summary sound) it answers from the columns (``of_round``, ``sound``), without making a row.

This module owns the table's layout on the wire (``pack``, ``unpack``, ``COLUMNS``); the codec carries it.
"""

from __future__ import annotations

import functools
import itertools
import math
import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple, overload

import numpy
import torch

from ..errors import Malformed
from .screen import FOUND, Summary, make_summary, sound
from .tensor_id import WHATS, Screened, TensorId, screened

#: a row's finding by its code in the table: 0 nothing, else 1 + its index in ``FOUND``.
FOUNDS: tuple[tuple[str, ...], ...] = ((), *((f,) for f in FOUND))
_WHAT_CODE = {what: i for i, what in enumerate(WHATS)}
_FOUND_CODE: dict[tuple, int] = {found: i for i, found in enumerate(FOUNDS)}
#: the table of n rows on the wire: its 10 columns of n entries, one after another, 8 bytes an entry
#: (little-endian): 7 of whole numbers (int64: round, microbatch, hop, the profile's length (-1: none);
#: what (its index in WHATS), found (its index in FOUNDS), sender (its index in the names sent)), then
#: the 3 statistics (float64: norm, mean, std)
COLUMNS = 10


@functools.lru_cache(maxsize=64)
def _layout(rows: int) -> struct.Struct:
    return struct.Struct(f"<{7 * rows}q{3 * rows}d")


def table_size(rows: int) -> int:
    """The bytes of the table of ``rows`` rows."""
    return rows * COLUMNS * 8


class Packed(NamedTuple):
    """Screening rows as they travel (``pack``): the senders' ``names``, the number of ``rows``, their
    ``table`` and their ``profiles`` (the bytes of every profile's values as float32, in order)."""

    names: list[str]
    rows: int
    table: bytes
    profiles: Any


def pack(rows: Iterable[Screened]) -> Packed:
    """``rows`` as they travel. TypeError for a row that is not a ``Screened`` of a ``TensorId`` and a
    ``Summary``, or of a kind of tensor or a finding that a stage process does not make."""
    names: dict[str, int] = {}
    table: list[tuple] = []
    profiles: list[torch.Tensor] = []
    for row in rows:
        if type(row) is not Screened or type(row.tensor) is not TensorId or type(row.summary) is not Summary:
            raise TypeError(f"a screening row is a Screened of a TensorId and a Summary, not {row!r:.80}")
        t, s = row.tensor, row.summary
        found, what = _FOUND_CODE.get(s.found), _WHAT_CODE.get(t.what)
        if found is None or what is None:
            raise TypeError(f"a screening row of {t.what!r} that found {s.found!r}: not one a stage process makes")
        n = -1
        if isinstance(s.profile, torch.Tensor):
            profiles.append(s.profile)
            n = s.profile.numel()
        table.append((t.round, t.mb, t.hop, n, what, found, names.setdefault(t.sender, len(names)),
                      s.norm, s.mean, s.std))
    columns = itertools.chain.from_iterable(zip(*table))
    return Packed(list(names), len(table), _layout(len(table)).pack(*columns), _joined(profiles))


def _joined(profiles: list[torch.Tensor]) -> Any:
    """The bytes of ``profiles``' values as float32, one after another (one copy, where they are float32
    1-D tensors on the CPU, as summaries' profiles are)."""
    if not profiles:
        return b""
    try:
        joined = torch.cat(profiles)
    except (RuntimeError, TypeError):  # profiles of other shapes (cat needs 1-D ones) or on other devices
        joined = torch.cat([p.detach().to("cpu", torch.float32).reshape(-1) for p in profiles])
    if joined.dtype is not torch.float32 or joined.requires_grad or joined.device.type != "cpu":
        joined = joined.detach().to("cpu", torch.float32)
    values: Any = joined.numpy()  # (a buffer, which numpy's stubs do not say)
    return memoryview(values).cast("B")


def unpack(names: list[str], rows: int, table: Any, profiles: Any, count: int,
           whole: tuple[int, int]) -> ScreenedRows:
    """The ``rows`` rows (at least one) of ``table`` (``table_size(rows)`` bytes: checked by the caller)
    whose senders are ``names`` and whose profiles are the ``count`` float32 values of ``profiles``.
    Malformed, naming what, where a whole number is not within ``whole`` (from, to but not including), an
    index is beyond what it indexes (``WHATS``, ``FOUNDS``, ``names``), or the profiles' lengths do not add
    up to ``count``. The statistics are not judged here: ``screen.sound`` judges them (``ScreenedRows.sound``)."""
    n = rows
    v = _layout(n).unpack_from(table)
    # each group of columns judged by its least and greatest entry (NaN and the infinities are no int64)
    ids, whats, founds, senders = v[:4 * n], v[4 * n:5 * n], v[5 * n:6 * n], v[6 * n:7 * n]
    if not (whole[0] <= min(ids) and max(ids) < whole[1] and 0 <= min(whats) and max(whats) < len(WHATS)
            and 0 <= min(founds) and max(founds) < len(FOUNDS) and 0 <= min(senders) and max(senders) < len(names)):
        raise Malformed("a screening row whose identity, finding or profile length is not whole numbers within "
                        "bounds (its round, what, microbatch, hop, sender, finding, profile length)")
    lengths = ids[3 * n:]
    if sum(lengths) + lengths.count(-1) != count:  # (-1: none)
        raise Malformed("profile lengths that do not add up to the profiles sent")
    return ScreenedRows(names, ids[:n], whats, ids[n:2 * n], ids[2 * n:3 * n], senders, founds,
                        v[7 * n:8 * n], v[8 * n:9 * n], v[9 * n:], lengths, profiles)


class ScreenedRows(Sequence[Screened]):
    """``len(names)`` senders' screening rows, as columns of ``len(rounds)`` entries each: a row's
    ``TensorId`` (``rounds``, ``whats``: index in ``WHATS``, ``mbs``, ``hops``, ``senders``: index in
    ``names``), its summary (``founds``: index in ``FOUNDS``, ``norms``, ``means``, ``stds``) and the
    length of its profile in ``profiles`` (float32, 1-D, the rows' profiles in order; -1: none; given as
    that tensor or as the buffer of its values, made a tensor, a view of the buffer, when first used).

    Whoever builds one checks the columns first (the codec: every index within what it indexes, every
    whole number within bounds, lengths that add up to the profiles); the table holds them as they are.
    A row is made when asked for: ``rows[i]`` and iteration give a new ``Screened`` each time (its profile a
    view of ``profiles``, which are cut once for all rows)."""

    __slots__ = ("names", "rounds", "whats", "mbs", "hops", "senders", "founds", "norms", "means", "stds",
                 "lengths", "_profiles", "_cuts")

    def __init__(self, names: Sequence[str], rounds: Sequence[int], whats: Sequence[int], mbs: Sequence[int],
                 hops: Sequence[int], senders: Sequence[int], founds: Sequence[int], norms: Sequence[float],
                 means: Sequence[float], stds: Sequence[float], lengths: Sequence[int],
                 profiles: Any) -> None:
        self.names, self.rounds, self.whats, self.mbs, self.hops = names, rounds, whats, mbs, hops
        self.senders, self.founds, self.norms, self.means, self.stds = senders, founds, norms, means, stds
        self.lengths, self._profiles = lengths, profiles
        self._cuts: list[torch.Tensor | None] | None = None

    @property
    def profiles(self) -> torch.Tensor:
        """Every row's profile, one after another (float32, 1-D)."""
        p = self._profiles
        if not isinstance(p, torch.Tensor):
            p = self._profiles = torch.frombuffer(p, dtype=torch.float32) if len(memoryview(p)) \
                else torch.empty(0, dtype=torch.float32)
        return p

    def __len__(self) -> int:
        return len(self.rounds)

    @overload
    def __getitem__(self, i: int) -> Screened: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[Screened, ...]: ...

    def __getitem__(self, i: int | slice) -> Screened | tuple[Screened, ...]:
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} of {n}")
        return self._row(i % n, self._profile_cuts())

    def __iter__(self) -> Iterator[Screened]:
        cuts = self._profile_cuts()
        for i in range(len(self.rounds)):
            yield self._row(i, cuts)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (ScreenedRows, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # (a tuple of its rows would not be hashable either)

    def __repr__(self) -> str:
        return repr(tuple(self))

    def of_round(self, rnd: int) -> bool:
        """Whether every row's tensor is of round ``rnd``."""
        return all(r == rnd for r in self.rounds)

    def sound(self) -> bool:
        """Whether every row's summary is ``screen.sound``: with no finding, finite statistics and a finite
        profile or none (a row with a finding is sound as it is). One check of the profiles for all rows."""
        if any(f and n >= 0 for f, n in zip(self.founds, self.lengths)):
            return all(sound(row.summary) for row in self)  # a finding with a profile: row by row
        if any(self.founds):
            rows = (stats for f, *stats in zip(self.founds, self.norms, self.means, self.stds) if not f)
            if not all(math.isfinite(x) for stats in rows for x in stats):
                return False
        elif not all(all(map(math.isfinite, column)) for column in (self.norms, self.means, self.stds)):
            return False
        p = self._profiles
        values = p.detach().cpu().numpy() if isinstance(p, torch.Tensor) else numpy.frombuffer(p, numpy.float32)
        # float32 values summed as float64 cannot overflow: the sum is finite exactly when every one is
        return math.isfinite(values.sum(dtype=numpy.float64))

    def _profile_cuts(self) -> list[torch.Tensor | None]:
        """Each row's profile (None: none), cut from ``profiles`` in one go the first time."""
        if self._cuts is None:
            sizes = [n for n in self.lengths if n >= 0]
            if sizes and sizes[0] and sizes.count(sizes[0]) == len(sizes):  # one length: one view, cut at once
                parts = iter(self.profiles.view(len(sizes), sizes[0]).unbind(0))
            else:
                parts = iter(self.profiles.split(sizes))
            self._cuts = [next(parts) if n >= 0 else None for n in self.lengths]
        return self._cuts

    def _row(self, i: int, cuts: list[torch.Tensor | None]) -> Screened:
        return screened(self.rounds[i], WHATS[self.whats[i]], self.mbs[i], self.hops[i], self.names[self.senders[i]],
                        make_summary(FOUNDS[self.founds[i]], self.norms[i], self.means[i], self.stds[i], cuts[i]))
