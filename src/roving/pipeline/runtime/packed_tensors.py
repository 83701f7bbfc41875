"""The packed layout of the per-microbatch messages: ``Forward``, ``Backward`` and ``Gradients``, no JSON.

Such a message travels as two frames: a header and its tensor's raw bytes. The header is a mark
(``packed.MARK``), the message's tag, its whole numbers (``round``, ``mb``, ``hop``; ``round``, ``count``)
as int64, the tensor's dtype (its place in the wire's dtypes) and number of dimensions, the route's
length, whether a receipt follows, the lengths of the receipt's digest and MAC and of one text; then in
one cached ``struct`` the tensor's shape, the route's stages and the receipt's round, microbatch and
hop; then the text (the route's origin and nodes, the receipt's kind and sender, NUL-separated) and the
digest and MAC. The reader checks what the JSON form's reader checks, in the same bounds, before
anything is made: every whole number from the wire's least below its bound, the dtype one of the wire's,
at most ``max_dims`` dimensions, no size negative, the tensor's buffer exactly as long as its dtype and
shape say (the tensor is a view of the bytes received: nothing is allocated that they do not hold),
every string UTF-8 of at most ``max_str`` characters, the receipt's kind one of ``WHATS`` and its sender
the message's, and every length against the bytes received, nothing left over. The receiver checks the
shape against its plan, as it does for the JSON form. A message of another shape (a route or receipt
that is not one, a NUL in a name, a number beyond int64) is not packed (``write`` returns None): ``codec``
writes it in the JSON form, judged as before.
"""
from __future__ import annotations

import functools
import math
import struct
from typing import Any, Callable

import numpy as np
import torch

from ..errors import Malformed
from ..planning.plan import Route
from ..verify.receipts import Receipt
from ..verify.tensor_id import WHATS, TensorId
from .packed import MARK

#: the most entries a packed route may hold (a longer one goes in the JSON form)
MAX_ROUTE = 4096
_NO_RECEIPT, _RECEIPT = 0, 1
_WHAT_SET = frozenset(WHATS)
# a receipt and its identity made through their slots' descriptors: their __init__ checks nothing
_new = object.__new__
_ID_SETTERS = [getattr(TensorId, n).__set__ for n in ("round", "what", "mb", "hop", "sender")]
_RECEIPT_SETTERS = [getattr(Receipt, n).__set__ for n in ("id", "digest", "mac")]


def _numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    """``dtype``'s numpy twin, None where numpy has none (bfloat16)."""
    try:
        return torch.empty((), dtype=dtype).numpy().dtype
    except TypeError:
        return None


@functools.lru_cache(maxsize=128)
def _tail(dims: int, hops: int, receipt: int) -> struct.Struct:
    """The shape, the stages and the receipt's round, microbatch and hop of a header (dims and hops bounded
    by the reader before this is asked: at most 9 x 4097 x 2 formats)."""
    return struct.Struct("<" + "q" * (dims + hops + 3 * receipt))


class TensorLayout:
    """One class's packed writer and reader: ``ints``, its whole-number fields in order; ``tensor``, its
    tensor field; ``route``: whether it has one (``Forward``, ``Backward``)."""

    buffers = 1  # the tensor's bytes, after the header
    sender = True

    def __init__(self, cls: type, tag: int, ints: list[str], tensor: str, route: bool, *,
                 whole: tuple[int, int], dtypes: dict[str, torch.dtype], max_dims: int, max_str: int,
                 write_tensor: Callable[[Any, list], list]) -> None:
        self.cls, self.tag, self.kind = cls, tag, cls.__name__
        self.ints, self.tensor, self.route = ints, tensor, route
        self.whole, self.max_dims, self.max_str = whole, max_dims, max_str
        self.names = list(dtypes)
        self.dtypes = [dtypes[n] for n in self.names]
        self.itemsizes = [torch.empty((), dtype=d).element_size() for d in self.dtypes]
        self.numpy = [_numpy_dtype(d) for d in self.dtypes]
        self.codes = {n: i for i, n in enumerate(self.names)}
        self.write_tensor = write_tensor
        # mark, tag, whole numbers, dtype, dimensions, route's length, receipt?, digest's, MAC's and text's lengths
        self.fixed = struct.Struct("<BB" + "q" * len(ints) + "BBHBHHI")
        self.mark = (MARK, tag)
        self.put_ints = [getattr(cls, name).__set__ for name in ints]
        self.put_sender, self.put_tensor, self.put_receipt = (getattr(cls, name).__set__
                                                              for name in ("sender", tensor, "receipt"))
        self.put_route = vars(cls)["route"].__set__ if route else None

    def write(self, msg: Any) -> list | None:
        """``msg``'s frames (its header, its tensor's bytes), or None where it holds what this layout does not
        carry. TypeError where its tensor is not one the wire carries (as the JSON form's writer)."""
        ints = [getattr(msg, n) for n in self.ints]
        if any(type(v) is not int for v in ints):
            return None
        route, receipt = getattr(msg, "route", None), msg.receipt
        parts: list[str] = []
        numbers: list[int] = []
        hops = 0
        if self.route:
            if type(route) is not Route or type(route.nodes) is not tuple or type(route.stages) is not tuple \
                    or len(route.nodes) != len(route.stages) or len(route.nodes) > MAX_ROUTE:
                return None
            parts += [route.origin, *route.nodes]
            numbers += route.stages
            hops = len(route.nodes)
        digest = mac = b""
        if receipt is not None:
            key = receipt.id if type(receipt) is Receipt else None
            if type(key) is not TensorId or type(receipt.digest) is not bytes or type(receipt.mac) is not bytes:
                return None
            parts += [key.what, key.sender]
            numbers += (key.round, key.mb, key.hop)
            digest, mac = receipt.digest, receipt.mac
        if any(type(p) is not str for p in parts) or any(type(v) is not int for v in numbers):
            return None
        tensor = getattr(msg, self.tensor)
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in self.dtypes:
            return None
        buffers: list = []
        _, dtype, shape = self.write_tensor(tensor, buffers)
        text = "\0".join(parts).encode()
        if text.count(b"\0") != max(0, len(parts) - 1) or len(shape) > self.max_dims:
            return None  # a NUL inside a name
        try:
            head = self.fixed.pack(*self.mark, *ints, self.codes[dtype], len(shape), hops,
                                   _NO_RECEIPT if receipt is None else _RECEIPT, len(digest), len(mac), len(text))
            tail = _tail(len(shape), hops, receipt is not None).pack(*shape, *numbers)
        except struct.error:  # a number beyond int64, a digest of more than 64 KiB
            return None
        return [b"".join((head, tail, text, digest, mac)), buffers[0]]

    def read(self, frames: list[Any], sender: str) -> Any:
        """The message ``frames`` (a packed header of this class and its tensor's bytes) hold; Malformed
        where they do not fit."""
        buf, kind = frames[0], self.kind
        end, fixed = len(buf), self.fixed
        if end < fixed.size:
            raise Malformed(f"{kind}: a packed header of {end} bytes (at least {fixed.size})")
        *ints, code, dims, hops, has_receipt, n_digest, n_mac, n_text = fixed.unpack_from(buf)[2:]
        lo, hi = self.whole
        if min(ints) < lo or max(ints) >= hi:
            name, v = next((n, v) for n, v in zip(self.ints, ints) if not lo <= v < hi)
            raise Malformed(f"{kind}.{name}: {v!r} is not a whole number from {lo}")
        if code >= len(self.dtypes) or dims > self.max_dims or has_receipt > _RECEIPT \
                or (hops and not self.route) or hops > MAX_ROUTE:
            raise Malformed(f"{kind}: a packed header of dtype {code} (of {len(self.dtypes)}), {dims} dimensions "
                            f"(at most {self.max_dims}), a route of {hops} (at most {MAX_ROUTE}"
                            f"{'' if self.route else '; it has none'}), receipt {has_receipt}")
        tail = _tail(dims, hops, has_receipt)
        pos = fixed.size + tail.size
        if pos + n_text + n_digest + n_mac != end:
            raise Malformed(f"{kind}: a packed header of {end} bytes whose parts take "
                            f"{pos + n_text + n_digest + n_mac}")
        numbers = tail.unpack_from(buf, fixed.size)
        shape = numbers[:dims]
        if shape and min(shape) < 0:
            raise Malformed(f"{kind}.{self.tensor}: a tensor shape {shape} (no size negative)")
        if numbers[dims:] and (min(numbers[dims:]) < lo or max(numbers[dims:]) >= hi):
            raise Malformed(f"{kind}: a stage or receipt's number that is not a whole number from {lo}")
        want = (1 + hops if self.route else 0) + 2 * has_receipt
        try:
            parts = str(buf[pos:pos + n_text], "utf-8").split("\0") if want else []
        except UnicodeDecodeError:
            raise Malformed(f"{kind}: names that are not UTF-8") from None
        if len(parts) != want or (n_text and not want) or any(len(p) > self.max_str for p in parts):
            raise Malformed(f"{kind}: {len(parts)} names for a route of {hops} and {has_receipt} receipt "
                            f"(each of at most {self.max_str} characters)")
        tensor = self._tensor(frames[1], code, shape)
        obj: Any = _new(self.cls)
        for put, v in zip(self.put_ints, ints):
            put(obj, v)
        self.put_sender(obj, sender)
        self.put_tensor(obj, tensor)
        if self.put_route is not None:
            route = _new(Route)
            route.__dict__.update(origin=parts[0], nodes=tuple(parts[1:1 + hops]), stages=numbers[dims:dims + hops])
            self.put_route(obj, route)
        self.put_receipt(obj, self._receipt(buf, pos + n_text, n_digest, n_mac, numbers[dims + hops:], parts[-2:],
                                          sender) if has_receipt else None)
        return obj

    def _tensor(self, buf: Any, code: int, shape: tuple) -> torch.Tensor:
        size = math.prod(shape) * self.itemsizes[code]
        if len(buf) != size:
            raise Malformed(f"{self.kind}.{self.tensor}: a {self.names[code]} tensor of shape {shape} in "
                            f"{len(buf)} bytes (it takes {size})")
        if not size:
            return torch.empty(shape, dtype=self.dtypes[code])
        numpy_dtype = self.numpy[code]
        if numpy_dtype is not None:  # (numpy's reshape and from_numpy: about half of torch's view)
            return torch.from_numpy(np.frombuffer(buf, numpy_dtype).reshape(shape))
        return torch.frombuffer(buf, dtype=self.dtypes[code]).view(shape)

    def _receipt(self, buf: Any, pos: int, n_digest: int, n_mac: int, numbers: tuple, names: list[str],
                 sender: str) -> Receipt:
        what, by = names
        if what not in _WHAT_SET:
            raise Malformed(f"{self.kind}.receipt: {what[:40]!r} is not what a tensor can be ({', '.join(WHATS)})")
        if by != sender:
            raise Malformed(f"{self.kind}: a receipt of {by!r} sent by {sender!r}")
        key: Any = _new(TensorId)
        for put, v in zip(_ID_SETTERS, (numbers[0], what, numbers[1], numbers[2], by)):
            put(key, v)
        receipt: Any = _new(Receipt)
        for put, v in zip(_RECEIPT_SETTERS, (key, bytes(buf[pos:pos + n_digest]),
                                             bytes(buf[pos + n_digest:pos + n_digest + n_mac]))):
            put(receipt, v)
        return receipt


def layouts(first_tag: int, forward: type, backward: type, gradients: type, **common: Any) -> list[TensorLayout]:
    """The layouts of ``Forward``, ``Backward`` and ``Gradients``, tagged from ``first_tag`` on (both ends
    share the order); ``common``: the wire's bounds, dtypes and tensor writer (``TensorLayout``)."""
    return [TensorLayout(forward, first_tag, ["round", "mb", "hop"], "tensor", True, **common),
            TensorLayout(backward, first_tag + 1, ["round", "mb", "hop"], "tensor", True, **common),
            TensorLayout(gradients, first_tag + 2, ["round", "count"], "flat", False, **common)]
