"""The data-only wire of the pipeline: what a node sends is data, never code.

Nothing that crosses from a stage process to the coordinator or to another stage process is unpickled:
a message (:mod:`.protocol`) travels as one JSON header and the raw bytes of its tensors, and is read
back only into the types this module knows (the messages, ``Route``, ``Receipt``, ``Summary``, ``Link``,
``PostboxAddress``), each field checked against its schema before the message exists:

* **Types** from each field's annotation (``int``, ``float``, ``str``, ``bool``, ``bytes``, ``Route``,
  ``tuple[str, ...]``, ``dict``, ``X | None``...); an ``int`` is never a ``bool``.
* **Bounds** where a number has a meaning (:data:`_BOUNDS`): a round, a microbatch, a count is a whole
  number from -1 up; a squared norm is finite and not negative; a loss finite; NaN only where the
  message's docstring gives it a meaning (a gradient norm or a difference that could not be had).
* **Tensors** as raw buffers: a dtype of :data:`DTYPES`, at most :data:`MAX_DIMS` dimensions, and a
  buffer exactly as long as its dtype and shape say, so nothing is allocated that the bytes received do
  not already hold (the tensor is a view of them); the receiver checks the shape against its plan.
* **Sizes**: the header at most :data:`MAX_HEADER` bytes, nesting at most :data:`MAX_DEPTH` deep.

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
from typing import Any, Callable, Iterable

import torch

from ..transport.postbox import PostboxAddress
from . import protocol as m
from .errors import PipelineError
from .network import Link
from .plan import Route
from .receipts import Receipt
from .screen import Summary

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


class Malformed(PipelineError, ValueError):
    """A message that does not fit the pipeline's wire: what was wrong, in words."""


#: The types a message may hold, by wire name (their fields are checked as a message's are).
_RECORDS: dict[str, type] = {cls.__name__: cls for cls in (Route, Receipt, Summary, Link, PostboxAddress)}
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


def _nonneg_or_nan(v: float) -> bool:
    return math.isnan(v) or (math.isfinite(v) and v >= 0)


#: Checks of a float field beyond its type (by class name and field; "*" for every class). A float
#: not named here must be finite.
_BOUNDS: dict[tuple[str, str], Callable[[float], bool]] = {
    ("Norm", "sq_norm"): _nonneg,
    ("Done", "loss"): _nonneg,
    ("Stepped", "grad_norm"): _nonneg_or_nan,
    ("Rechecked", "difference"): _nonneg_or_nan,
    ("Step", "clip_coef"): _nonneg,
    ("Step", "lr"): _nonneg,
    ("Throttle", "factor"): lambda v: math.isfinite(v) and v >= 1,
    ("Link", "latency_s"): _nonneg,
    ("Link", "bandwidth_bps"): lambda v: v > 0,  # inf: a link that costs nothing
    # a summary's statistics are judged by screening (Summary.sound), which refuses the unsound
    ("Summary", "norm"): lambda v: True, ("Summary", "mean"): lambda v: True, ("Summary", "std"): lambda v: True,
}


# -- encoding -----------------------------------------------------------------------------------------
def encode(msg: m.Message) -> list[Any]:
    """The frames of ``msg``: its header (JSON) and its tensors' bytes, in order. Its ``sender`` is
    left out (the reader takes it from the transport)."""
    buffers: list[Any] = []
    body = _record(msg, buffers, skip_sender=True)
    header = json.dumps([_VERSION, body], separators=(",", ":")).encode()
    return [header, *buffers]


def _record(obj: Any, buffers: list[Any], skip_sender: bool = False) -> dict:
    kind = type(obj).__name__
    values = {}
    for name in _field_names(type(obj)):
        if skip_sender and name == "sender":
            continue
        values[name] = _value(getattr(obj, name), buffers)
    return {"$c": kind, "f": values}


def _value(v: Any, buffers: list[Any]) -> Any:
    t = type(v)
    if v is None or t is bool or t is int or t is str or t is float:
        return v
    if isinstance(v, torch.Tensor):
        return _tensor(v, buffers)
    if t is list:
        return [_value(x, buffers) for x in v]
    if t is tuple:
        return {"$u": [_value(x, buffers) for x in v]}
    if isinstance(v, dict):
        return {"$m": [[_value(k, buffers), _value(x, buffers)] for k, x in v.items()]}
    if t is bytes or t is bytearray:
        return {"$b": base64.b64encode(v).decode()}
    if t.__name__ in _KNOWN and _KNOWN[t.__name__] is t:
        return _record(v, buffers)
    raise TypeError(f"a pipeline message cannot carry a {t.__qualname__}: only data "
                    f"(numbers, strings, bytes, lists, tuples, dicts, tensors, {', '.join(_RECORDS)})")


def _tensor(t: torch.Tensor, buffers: list[Any]) -> dict:
    dtype = _DTYPE_NAMES.get(t.dtype)
    if dtype is None:
        raise TypeError(f"a pipeline message cannot carry a tensor of {t.dtype}")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    if t.numel():
        raw = t.reshape(-1)
        buffers.append(memoryview((raw if raw.dtype == torch.uint8 else raw.view(torch.uint8)).numpy()))
    else:
        buffers.append(b"")
    return {"$t": len(buffers) - 1, "d": dtype, "s": list(t.shape)}


# -- decoding -----------------------------------------------------------------------------------------
def decode(frames: list[Any], sender: str | None = None) -> m.Message:
    """The message ``frames`` hold, with ``sender`` as its sender (for the messages that have one);
    :class:`Malformed` when they are not a message of this wire, or a field does not fit its schema."""
    if not frames:
        raise Malformed("an empty message")
    header = frames[0]
    if len(header) > MAX_HEADER:
        raise Malformed(f"a header of {len(header)} bytes (at most {MAX_HEADER})")
    try:
        version, body = json.loads(bytes(header))
    except (ValueError, TypeError, RecursionError) as exc:
        raise Malformed(f"a header that is not this wire's JSON: {exc}") from None
    if version != _VERSION:
        raise Malformed(f"wire version {version!r} (this process reads {_VERSION})")
    reader = _Reader(frames[1:], sender)
    msg = reader.record(body, 0, messages=True)
    unused = len(frames) - 1 - len(reader.used)
    if unused:
        raise Malformed(f"{unused} buffer(s) that no field names")
    return msg


class _Reader:
    def __init__(self, buffers: list[Any], sender: str | None) -> None:
        self.buffers, self.sender, self.used = buffers, sender, set()

    def record(self, body: Any, depth: int, messages: bool = False, want: type | None = None) -> Any:
        if not isinstance(body, dict) or set(body) != {"$c", "f"} or not isinstance(body["f"], dict):
            raise Malformed("a record that is not one")
        kind = body["$c"]
        table = _MESSAGES if messages else _RECORDS
        cls = table.get(kind) if isinstance(kind, str) else None
        if cls is None or (want is not None and cls is not want):
            raise Malformed(f"a {kind!r} where {'a message' if messages else (want or object).__name__} belongs")
        values = body["f"]
        schema = _schema(cls)
        expected = {name for name in schema if not (messages and name == "sender")}
        if set(values) - expected:
            raise Malformed(f"{kind}: unknown field(s) {sorted(set(values) - expected)}")
        args = {}
        for name, (spec, has_default) in schema.items():
            if messages and name == "sender":
                if self.sender is None:
                    raise Malformed(f"{kind}: a message that needs a sender, read without one")
                args[name] = self.sender
                continue
            if name not in values:
                if has_default:
                    continue
                raise Malformed(f"{kind}: no {name}")
            args[name] = self.field(kind, name, spec, values[name], depth + 1)
        msg = cls(**args)
        receipt = getattr(msg, "receipt", None)
        if isinstance(receipt, Receipt) and self.sender is not None and receipt.sender != self.sender:
            raise Malformed(f"{kind}: a receipt of {receipt.sender!r} sent by {self.sender!r}")
        return msg

    def field(self, kind: str, name: str, spec: str, raw: Any, depth: int) -> Any:
        try:
            return self.typed(spec, raw, depth, (kind, name))
        except Malformed as exc:
            raise Malformed(f"{kind}.{name}: {exc}") from None

    def typed(self, spec: str, raw: Any, depth: int, where: tuple[str, str]) -> Any:
        if depth > MAX_DEPTH:
            raise Malformed(f"nested deeper than {MAX_DEPTH}")
        spec = spec.strip()
        if "|" in spec and not spec.startswith(("tuple[", "dict[", "list[")):
            options = [s.strip() for s in spec.split("|")]
            if raw is None and "None" in options:
                return None
            options = [o for o in options if o != "None"]
            if len(options) == 1:
                return self.typed(options[0], raw, depth, where)
            return self.any(raw, depth)
        if spec == "int":
            if type(raw) is not int or not _WHOLE[0] <= raw < _WHOLE[1]:
                raise Malformed(f"{raw!r} is not a whole number from {_WHOLE[0]}")
            return raw
        if spec == "float":
            if type(raw) not in (int, float):
                raise Malformed(f"{raw!r} is not a number")
            value = float(raw)
            if not _BOUNDS.get(where, _finite)(value):
                raise Malformed(f"{value!r} is out of bounds")
            return value
        if spec == "str":
            if type(raw) is not str or len(raw) > 4096:
                raise Malformed("not a string (of at most 4096 characters)")
            return raw
        if spec == "bool":
            if type(raw) is not bool:
                raise Malformed(f"{raw!r} is not true or false")
            return raw
        if spec == "bytes":
            value = self.any(raw, depth)
            if type(value) is not bytes:
                raise Malformed("not bytes")
            return value
        if spec in ("torch.Tensor", "Tensor"):
            value = self.any(raw, depth)
            if not isinstance(value, torch.Tensor):
                raise Malformed("not a tensor")
            return value
        if spec.startswith("tuple[") and spec.endswith(", ...]"):
            inner = spec[len("tuple["):-len(", ...]")]
            if not isinstance(raw, dict) or set(raw) != {"$u"} or not isinstance(raw["$u"], list):
                raise Malformed("not a tuple")
            return tuple(self.typed(inner, x, depth + 1, where) for x in raw["$u"])
        if spec in _RECORDS:
            return self.record(raw, depth, want=_RECORDS[spec])
        if spec == "Route":
            return self.record(raw, depth, want=Route)
        if spec == "dict":
            value = self.any(raw, depth)
            if not isinstance(value, dict):
                raise Malformed("not a dict")
            return value
        if spec == "list":
            value = self.any(raw, depth)
            if not isinstance(value, list):
                raise Malformed("not a list")
            return value
        if spec == "tuple":
            value = self.any(raw, depth)
            if not isinstance(value, tuple):
                raise Malformed("not a tuple")
            return value
        if spec == "Any":
            return self.any(raw, depth)
        raise Malformed(f"a field of a type this wire does not read ({spec})")

    def any(self, raw: Any, depth: int) -> Any:
        """Data of any of the wire's kinds (numbers, strings, lists, tuples, dicts, bytes, tensors,
        records)."""
        if depth > MAX_DEPTH:
            raise Malformed(f"nested deeper than {MAX_DEPTH}")
        t = type(raw)
        if raw is None or t is bool or t is int or t is str:
            return raw
        if t is float:
            return raw
        if t is list:
            return [self.any(x, depth + 1) for x in raw]
        if t is not dict or len(raw) not in (1, 2, 3):
            raise Malformed(f"a value of kind {t.__name__}")
        if "$u" in raw and len(raw) == 1 and type(raw["$u"]) is list:
            return tuple(self.any(x, depth + 1) for x in raw["$u"])
        if "$m" in raw and len(raw) == 1 and type(raw["$m"]) is list:
            out = {}
            for pair in raw["$m"]:
                if type(pair) is not list or len(pair) != 2:
                    raise Malformed("a dict entry that is not a pair")
                key = self.any(pair[0], depth + 1)
                if not _hashable(key):
                    raise Malformed("a dict key that is not a number, string or tuple of them")
                out[key] = self.any(pair[1], depth + 1)
            return out
        if "$b" in raw and len(raw) == 1 and type(raw["$b"]) is str:
            try:
                return base64.b64decode(raw["$b"], validate=True)
            except ValueError:
                raise Malformed("bytes that are not base64") from None
        if "$t" in raw:
            return self.tensor(raw)
        if "$c" in raw:
            return self.record(raw, depth)
        raise Malformed("a value of no kind this wire knows")

    def tensor(self, raw: dict) -> torch.Tensor:
        index, dtype_name, shape = raw.get("$t"), raw.get("d"), raw.get("s")
        if set(raw) != {"$t", "d", "s"} or type(index) is not int or not 0 <= index < len(self.buffers):
            raise Malformed("a tensor that names no buffer")
        if index in self.used:
            raise Malformed("two tensors in one buffer")
        dtype = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise Malformed(f"a tensor of dtype {dtype_name!r} (one of {', '.join(DTYPES)})")
        if type(shape) is not list or len(shape) > MAX_DIMS or any(type(n) is not int or n < 0 for n in shape):
            raise Malformed(f"a tensor shape {shape!r} (at most {MAX_DIMS} sizes, none negative)")
        buf = self.buffers[index]
        count = math.prod(shape)
        size = count * torch.empty((), dtype=dtype).element_size()
        if len(buf) != size:
            raise Malformed(f"a {dtype_name} tensor of shape {tuple(shape)} in {len(buf)} bytes (it takes {size})")
        self.used.add(index)
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).view(shape)


def _hashable(key: Any) -> bool:
    if type(key) in (int, str, bool) or key is None:
        return True
    return type(key) is tuple and all(_hashable(k) for k in key)


@functools.cache
def _schema(cls: type) -> dict[str, tuple[str, bool]]:
    """Field name -> (its annotation, whether it has a default), of a message or record class."""
    return {f.name: (f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "Any"),
                     f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)
            for f in dataclasses.fields(cls)}


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def kinds() -> Iterable[str]:
    """The names of the messages this wire carries."""
    return _MESSAGES.keys()
