"""The packed layout of the pipeline's wire: a small message as one ``struct``, no JSON.

A message whose fields are all whole numbers, numbers, strings, bytes or tuples of whole numbers (``Done``,
``Beat``, ``Rechecked``, ``Progress``, ``Failed``...: :class:`Flat`), and a ``Stepped`` whose statistics
have the shape a stage process gives them (:class:`SteppedLayout`), travel as one header frame: a mark
(:data:`MARK`, where a JSON header starts with ``[``), the message's tag, its fixed-width fields (int64,
float64) and the lengths of the others, then those others' bytes in order. The reader unpacks the fixed
part with one cached ``struct``, checks every field as the JSON form's reader does (the checks are
``codec``'s, handed in), and refuses a header whose lengths do not add up to exactly its size. The writer
returns None where a message does not have the shape the layout carries (a field of another type, a
number beyond int64, more than :data:`MAX_ITEMS` numbers in a tuple): ``codec`` then writes it in the
JSON form, whose reader refuses or accepts it as before. Nothing is unpickled; every length is checked
against the bytes received before anything is cut or any ``struct`` made. A layout's tag is its place
among the packed messages in ``protocol``'s order: both ends run one version of the wire, as the JSON
form's fields, by their place, already ask.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import struct
from itertools import chain
from typing import Any, Callable

from ..errors import Malformed

#: The first byte of a packed header.
MARK = 1
#: The most numbers a packed tuple, and the most trace rows a packed ``Stepped``, may hold; the most
#: statistics a packed ``Stepped`` may name (a ``struct`` keeps an entry per number: a longer one goes in
#: the JSON form, and a packed header that claims more is refused).
MAX_ITEMS = 4096
MAX_STATS = 256
_NONE = 0xFFFFFFFF  # a length that says "None" (bytes fields that may be None)


class Kind(enum.IntEnum):
    """What a field of a packed message holds."""

    INT = 0
    FLOAT = 1
    STR = 2
    BYTES = 3
    INTS = 4  # tuple[int, ...]


_STR, _BYTES, _INTS = int(Kind.STR), int(Kind.BYTES), int(Kind.INTS)


@dataclasses.dataclass(frozen=True)
class Field:
    """A field of a packed message: its name, kind, and its check (a value -> whether it is sound)."""

    name: str
    kind: Kind
    check: Callable[[Any], bool]


def _setters(cls: type, names: list[str]) -> list[Callable[[Any, Any], None]]:
    # a frozen dataclass's slots set through their descriptors: its __init__ checks nothing, and costs
    # twice as much as the object and its slots
    return [getattr(cls, name).__set__ for name in names]


def _no_sender(obj: Any, sender: Any) -> None:
    """A message without a sender has none to set."""


def _ints(n: int) -> struct.Struct:
    """The struct of ``n`` whole numbers (at most MAX_ITEMS), kept for the short ones."""
    return _few_ints(n) if n <= 256 else struct.Struct(f"<{n}q")


@functools.lru_cache(maxsize=64)
def _few_ints(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}q")


class Flat:
    """One class's packed writer and reader; ``sender``: whether it has a sender (the reader's)."""

    buffers = 0  # frames after the header

    def __init__(self, cls: type, tag: int, fields: list[Field], sender: bool, whole: tuple[int, int],
                 max_str: int) -> None:
        self.cls, self.tag, self.max_str = cls, tag, max_str
        order = ([f for f in fields if f.kind is Kind.INT] + [f for f in fields if f.kind is Kind.FLOAT]
                 + [f for f in fields if f.kind > Kind.FLOAT])
        self.ints = [f.name for f in order if f.kind is Kind.INT]
        self.floats = [f for f in order if f.kind is Kind.FLOAT]
        self.rest = [f for f in order if f.kind > Kind.FLOAT]
        # the kinds as plain ints: an IntEnum's members and values cost more to look up than a field to cut
        self.rest_kinds = [int(f.kind) for f in self.rest]
        first = len(self.ints) + len(self.floats)
        self.rest_at = [(i, int(f.kind), f) for i, f in enumerate(self.rest, first)]
        self.whole = whole
        self.fixed = struct.Struct("<" + "q" * len(self.ints) + "d" * len(self.floats) + "I" * len(self.rest))
        self.size = 2 + self.fixed.size
        self._mark = bytes((MARK, tag))
        self.set = _setters(cls, [f.name for f in order])
        self.sender = sender
        self.put_sender = _setters(cls, ["sender"])[0] if sender else _no_sender
        self.getters = [f.name for f in order]

    def write(self, msg: Any) -> bytes | None:
        """``msg`` packed, or None where a field holds what this layout does not carry."""
        values = [getattr(msg, name) for name in self.getters]
        ni, nf = len(self.ints), len(self.floats)
        for v in values[:ni]:
            if type(v) is not int:
                return None
        for v in values[ni:ni + nf]:
            if type(v) is not float and type(v) is not int:
                return None
        parts = []
        for i, (what, v) in enumerate(zip(self.rest_kinds, values[ni + nf:]), ni + nf):
            part = _part(what, v)
            if part is None:
                return None
            parts.append(part)
            values[i] = len(part) // 8 if what == _INTS else len(part)
        try:
            head = self._mark + self.fixed.pack(*values)
        except struct.error:  # a number beyond int64, a length beyond 4 GiB
            return None
        return b"".join((head, *parts)) if parts else head

    def read(self, buf: Any, sender: str | None) -> Any:
        """The message ``buf`` (a packed header of this class) holds; Malformed where it does not fit."""
        end, size = len(buf), self.size
        if end < size or (end != size and not self.rest):
            raise Malformed(f"{self.cls.__name__}: a packed header of {end} bytes (it takes {size}"
                            + (" or more)" if self.rest else ")"))
        values: Any = self.fixed.unpack_from(buf, 2)
        ni = len(self.ints)
        if ni:
            lo, hi = self.whole
            ints = values[:ni]
            if min(ints) < lo or max(ints) >= hi:
                raise Malformed(self._bad(values, self.ints))
        for f, v in zip(self.floats, values[ni:]):
            if not f.check(v):
                raise Malformed(f"{self.cls.__name__}.{f.name}: {v!r} is out of bounds")
        if self.rest:
            values = self._cut_rest(buf, list(values), end)
        obj: Any = object.__new__(self.cls)
        if self.sender:
            self.put_sender(obj, sender)
        for put, v in zip(self.set, values):
            put(obj, v)
        return obj

    def _cut_rest(self, buf: Any, values: list, end: int) -> list:
        pos = self.size
        for i, what, f in self.rest_at:
            if what == _STR:  # (inline: most of what is not a number is a string)
                n = values[i]
                if pos + n > end:
                    raise Malformed(f"{self.cls.__name__}.{f.name}: {n} bytes where {end - pos} are left")
                try:
                    text = str(buf[pos:pos + n], "utf-8")
                except UnicodeDecodeError:
                    raise Malformed(f"{self.cls.__name__}.{f.name}: a string that is not UTF-8") from None
                if len(text) > self.max_str:
                    raise Malformed(f"{self.cls.__name__}.{f.name}: a string of more than {self.max_str} characters")
                values[i], pos = text, pos + n
            else:
                values[i], pos = _cut(what, f, buf, pos, values[i], end, self.cls.__name__)
        if pos != end:
            raise Malformed(f"{self.cls.__name__}: a packed header of {end} bytes whose fields take {pos}")
        return values

    def _bad(self, values: tuple, names: list[str]) -> str:
        lo, hi = self.whole
        name, v = next((n, v) for n, v in zip(names, values) if not lo <= v < hi)
        return f"{self.cls.__name__}.{name}: {v!r} is not a whole number from {lo}"


def _part(what: int, v: Any) -> bytes | None:
    if what == _STR:
        return v.encode() if type(v) is str else None
    if what == _BYTES:
        return bytes(v) if type(v) is bytes or type(v) is bytearray else None
    if type(v) is not tuple or len(v) > MAX_ITEMS or (v and set(map(type, v)) != {int}):
        return None
    try:
        return _ints(len(v)).pack(*v)
    except struct.error:
        return None


def _cut(what: int, f: Field, buf: Any, pos: int, n: int, end: int, kind: str) -> tuple[Any, int]:
    """Field ``f``'s value (``what``: its kind as a plain int, bytes or whole numbers), ``n`` long (bytes;
    whole numbers for INTS), at ``pos`` of ``buf``, and where the next starts."""
    size = n * 8 if what == _INTS else n
    if pos + size > end:
        raise Malformed(f"{kind}.{f.name}: {size} bytes where {end - pos} are left")
    if what == _BYTES:
        return bytes(buf[pos:pos + size]), pos + size
    if n > MAX_ITEMS:
        raise Malformed(f"{kind}.{f.name}: {n} whole numbers packed (at most {MAX_ITEMS})")
    values = _ints(n).unpack_from(buf, pos)
    if values and not (f.check(min(values)) and f.check(max(values))):
        raise Malformed(f"{kind}.{f.name}: a number out of bounds")
    return values, pos + size


def _numbers(codes: str, rows: int) -> struct.Struct:
    """The numbers of a ``Stepped``'s trace's ``rows`` (microbatch, start, end each) and statistics
    (``codes``: ``q`` a whole number, ``d`` a float, each); kept for the sizes a stage process sends (a writer
    cannot fill the cache with formats of megabytes)."""
    return _few_numbers(codes, rows) if len(codes) <= 64 and rows <= 256 else _make_numbers(codes, rows)


@functools.lru_cache(maxsize=64)
def _few_numbers(codes: str, rows: int) -> struct.Struct:
    return _make_numbers(codes, rows)


def _make_numbers(codes: str, rows: int) -> struct.Struct:
    if codes.strip("qd"):
        raise Malformed(f"Stepped.stats: numbers of kinds {codes[:40]!r} (q: a whole number, d: a float)")
    return struct.Struct("<" + "qdd" * rows + codes)


class SteppedLayout:
    """``Stepped`` packed: its round, gradient norm and weights' digest (bytes or None); then one text of
    NUL-separated parts: its statistics' number codes (``q`` a whole number, ``d`` a float, each), its
    platform, the statistics' names, the trace's kinds; then in one ``struct`` the trace's rows
    (microbatch, start, end per task) and the statistics' numbers. A ``Stepped`` of any other shape is not
    packed (``write`` returns None)."""

    _FIXED = struct.Struct("<BBqdIII")
    buffers = 0

    def __init__(self, cls: type, tag: int, whole: tuple[int, int], norm_check: Callable[[Any], bool],
                 max_str: int) -> None:
        self.cls, self.tag, self.max_str, self.sender = cls, tag, max_str, True
        #: the ``Stepped`` a packed header holds; Malformed where it does not fit
        self.read: Callable[[Any, str | None], Any] = _stepped_reader(cls, whole, norm_check, max_str)

    def write(self, msg: Any) -> bytes | None:
        """``msg`` packed, or None where it is not of the shape this layout carries."""
        stats, weights, platform = msg.stats, msg.weights, msg.platform
        if type(stats) is not dict or type(msg.round) is not int or type(platform) is not str \
                or (weights is not None and type(weights) is not bytes) or type(msg.grad_norm) is not float:
            return None
        names = [k for k in stats if k != "trace"]
        values = [stats[k] for k in names]
        codes = "".join(["q" if type(v) is int else "d" if type(v) is float else "?" for v in values])
        trace = stats.get("trace", ())
        if "?" in codes or type(trace) not in (list, tuple) or len(trace) > MAX_ITEMS or len(codes) > MAX_STATS:
            return None
        columns: Any = ((), (), (), ())
        if trace:
            if set(map(len, trace)) != {4}:
                return None
            columns = tuple(zip(*trace))  # kinds, microbatches, starts, ends (struct refuses what is not a number)
        parts = [codes, platform, *names, *columns[0]]
        try:
            text = "\0".join(parts).encode()
            numbers = _numbers(codes, len(trace)).pack(*chain.from_iterable(zip(*columns[1:])), *values)
            head = self._FIXED.pack(MARK, self.tag, msg.round, msg.grad_norm,
                                    _NONE if weights is None else len(weights), len(trace) + ("trace" in stats),
                                    len(text))
        except (struct.error, TypeError):  # a number beyond int64, a name or kind that is not a string
            return None
        if text.count(b"\0") != len(parts) - 1:  # a NUL inside a name
            return None
        return b"".join((head, weights or b"", text, numbers))



def _stepped_reader(cls: type, whole: tuple[int, int], norm_check: Callable[[Any], bool],
                    max_str: int) -> Callable[[Any, str | None], Any]:
    """``SteppedLayout.read``, its constants bound once (one read of a ``Stepped`` looks up none)."""
    fixed = SteppedLayout._FIXED
    size, (lo, hi) = fixed.size, whole
    put_round, put_sender, put_stats, put_norm, put_weights, put_platform = _setters(
        cls, ["round", "sender", "stats", "grad_norm", "weights", "platform"])
    new = object.__new__

    def read(buf: Any, sender: str | None) -> Any:
        end = len(buf)
        if end < size:
            raise Malformed(f"Stepped: a packed header of {end} bytes (at least {size})")
        _, _, rnd, norm, n_weights, rows, n_text = fixed.unpack_from(buf)
        if not lo <= rnd < hi:
            raise Malformed(f"Stepped.round: {rnd!r} is not a whole number from {lo}")
        if not norm_check(norm):
            raise Malformed(f"Stepped.grad_norm: {norm!r} is out of bounds")
        pos, weights = size, None
        if n_weights != _NONE:
            weights, pos = bytes(buf[pos:pos + n_weights]), pos + n_weights
        if pos + n_text > end:
            raise Malformed(f"Stepped: a text of {n_text} bytes where {max(0, end - pos)} are left")
        try:
            parts = bytes(buf[pos:pos + n_text]).decode().split("\0")
        except UnicodeDecodeError:
            raise Malformed("Stepped: names that are not UTF-8") from None
        codes, traced = parts[0], rows > 0
        n, rows = len(codes), rows - traced
        if n > MAX_STATS or rows > MAX_ITEMS:
            raise Malformed(f"Stepped: {n} statistics and {rows} trace rows packed (at most {MAX_STATS} and "
                            f"{MAX_ITEMS})")
        if len(parts) != 2 + n + rows or pos + n_text + 8 * (n + 3 * rows) != end or len(parts[1]) > max_str:
            raise Malformed(f"Stepped: a packed header of {end} bytes that its parts do not fit ({len(parts)} "
                            f"names for {n} statistics and {rows} trace rows, a platform's name of at most "
                            f"{max_str} characters)")
        values = _numbers(codes, rows).unpack_from(buf, pos + n_text)
        stats = dict(zip(parts[2:2 + n], values[3 * rows:]))
        if traced:
            cells = iter(values)  # microbatch, start, end of each row in turn (zip stops at the last kind)
            stats["trace"] = list(zip(parts[2 + n:], cells, cells, cells))
        obj: Any = new(cls)
        put_round(obj, rnd)
        put_sender(obj, sender)
        put_stats(obj, stats)
        put_norm(obj, norm)
        put_weights(obj, weights)
        put_platform(obj, parts[1])
        return obj
    return read


def _text(v: Any) -> bool:
    return True  # strings and bytes: their length and encoding are checked as they are cut (``_cut``)


_KINDS = {"int": Kind.INT, "float": Kind.FLOAT, "str": Kind.STR, "bytes": Kind.BYTES, "tuple[int, ...]": Kind.INTS}


def layouts(classes: Any, whole: tuple[int, int], bound: Callable[[str, str], Callable[[Any], bool]],
            max_str: int) -> list[Flat | SteppedLayout]:
    """The packed layouts of ``classes`` (messages, in an order both ends share: a layout's tag is its
    place): a :class:`Flat` for each class whose fields (but its sender) this layout carries, and
    ``Stepped``'s. ``whole``: the least whole number and the first beyond; ``bound(kind, field)``: a float field's
    check."""
    out: list[Flat | SteppedLayout] = []

    def in_whole(v: int) -> bool:
        return whole[0] <= v < whole[1]
    for cls in classes:
        fields = [f for f in dataclasses.fields(cls) if f.name != "sender"]
        sender = len(fields) != len(dataclasses.fields(cls))
        kind = cls.__name__
        if kind == "Stepped":
            out.append(SteppedLayout(cls, len(out), whole, bound(kind, "grad_norm"), max_str))
            continue
        specs = [_KINDS.get(f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")) for f in fields]
        if any(s is None for s in specs):
            continue
        checks = {Kind.INT: in_whole, Kind.INTS: in_whole, Kind.STR: _text, Kind.BYTES: _text}
        out.append(Flat(cls, len(out), [Field(f.name, s, checks.get(s) or bound(kind, f.name))
                                         for f, s in zip(fields, specs) if s is not None], sender, whole, max_str))
    return out


def unreadable(frames: list[Any], layout: Any) -> str:
    """Why the packed message ``frames`` hold cannot be read (``layout``: its tag's, None for a tag of no
    layout): a tag unknown, buffers after it other than its ``buffers``, or no sender to give it."""
    if layout is None:
        return f"a packed message of no kind this wire knows (tag {frames[0][1]})"
    if len(frames) != 1 + layout.buffers:
        return f"{layout.cls.__name__}: {len(frames) - 1} buffer(s) where it has {layout.buffers}"
    return f"{layout.cls.__name__}: a message that needs a sender, read without one"
