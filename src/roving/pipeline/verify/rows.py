"""A ``Norm``'s screening rows as the wire brings them (``runtime.codec``): one table of columns, each row
made a ``tensor_id.Screened`` only when it is asked for.

A node's report holds a row per tensor it received (a ``TensorId`` and its ``screen.Summary``); read
into three objects a row, a report of 8 rows cost the reader more than all its checks. The table keeps
the columns as they came (numbers, indices into ``WHATS``, ``FOUND`` and the senders' names, one buffer
of profiles) and is a sequence of ``Screened`` like the tuple a node sends: its rows compare, print and
iterate as those of that tuple would. What a whole report is asked (every row of one round, every
summary sound) it answers from the columns (``of_round``, ``sound``), without making a row.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, overload

import torch

from .screen import FOUND, Summary, sound
from .tensor_id import WHATS, Screened, TensorId

#: a row's finding by its code in the table: 0 nothing, else 1 + its index in ``FOUND``.
FOUNDS: tuple[tuple[str, ...], ...] = ((), *((f,) for f in FOUND))


class ScreenedRows(Sequence[Screened]):
    """``len(names)`` senders' screening rows, as columns of ``len(rounds)`` entries each: a row's
    ``TensorId`` (``rounds``, ``whats``: index in ``WHATS``, ``mbs``, ``hops``, ``senders``: index in
    ``names``), its summary (``founds``: index in ``FOUNDS``, ``norms``, ``means``, ``stds``) and the
    length of its profile in ``profiles`` (float32, 1-D, the rows' profiles in order; -1: none).

    Whoever builds one checks the columns first (the codec: every index within what it indexes, every
    whole number within bounds, lengths that add up to the profiles); the table holds them as they are.
    A row is made when asked for: ``rows[i]`` and iteration give a new ``Screened`` each time (its profile a
    view of ``profiles``)."""

    __slots__ = ("names", "rounds", "whats", "mbs", "hops", "senders", "founds", "norms", "means", "stds",
                 "lengths", "profiles", "_starts")

    def __init__(self, names: Sequence[str], rounds: Sequence[int], whats: Sequence[int], mbs: Sequence[int],
                 hops: Sequence[int], senders: Sequence[int], founds: Sequence[int], norms: Sequence[float],
                 means: Sequence[float], stds: Sequence[float], lengths: Sequence[int],
                 profiles: torch.Tensor) -> None:
        self.names, self.rounds, self.whats, self.mbs, self.hops = names, rounds, whats, mbs, hops
        self.senders, self.founds, self.norms, self.means, self.stds = senders, founds, norms, means, stds
        self.lengths, self.profiles = lengths, profiles
        self._starts: list[int] | None = None

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
        i %= n
        return self._row(i, self._start(i))

    def __iter__(self) -> Iterator[Screened]:
        start = 0
        for i, n in enumerate(self.lengths):
            yield self._row(i, start)
            if n > 0:
                start += n

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
        for f, *stats in zip(self.founds, self.norms, self.means, self.stds):
            if not f and not all(math.isfinite(x) for x in stats):
                return False
        return bool(torch.isfinite(self.profiles).all())

    def _start(self, i: int) -> int:
        if self._starts is None:
            starts, at = [], 0
            for n in self.lengths:
                starts.append(at)
                at += max(n, 0)
            self._starts = starts
        return self._starts[i]

    def _row(self, i: int, start: int) -> Screened:
        n = self.lengths[i]
        profile: Any = self.profiles[start:start + n] if n >= 0 else None
        return Screened(TensorId(self.rounds[i], WHATS[self.whats[i]], self.mbs[i], self.hops[i],
                                 self.names[self.senders[i]]),
                        Summary(FOUNDS[self.founds[i]], self.norms[i], self.means[i], self.stds[i], profile))
