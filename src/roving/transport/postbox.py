"""Mailboxes for data from processes that are not trusted: raw frames in, the writer's identity with them.

A :class:`Postbox` is a mailbox of this process that every member of the session may write to,
untrusted ones included (:attr:`.identity.Peer.trusted`), and that only this process reads. Its items
are the writer's frames as they came, never unpickled by the transport: what they mean is the reader's
to decode (a data-only codec, as :mod:`roving.pipeline.runtime.codec`). Each item comes with its writer
(:class:`Letter`), the node id that the writer's connection authenticated: never anything the
frames say. What one untrusted writer may leave waiting is bounded (``untrusted_bytes``); what it puts
beyond that is refused and counted (:meth:`Postbox.overflowed`), so a flood from one writer neither
fills the reader's memory nor holds up the others.

A :class:`Slot` is a writer's handle on a postbox (made from its :class:`PostboxAddress`, which is
plain data and can be told to anyone): ``send`` hands the frames to the transport without waiting for
an answer; ``confirm`` waits until everything sent before it has arrived.
"""
from __future__ import annotations

import dataclasses
import queue as _queue
from typing import Any, Dict, List, Optional

from . import node as _node
from . import session as _session
from .endpoint import abandon as _abandon
from .mailbox import Access

#: What one untrusted writer may leave unread in a postbox by default.
UNTRUSTED_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class PostboxAddress:
    """Where a postbox is: its node's address and the mailbox's id there (plain data)."""
    node: str
    box: int


@dataclasses.dataclass(frozen=True)
class Letter:
    """One item of a postbox: ``frames`` as their writer sent them, and ``writer``, the node id its
    connection authenticated (this process's own for a local send)."""
    writer: str
    frames: List[Any]


class Postbox:
    """A mailbox of this process for raw frames from any member of the session, trusted or not; only
    this process reads it. Thread-safe."""

    def __init__(self, untrusted_bytes: int = UNTRUSTED_BYTES) -> None:
        self._node = _session.current().node()
        self._box = self._node.mailboxes.new_box(
            access=Access(untrusted=True, stamp=True, untrusted_bytes=untrusted_bytes))
        self.address = PostboxAddress(self._node.address, self._box)

    def get(self, timeout: Optional[float] = None) -> Letter:
        """The oldest item, waiting up to ``timeout`` seconds (None: for ever); queue.Empty when none
        came, OSError when the postbox was closed."""
        wait = -1 if timeout is None else max(0.0, timeout)
        status, frames = self._node.mailboxes.call_local(_node.GET, self._box, wait)
        if status == _node.OK and frames:
            return Letter(bytes(frames[0]).decode(errors="replace"), list(frames[1:]))
        if status == _node.ERROR:
            raise OSError(bytes(frames[0]).decode(errors="replace") if frames else "the postbox was closed")
        raise _queue.Empty

    def overflowed(self) -> Dict[str, int]:
        """The untrusted writers whose items were refused since the last call (they held as much
        unread here as they may), with how many."""
        return self._node.mailboxes.overflowed(self._box)

    def close(self) -> None:
        """Stop taking items; what waits is dropped."""
        self._node.mailboxes.drop_box(self._box)


class Slot:
    """A writer's handle on the postbox at ``address``."""

    def __init__(self, address: PostboxAddress) -> None:
        self.address = address
        self._endpoint = _session.current().endpoint(address.node)

    def send(self, frames: List[Any]) -> None:
        """Hand ``frames`` to the transport for the postbox (in order with this process's other sends
        there); does not wait for them to arrive. OSError when the postbox's process cannot be reached."""
        self._endpoint.tell(_node.PUT_NOREPLY, self.address.box, frames)

    def confirm(self, timeout: float) -> bool:
        """True once everything this process sent to the postbox before the call has arrived (a round
        trip behind them), within ``timeout`` seconds."""
        status, _ = self._endpoint.call(_node.SIZE, self.address.box, timeout)
        return status == _node.OK

    def abandon(self) -> None:
        """The postbox's process is known to be gone: what was sent there without an answer is given
        up (see :meth:`roving.queues.Queue.abandon`)."""
        _abandon(self.address.node)
