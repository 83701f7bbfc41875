"""The data-only wire of the pipeline: what a node sends is data, never code.

Nothing that crosses from a stage process to the coordinator or to another stage process is unpickled:
a message (:mod:`.protocol`) travels as one JSON header and the raw bytes of its tensors, and is read
back only into the types this module knows (the messages, ``Route``, ``Receipt``, ``TensorId``, ``Summary``,
``Link``, ``PostboxAddress``), each field checked against its schema before the message exists:

* **Types** from each field's annotation (``int``, ``float``, ``str``, ``bool``, ``bytes``, ``Route``,
  ``tuple[str, ...]``, ``dict``, ``X | None``...); an ``int`` is never a ``bool``.
* **Bounds** where a number has a meaning (:data:`_BOUNDS`): a round, a microbatch, a count is a whole
  number from -1 up; a norm, a loss, a difference is never negative (NaN or infinite where it was
  computed from NaN or infinite values, which an honest node that received them computes too: the
  round's checks find whose they were); a learning rate or a link's figures finite.
* **Tensors** as raw buffers: a dtype of :data:`DTYPES`, at most :data:`MAX_DIMS` dimensions, and a
  buffer exactly as long as its dtype and shape say, so nothing is allocated that the bytes received do
  not already hold (the tensor is a view of them); the receiver checks the shape against its plan.
* **Sizes**: the header at most :data:`MAX_HEADER` bytes, nesting at most :data:`MAX_DEPTH` deep.

Each class's fields are compiled once into a writer and a reader (:class:`_Codec`): a message is a JSON
array (its kind, then its fields in order, each as its annotation says: a record as the array of its
fields, a tensor as ``[buffer, dtype, shape]``, bytes as base64); only fields annotated loosely
(``Any``, ``dict``, ``list``, ``tuple``) go through the tagged form that says what each value is
(``{"u": [...]}`` a tuple, ``{"m": [[key, value], ...]}`` a dict, ``{"b": "..."}`` bytes, ``{"t": [...]}``
a tensor, ``{"r": [kind, ...]}`` a record). A screening report (``Norm.screened``) travels as one table
(a row per tensor summarised: its ``TensorId``, what was found, its statistics; column after column, the
whole numbers as int64, the statistics as float64), its senders' names, and one buffer with every
profile: each group of columns checked by its least and greatest entry, not value by value, and read
into a ``rows.ScreenedRows`` that makes a row only when it is asked for. The small messages (every
field a number, a string, bytes or a tuple of whole numbers, and ``Stepped``) travel packed instead
(:mod:`.packed`: one ``struct``, no JSON), with the same checks; so do ``Forward``, ``Backward`` and
``Gradients``, a packed header and their tensor's bytes (:mod:`.packed_tensors`), and ``Ready``
(:mod:`.packed_ready`).

The ``sender`` of a message is not on the wire: the reader gives it, from the identity the transport
authenticated for the writer (:class:`roving.transport.postbox.Letter`). A receipt inside a message
must name that same sender. :func:`decode` raises :class:`Malformed` (with what was wrong) for anything
else; the reader decides what that costs the writer (the coordinator catches it).
"""
from __future__ import annotations

import base64
import dataclasses
import functools
import json
import math
from collections.abc import Sequence
from typing import Any, Callable, Iterable

import torch

from ...transport.postbox import PostboxAddress
from .. import protocol as m
from ..errors import Malformed, PipelineError
from ..planning.network import Link
from ..planning.plan import Route
from ..verify.receipts import Receipt
from ..verify.rows import COLUMNS, pack, table_size, unpack
from ..verify.screen import Summary
from ..verify.tensor_id import WHATS, Screened, TensorId
from . import packed, packed_ready, packed_tensors

#: Tensor dtypes that may travel, by their wire name.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8, "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_DIMS = 8
MAX_DEPTH = 16
MAX_HEADER = 64 << 20
_VERSION = 1
_JSON = json.JSONEncoder(separators=(",", ":"))  # (json.dumps would make one a message)


#: The types a message may hold, by wire name (their fields are checked as a message's are).
_RECORDS: dict[str, type] = {cls.__name__: cls for cls in (Route, Receipt, TensorId, Summary, Link, PostboxAddress)}
_MESSAGES: dict[str, type] = {
    cls.__name__: cls for cls in vars(m).values()
    if isinstance(cls, type) and issubclass(cls, m.Message) and cls not in (m.Message, m.RoundMessage)
}
_KNOWN: dict[str, type] = {**_RECORDS, **_MESSAGES}

# -- bounds -------------------------------------------------------------------------------------------
_WHOLE = (-1, 1 << 40)  # rounds, microbatches, hops, counts, stages: whole numbers from -1


def _finite(v: float) -> bool:
    return math.isfinite(v)


def _nonneg(v: float) -> bool:
    return math.isfinite(v) and v >= 0


def _not_negative(v: float) -> bool:
    """A norm, a loss, a difference: never below 0; NaN or infinite where what it was computed from was
    (an honest node that received NaN computes NaN: the checks of the round find whose it was)."""
    return math.isnan(v) or v >= 0


#: Checks of a float field beyond its type (by class name and field; "*" for every class). A float
#: not named here must be finite.
_BOUNDS: dict[tuple[str, str], Callable[[float], bool]] = {
    ("Norm", "sq_norm"): _not_negative,
    ("Done", "loss"): _not_negative,
    ("Stepped", "grad_norm"): _not_negative,
    ("Rechecked", "difference"): _not_negative,
    ("Step", "clip_coef"): _nonneg,
    ("Step", "lr"): _nonneg,
    ("Throttle", "factor"): lambda v: math.isfinite(v) and v >= 1,
    ("Link", "latency_s"): _nonneg,
    ("Link", "bandwidth_bps"): lambda v: v > 0,  # inf: a link that costs nothing
    # a summary's statistics are judged by screening (Summary.sound), which refuses the unsound
    ("Summary", "norm"): lambda v: True, ("Summary", "mean"): lambda v: True, ("Summary", "std"): lambda v: True,
}


# -- compiled field codecs ----------------------------------------------------------------------------
Enc = Callable[[Any, list], Any]
Dec = Callable[[Any, "_Reader", int], Any]


class _Codec:
    """One message or record class's writer and reader, compiled from its fields' annotations."""

    def __init__(self, cls: type, message: bool) -> None:
        self.cls, self.kind = cls, cls.__name__
        fields = [f for f in dataclasses.fields(cls) if not (message and f.name == "sender")]
        self.sender = message and any(f.name == "sender" for f in dataclasses.fields(cls))
        self.names = [f.name for f in fields]
        self.required = sum(1 for f in fields if f.default is dataclasses.MISSING
                            and f.default_factory is dataclasses.MISSING)
        self.fields: list[tuple[str, Enc, Dec]] = []
        for f in fields:
            spec = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "Any")
            enc, dec = _CUSTOM.get((self.kind, f.name)) or _compile(spec.strip(), (self.kind, f.name))
            self.fields.append((f.name, enc, dec))

    def write(self, obj: Any, buffers: list) -> list:
        return [enc(getattr(obj, name), buffers) for name, enc, _ in self.fields]

    def read(self, raw: Any, reader: "_Reader", depth: int) -> Any:
        if type(raw) is not list or not self.required <= len(raw) <= len(self.fields):
            raise Malformed(f"{self.kind}: {len(raw) if type(raw) is list else 'no'} field(s) where it has "
                            f"{self.required} to {len(self.fields)}")
        args = {}
        for (name, _, dec), value in zip(self.fields, raw):
            try:
                args[name] = dec(value, reader, depth + 1)
            except Malformed as exc:
                raise Malformed(f"{self.kind}.{name}: {exc}") from None
        if self.sender:
            args["sender"] = reader.sender
        try:
            return self.cls(**args)
        except (TypeError, ValueError, PipelineError) as exc:
            raise Malformed(f"{self.kind}: {exc}") from None


def _same(v: Any, buffers: list) -> Any:
    return v


def _check_int(raw: Any, reader: "_Reader", depth: int) -> int:
    if type(raw) is not int or not _WHOLE[0] <= raw < _WHOLE[1]:
        raise Malformed(f"{raw!r} is not a whole number from {_WHOLE[0]}")
    return raw


def _check_str(raw: Any, reader: "_Reader", depth: int) -> str:
    if type(raw) is not str or len(raw) > 4096:
        raise Malformed("not a string (of at most 4096 characters)")
    return raw


def _check_bool(raw: Any, reader: "_Reader", depth: int) -> bool:
    if type(raw) is not bool:
        raise Malformed(f"{raw!r} is not true or false")
    return raw


def _float_check(where: tuple[str, str]) -> Dec:
    bound = _BOUNDS.get(where, _finite)

    def check(raw: Any, reader: "_Reader", depth: int) -> float:
        if type(raw) is not float and type(raw) is not int:
            raise Malformed(f"{raw!r} is not a number")
        value = float(raw)
        if not bound(value):
            raise Malformed(f"{value!r} is out of bounds")
        return value
    return check


def _enc_bytes(v: Any, buffers: list) -> str:
    return base64.b64encode(v).decode()


def _dec_bytes(raw: Any, reader: "_Reader", depth: int) -> bytes:
    if type(raw) is not str or len(raw) > MAX_HEADER:
        raise Malformed("not bytes")
    try:
        return base64.b64decode(raw, validate=True)
    except ValueError:
        raise Malformed("bytes that are not base64") from None


def _dec_tensor(raw: Any, reader: "_Reader", depth: int) -> torch.Tensor:
    return reader.tensor(raw)


def _compile(spec: str, where: tuple[str, str]) -> tuple[Enc, Dec]:
    """The writer and reader of a field annotated ``spec``."""
    if "|" in spec and not spec.startswith(("tuple[", "dict[", "list[")):
        options = [o.strip() for o in spec.split("|") if o.strip() != "None"]
        inner_enc, inner_dec = _compile(options[0], where) if len(options) == 1 else (_enc_any, _dec_any)

        def enc_opt(v: Any, buffers: list) -> Any:
            return None if v is None else inner_enc(v, buffers)

        def dec_opt(raw: Any, reader: _Reader, depth: int) -> Any:
            return None if raw is None else inner_dec(raw, reader, depth)
        return enc_opt, dec_opt
    if spec == "int":
        return _same, _check_int
    if spec == "float":
        return _same, _float_check(where)
    if spec == "str":
        return _same, _check_str
    if spec == "bool":
        return _same, _check_bool
    if spec == "bytes":
        return _enc_bytes, _dec_bytes
    if spec in ("torch.Tensor", "Tensor"):
        return _tensor, _dec_tensor
    if spec.startswith("tuple[") and spec.endswith(", ...]"):
        item_enc, item_dec = _compile(spec[len("tuple["):-len(", ...]")], where)

        def enc_seq(v: Any, buffers: list) -> list:
            return [item_enc(x, buffers) for x in v]

        def dec_seq(raw: Any, reader: _Reader, depth: int) -> tuple:
            if type(raw) is not list:
                raise Malformed("not a sequence")
            return tuple(item_dec(x, reader, depth + 1) for x in raw)
        return enc_seq, dec_seq
    if spec in _RECORDS:
        def enc_rec(v: Any, buffers: list) -> list:
            if type(v) is not _RECORDS[spec]:
                raise TypeError(f"{where[0]}.{where[1]} holds a {spec}, not a {type(v).__name__}")
            return _codec(spec).write(v, buffers)

        def dec_rec(raw: Any, reader: _Reader, depth: int) -> Any:
            return _codec(spec).read(raw, reader, depth)
        return enc_rec, dec_rec
    if spec in ("Any", "dict", "list", "tuple"):
        kind = {"dict": dict, "list": list, "tuple": tuple}.get(spec)

        def dec_loose(raw: Any, reader: _Reader, depth: int) -> Any:
            value = _dec_any(raw, reader, depth)
            if kind is not None and not isinstance(value, kind):
                raise Malformed(f"not a {spec}")
            return value
        return _enc_any, dec_loose
    raise TypeError(f"{where[0]}.{where[1]}: a field of a type the pipeline's wire does not carry ({spec})")


# -- the tagged form, for loosely annotated fields ----------------------------------------------------
def _enc_any(v: Any, buffers: list) -> Any:
    t = type(v)
    if v is None or t is bool or t is int or t is str or t is float:
        return v
    if t is list:
        return [_enc_any(x, buffers) for x in v]
    if t is tuple:
        return {"u": [_enc_any(x, buffers) for x in v]}
    if isinstance(v, dict):
        return {"m": [[_enc_any(k, buffers), _enc_any(x, buffers)] for k, x in v.items()]}
    if isinstance(v, torch.Tensor):
        return {"t": _tensor(v, buffers)}
    if t is bytes or t is bytearray:
        return {"b": base64.b64encode(v).decode()}
    if _RECORDS.get(t.__name__) is t:
        return {"r": [t.__name__, *_codec(t.__name__).write(v, buffers)]}
    raise TypeError(f"a pipeline message cannot carry a {t.__qualname__}: only data (numbers, strings, bytes, "
                    f"lists, tuples, dicts, tensors, {', '.join(_RECORDS)})")


def _dec_any(raw: Any, reader: "_Reader", depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise Malformed(f"nested deeper than {MAX_DEPTH}")
    t = type(raw)
    if raw is None or t is bool or t is int or t is str or t is float:
        return raw
    if t is list:
        return [_dec_any(x, reader, depth + 1) for x in raw]
    if t is not dict or len(raw) != 1:
        raise Malformed(f"a value of kind {t.__name__}")
    (tag, value), = raw.items()
    if tag == "u" and type(value) is list:
        return tuple(_dec_any(x, reader, depth + 1) for x in value)
    if tag == "m" and type(value) is list:
        out = {}
        for pair in value:
            if type(pair) is not list or len(pair) != 2:
                raise Malformed("a dict entry that is not a pair")
            key = _dec_any(pair[0], reader, depth + 1)
            if not _hashable(key):
                raise Malformed("a dict key that is not a number, string or tuple of them")
            out[key] = _dec_any(pair[1], reader, depth + 1)
        return out
    if tag == "t":
        return reader.tensor(value)
    if tag == "b":
        return _dec_bytes(value, reader, depth)
    if tag == "r" and type(value) is list and value and isinstance(value[0], str) and value[0] in _RECORDS:
        return _codec(value[0]).read(value[1:], reader, depth)
    raise Malformed("a value of no kind this wire knows")


def _hashable(key: Any) -> bool:
    if type(key) in (int, str, bool, TensorId) or key is None:
        return True
    return type(key) is tuple and all(_hashable(k) for k in key)


# -- tensors ------------------------------------------------------------------------------------------
_ITEMSIZE = {name: torch.empty((), dtype=dtype).element_size() for name, dtype in DTYPES.items()}
_NUMPY = frozenset(DTYPES) - {"bfloat16", "bool"}


def _tensor(t: Any, buffers: list) -> list:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"a tensor field holds a {type(t).__name__}")
    dtype = _DTYPE_NAMES.get(t.dtype)
    if dtype is None:
        raise TypeError(f"a pipeline message cannot carry a tensor of {t.dtype}")
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.requires_grad:
        t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if not t.numel():
        buffers.append(b"")
    elif dtype in _NUMPY:
        buffers.append(memoryview(t.numpy()).cast("B"))
    else:  # bfloat16: no numpy type, its bytes as they are
        buffers.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return [len(buffers) - 1, dtype, list(t.shape)]


# -- screening reports, as one table (its layout: rows.pack) -----------------------------------------
def _enc_screened(rows: Any, buffers: list) -> list:
    """Norm.screened: ``[names, [table buffer, rows], profiles]`` (``rows.pack``)."""
    table = pack(rows)
    buffers += (table.table, table.profiles)
    return [table.names, [len(buffers) - 2, table.rows], [len(buffers) - 1, "float32", [len(table.profiles) // 4]]]


def _dec_screened(raw: Any, reader: "_Reader", depth: int) -> Sequence[Screened]:
    if type(raw) is not list or len(raw) != 3 or type(raw[0]) is not list or type(raw[1]) is not list \
            or len(raw[1]) != 2:
        raise Malformed("not a screening report ([names, [table, rows], profiles])")
    names = [_check_str(n, reader, depth) for n in raw[0]]
    index, n = raw[1]
    if type(n) is not int or n < 0:
        raise Malformed(f"a screening table of {str(n)[:40]} rows")
    table = reader.claim(index, table_size(n), lambda: f"a screening table of {n} rows ({COLUMNS} columns)")
    profiles, (count,) = reader.buffer(raw[2], "float32", 1)
    if not n:
        if count:
            raise Malformed("profiles sent with no screening row")
        return ()
    return unpack(names, n, table, profiles, count, _WHOLE)


def _enc_keys(keys: Any, buffers: list) -> Any:
    """Norm.disputes: a list of ``TensorId`` records where it holds only those (as it does), else the
    tagged form of what it holds (a JSON object: never read as such a list)."""
    if type(keys) is tuple and all(type(k) is TensorId for k in keys):
        return [[k.round, k.what, k.mb, k.hop, k.sender] for k in keys]
    return _enc_any(keys, buffers)


def _dec_keys(raw: Any, reader: "_Reader", depth: int) -> tuple:
    if type(raw) is list:
        key = _codec("TensorId")
        return tuple(key.read(k, reader, depth + 1) for k in raw)
    value = _dec_any(raw, reader, depth)
    if not isinstance(value, tuple):
        raise Malformed("not a tuple")
    return value


def _enc_cosines(cosines: Any, buffers: list) -> Any:
    """Norm.cosines: ``{"c": [names, numbers]}`` where it is names to floats (as it is), else the tagged
    form of what it holds."""
    if type(cosines) is dict and all(type(k) is str and type(v) is float for k, v in cosines.items()):
        return {"c": [list(cosines), list(cosines.values())]}
    return _enc_any(cosines, buffers)


def _dec_cosines(raw: Any, reader: "_Reader", depth: int) -> Any:
    if type(raw) is not dict or "c" not in raw:
        return _dec_any(raw, reader, depth)
    pair = raw["c"]
    if len(raw) != 1 or type(pair) is not list or len(pair) != 2 or type(pair[0]) is not list \
            or type(pair[1]) is not list or len(pair[0]) != len(pair[1]):
        raise Malformed("cosines that are not [names, numbers] of one length")
    names, values = pair
    if not all(type(n) is str and len(n) <= 4096 for n in names) or not all(type(v) is float for v in values):
        raise Malformed("cosines that are not names (strings) and numbers")
    return dict(zip(names, values))


def _enc_digest(digest: Any, buffers: list) -> Any:
    """Norm.combined: bytes as base64 (as it is), None as null, anything else as ``[its tagged form]``."""
    if type(digest) is bytes:
        return base64.b64encode(digest).decode()
    return None if digest is None else [_enc_any(digest, buffers)]


def _dec_digest(raw: Any, reader: "_Reader", depth: int) -> Any:
    if raw is None or type(raw) is str:
        return None if raw is None else _dec_bytes(raw, reader, depth)
    if type(raw) is not list or len(raw) != 1:
        raise Malformed("a digest that is not bytes")
    return _dec_any(raw[0], reader, depth)


def _check_what(raw: Any, reader: "_Reader", depth: int) -> str:
    if type(raw) is not str or raw not in WHATS:
        raise Malformed(f"{str(raw)[:40]!r} is not what a tensor can be ({', '.join(WHATS)})")
    return raw


def _enc_stats(stats: Any, buffers: list) -> list:
    """Stepped.stats: its numbers by name, and its trace (kind, microbatch, start, end per task) as rows."""
    plain = [[k, v] for k, v in stats.items() if k != "trace"]
    if any(type(v) not in (int, float) for _, v in plain):
        return [_enc_any(stats, buffers)]  # anything else: the tagged form
    return [plain, [list(t) for t in stats["trace"]] if "trace" in stats else None]


def _dec_stats(raw: Any, reader: "_Reader", depth: int) -> dict:
    if type(raw) is not list or len(raw) not in (1, 2):
        raise Malformed("statistics that are not [numbers, trace]")
    if len(raw) == 1:
        value = _dec_any(raw[0], reader, depth)
        if not isinstance(value, dict):
            raise Malformed("statistics that are not a dict")
        return value
    plain, trace = raw
    if type(plain) is not list or (trace is not None and type(trace) is not list):
        raise Malformed("statistics that are not [numbers, trace]")
    out: dict[str, Any] = {}
    for pair in plain:
        if type(pair) is not list or len(pair) != 2 or type(pair[0]) is not str or type(pair[1]) not in (int, float):
            raise Malformed("a statistic that is not a name and a number")
        out[pair[0]] = pair[1]
    if trace is None:
        return out
    rows = []
    for t in trace:
        if type(t) is not list or len(t) != 4 or type(t[0]) is not str or type(t[1]) is not int \
                or type(t[2]) not in (int, float) or type(t[3]) not in (int, float):
            raise Malformed("a trace row that is not (kind, microbatch, start, end)")
        rows.append((t[0], t[1], t[2], t[3]))
    out["trace"] = rows
    return out


_CUSTOM: dict[tuple[str, str], tuple[Enc, Dec]] = {("Norm", "screened"): (_enc_screened, _dec_screened),
                                                   ("Norm", "disputes"): (_enc_keys, _dec_keys),
                                                   ("Norm", "cosines"): (_enc_cosines, _dec_cosines),
                                                   ("Norm", "combined"): (_enc_digest, _dec_digest),
                                                   ("Stepped", "stats"): (_enc_stats, _dec_stats),
                                                   ("TensorId", "what"): (_same, _check_what)}


@functools.cache
def _codec(kind: str) -> _Codec:
    """The compiled codec of a message or record class, by name."""
    if kind in _MESSAGES:
        return _Codec(_MESSAGES[kind], message=True)
    return _Codec(_RECORDS[kind], message=False)


#: The small messages' packed layouts (``packed``), by tag and by class.
_PACKED: list[Any] = packed.layouts(_MESSAGES.values(), _WHOLE, lambda kind, name: _BOUNDS.get((kind, name), _finite),
                                    4096)
_PACKED += packed_tensors.layouts(len(_PACKED), m.Forward, m.Backward, m.Gradients, whole=_WHOLE, dtypes=DTYPES,
                                  max_dims=MAX_DIMS, max_str=4096, write_tensor=_tensor)  # (their tensor a buffer)
_PACKED.append(packed_ready.ReadyLayout(m.Ready, len(_PACKED), _WHOLE, 4096))
_PACKER = {layout.cls: layout for layout in _PACKED}


# -- the wire -----------------------------------------------------------------------------------------
def encode(msg: m.Message, json_only: bool = False) -> list[Any]:
    """The frames of ``msg``: its header (packed where ``packed`` carries it, else JSON; with
    ``json_only``, JSON whatever the message: :func:`decode` reads both) and its tensors' bytes, in order.
    Its ``sender`` is left out (the reader takes it from the transport). TypeError when it holds anything
    but data."""
    layout = None if json_only else _PACKER.get(type(msg))
    if layout is not None:
        head = layout.write(msg)
        if head is not None:
            return head if layout.buffers else [head]
    kind = type(msg).__name__
    if _MESSAGES.get(kind) is not type(msg):
        raise TypeError(f"not a pipeline message: {type(msg).__qualname__}")
    buffers: list[Any] = []
    body = _codec(kind).write(msg, buffers)
    return [_JSON.encode([_VERSION, kind, *body]).encode(), *buffers]


def decode(frames: list[Any], sender: str | None = None) -> m.Message:
    """The message ``frames`` hold, with ``sender`` as its sender (for the messages that have one);
    :class:`Malformed` when they are not a message of this wire, or a field does not fit its schema."""
    if not frames:
        raise Malformed("an empty message")
    header = frames[0]
    if len(header) > MAX_HEADER:
        raise Malformed(f"a header of {len(header)} bytes (at most {MAX_HEADER})")
    if len(header) > 1 and header[0] == packed.MARK:
        layout = _PACKED[header[1]] if header[1] < len(_PACKED) else None
        if layout is None or len(frames) != 1 + layout.buffers or (sender is None and layout.sender):
            raise Malformed(packed.unreadable(frames, layout))
        return layout.read(frames, sender) if layout.buffers else layout.read(header, sender)
    try:
        doc = json.loads(bytes(header).decode())
    except (ValueError, TypeError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise Malformed(f"a header that is not this wire's JSON: {exc}") from None
    if type(doc) is not list or len(doc) < 2 or doc[0] != _VERSION:
        raise Malformed(f"not a message of this wire (version {_VERSION})")
    kind = doc[1]
    if type(kind) is not str or kind not in _MESSAGES:
        raise Malformed(f"a message of no kind this wire knows: {str(kind)[:40]!r}")
    codec = _codec(kind)
    if codec.sender and sender is None:
        raise Malformed(f"{kind}: a message that needs a sender, read without one")
    reader = _Reader(frames[1:], sender)
    msg = codec.read(doc[2:], reader, 0)
    if len(reader.used) != len(frames) - 1:
        raise Malformed(f"{len(frames) - 1 - len(reader.used)} buffer(s) that no field names")
    receipt = getattr(msg, "receipt", None)
    if receipt is not None and sender is not None and receipt.id.sender != sender:
        raise Malformed(f"{kind}: a receipt of {receipt.id.sender!r} sent by {sender!r}")
    return msg


class _Reader:
    """What one message's fields are read against: its buffers (each used once) and its sender."""

    def __init__(self, buffers: list[Any], sender: str | None) -> None:
        self.buffers, self.sender = buffers, sender
        self.used: set[int] = set()

    def tensor(self, raw: Any, dtype: str = "", dims: int = -1) -> torch.Tensor:
        """The tensor ``raw`` names (``[buffer, dtype, shape]``), a view of its buffer; of ``dtype`` and
        ``dims`` dimensions where they are given."""
        buf, dtype_name, shape = self._parts(raw, dtype, dims)
        if not len(buf):
            return torch.empty(shape, dtype=DTYPES[dtype_name])
        return torch.frombuffer(buf, dtype=DTYPES[dtype_name]).view(shape)

    def claim(self, index: Any, size: int, what: Callable[[], str]) -> Any:
        """Buffer ``index``, which must be ``size`` bytes long (``what()``: what it holds, in words, made
        only for the error)."""
        if type(index) is not int or not 0 <= index < len(self.buffers) or index in self.used:
            raise Malformed(f"{what()} that names no buffer of its own")
        buf = self.buffers[index]
        if len(buf) != size:
            raise Malformed(f"{what()} in {len(buf)} bytes (it takes {size})")
        self.used.add(index)
        return buf

    def buffer(self, raw: Any, dtype: str, dims: int) -> tuple[Any, list[int]]:
        """The buffer and shape of the tensor ``raw`` names, of ``dtype`` and ``dims`` dimensions (checked as
        ``tensor`` checks them), for a reader that makes the tensor itself, if at all."""
        buf, _, shape = self._parts(raw, dtype, dims)
        return buf, shape

    def _parts(self, raw: Any, dtype: str, dims: int) -> tuple[Any, str, list[int]]:
        if type(raw) is not list or len(raw) != 3:
            raise Malformed("a tensor that is not [buffer, dtype, shape]")
        index, dtype_name, shape = raw
        itemsize = _ITEMSIZE.get(dtype_name) if type(dtype_name) is str else None
        if itemsize is None or (dtype and dtype_name != dtype):
            raise Malformed(f"a tensor of dtype {str(dtype_name)[:40]!r} "
                            f"({dtype or 'one of ' + ', '.join(DTYPES)})")
        if type(shape) is not list or len(shape) > MAX_DIMS or any(type(n) is not int or n < 0 for n in shape) \
                or (dims >= 0 and len(shape) != dims):
            raise Malformed(f"a tensor shape {str(shape)[:80]} (at most {MAX_DIMS} sizes, none negative"
                            + (f"; {dims} of them)" if dims >= 0 else ")"))
        buf = self.claim(index, math.prod(shape) * itemsize, lambda: f"a {dtype_name} tensor of shape {tuple(shape)}")
        return buf, dtype_name, shape


def kinds() -> Iterable[str]:
    """The names of the messages this wire carries."""
    return _MESSAGES.keys()
