"""Receipts: what makes every tensor a stage process sends attributable to it (``[verify]``; issue 32).

With verification on, each activation, gradient and gradient share a stage process sends travels with a
``Receipt``: who sent it, for which round, microbatch and hop, a digest of the tensor's bytes as sent
(BLAKE3, its dtype and shape included), and an HMAC-SHA256 over all of that under the sender's *receipt key*.
The coordinator derives one receipt key per node from a random run key that only it holds
(``node_key``) and gives each node its own in its start-up settings, which travel over roving's
authenticated, encrypted channel. So:

- only the node itself and the coordinator can make a receipt in a node's name: a peer that holds a
  receipt cannot alter it or make one for another node (``genuine`` fails);
- a receipt binds its sender to exactly one tensor (``matches``): a peer that kept a tensor cannot show
  another one in its place;
- nodes cannot check each other's MACs (only the coordinator can), but a receiver checks the digest of
  what it got at once (``matches``): a tensor that does not match its receipt is reported at once.

The receipts are what the coordinator's checks (``verify``) read: "X sent this tensor for that hop" is
proven by X's receipt, whoever shows it.

``weights_digest`` is the same digest over a stage's weights: what a replica reports of the weights it
holds after each step (``protocol.Stepped.weights``), for ``verify`` to compare with its replicas'.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Any, Mapping

import blake3
import torch

from ..protocol import Message
from .tensor_id import TensorId


@dataclass(frozen=True, slots=True)
class Receipt(Message):
    """``id.sender`` sent the tensor ``id`` names (``tensor_id.TensorId``), whose digest is ``digest``;
    ``mac``: the sender's HMAC over both (``TensorId.body``)."""

    id: TensorId
    digest: bytes
    mac: bytes


def node_key(run_key: bytes, name: str) -> bytes:
    """Node ``name``'s receipt key: derived from the coordinator's ``run_key``, which no node holds."""
    return hmac.new(run_key, b"roving-receipt-key:" + name.encode(), hashlib.sha256).digest()


def digest(tensor: torch.Tensor) -> bytes:
    """A digest of ``tensor``'s dtype, shape and bytes (BLAKE3, 32 bytes; of a CPU copy when it is
    elsewhere). Every process of a run hashes with it, sender and receiver alike."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    # BLAKE3 (one thread; it lets go of the GIL over large buffers): on this project's machines 2 to 5
    # times SHA-256 with the SHA extensions (benchmarks/RESULTS.md, measured at ff41722); every tensor sent
    # is hashed
    h = blake3.blake3()
    _update(h, t)
    return h.digest()


def weights_digest(state: Mapping[str, torch.Tensor]) -> bytes:
    """A digest of a stage's weights as ``state`` holds them (a state dict: every name, and each tensor's
    dtype, shape and bytes, by name), BLAKE3 like ``digest``: two processes hold bitwise equal weights
    exactly when their digests are equal (but for a collision)."""
    h = blake3.blake3()
    for name in sorted(state):
        h.update(name.encode() + b"\0")
        t = state[name].detach()
        _update(h, (t.to("cpu") if t.device.type != "cpu" else t).contiguous())
    return h.digest()


def _update(h: Any, t: torch.Tensor) -> None:
    h.update(f"{t.dtype}:{tuple(t.shape)}".encode())
    if t.numel():
        h.update(t.view(-1).view(torch.uint8).numpy().data)


def seal(key: bytes, tensor_id: TensorId, tensor: torch.Tensor) -> Receipt:
    """The receipt of ``tensor_id.sender`` for ``tensor`` as ``tensor_id``, made with its receipt ``key``."""
    dig = digest(tensor)
    return Receipt(tensor_id, dig, hmac.new(key, tensor_id.body(dig), hashlib.sha256).digest())


def genuine(key: bytes, receipt: object) -> bool:
    """Whether ``receipt`` is a Receipt made with ``key`` (its sender's), unaltered."""
    if not isinstance(receipt, Receipt) or not isinstance(receipt.id, TensorId) or \
            not isinstance(receipt.digest, bytes) or not isinstance(receipt.mac, bytes):
        return False
    want = hmac.new(key, receipt.id.body(receipt.digest), hashlib.sha256).digest()
    return hmac.compare_digest(want, receipt.mac)


def matches(receipt: object, tensor: object) -> bool:
    """Whether ``tensor`` is the tensor ``receipt`` names (by its digest)."""
    return isinstance(receipt, Receipt) and isinstance(tensor, torch.Tensor) and \
        hmac.compare_digest(receipt.digest, digest(tensor))
