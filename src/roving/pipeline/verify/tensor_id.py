"""One tensor's identity in a run (``[verify]``): which node sent it, as what, of which round, microbatch
and hop. The one definition that the evidence a node keeps is keyed by (``evidence.Evidence``), that a
``receipts.Receipt`` names and its MAC covers (``TensorId.body``, the one encoding), that a screening row
names (``Screened``), and that the coordinator asks for and compares (``verifier``)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .screen import Summary

#: what a stage process sends that is kept as evidence, and what it shows of its own ("combined").
WHATS = ("activation", "gradient", "share", "combined")


@dataclass(frozen=True, slots=True, order=True)
class TensorId:
    """``sender``'s ``what`` (``WHATS``) of microbatch ``mb`` (-1 for a share) at hop ``hop`` (the message's;
    -1 for a share) of round ``round``. Hashable (the key a node keeps it by) and ordered (by its fields in
    order). Its fields are checked where it comes from another process (``codec``), not here."""

    round: int
    what: str
    mb: int
    hop: int
    sender: str

    def body(self, digest: bytes) -> bytes:
        """What a receipt's MAC covers: this identity and the tensor's ``digest``."""
        return f"{self.sender}\0{self.round}\0{self.what}\0{self.mb}\0{self.hop}\0".encode() + digest

    def as_list(self) -> list:
        """[what, mb, hop, sender]: how an event names it (the event says the round)."""
        return [self.what, self.mb, self.hop, self.sender]

    @classmethod
    def combined(cls, rnd: int) -> TensorId:
        """The gradient a process combined from its stage's shares in round ``rnd`` (its own: no sender)."""
        return cls(rnd, "combined", -1, -1, "")


@dataclass(frozen=True, slots=True)
class Screened:
    """A screening row: the ``summary`` of the tensor ``tensor`` that a node received (``Norm.screened``)."""

    tensor: TensorId
    summary: Summary


_new = object.__new__
_SET_ID = tuple(getattr(TensorId, name).__set__ for name in ("round", "what", "mb", "hop", "sender"))
_SET_ROW = tuple(getattr(Screened, name).__set__ for name in ("tensor", "summary"))


def screened(rnd: int, what: str, mb: int, hop: int, sender: str, summary: Summary) -> Screened:
    """``Screened(TensorId(rnd, what, mb, hop, sender), summary)``, made without the frozen dataclasses'
    ``__init__`` (each field through ``object.__setattr__``: half the cost of a row read off the wire).
    Neither class checks its fields (the codec does), so the two are the same."""
    t, row = _new(TensorId), _new(Screened)
    set_round, set_what, set_mb, set_hop, set_sender = _SET_ID
    set_round(t, rnd)
    set_what(t, what)
    set_mb(t, mb)
    set_hop(t, hop)
    set_sender(t, sender)
    _SET_ROW[0](row, t)
    _SET_ROW[1](row, summary)
    return row


class Kind(str, Enum):
    """A check's kind: what computation made the tensor checked (``FIRST``, ``VISIT``, ``LOSS``, ``SHARE``:
    what ``evidence.recompute`` can redo), or what else a node is held to (its ``REPORT``s, the
    ``WEIGHTS`` it holds, what it ``EXPORT``s, how it ``COMBINE``d its stage's shares). Its value is its
    name on the wire and in events."""

    FIRST = "first"
    VISIT = "visit"
    LOSS = "loss"
    SHARE = "share"
    REPORT = "report"
    WEIGHTS = "weights"
    EXPORT = "export"
    COMBINE = "combine"

    def __str__(self) -> str:
        return self.value
