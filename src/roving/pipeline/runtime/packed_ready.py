"""The packed layout of ``Ready``: its incarnation and its inbox's address (``PostboxAddress``), no JSON.

One header frame: a mark (``packed.MARK``), the tag, the incarnation and the inbox's mailbox id (int64),
the length of the inbox's node address, then that address (UTF-8). The reader checks what the JSON form's
reader checks: both whole numbers from the wire's least below its bound, the address UTF-8 of at most
``max_str`` characters, the header exactly as long as its parts. A ``Ready`` whose inbox is anything but
a ``PostboxAddress`` of a string and a whole number (or a number beyond int64) is not packed (``write``
returns None): ``codec`` writes it in the JSON form, judged as before.
"""
from __future__ import annotations

import struct
from typing import Any

from ...transport.postbox import PostboxAddress
from ..errors import Malformed
from .packed import MARK

_new = object.__new__


class ReadyLayout:
    """``Ready``'s packed writer and reader (``cls``: ``protocol.Ready``; ``tag``: its place on the wire)."""

    buffers = 0
    sender = True
    _FIXED = struct.Struct("<BBqqI")

    def __init__(self, cls: type, tag: int, whole: tuple[int, int], max_str: int) -> None:
        self.cls, self.tag, self.whole, self.max_str = cls, tag, whole, max_str
        self.put_sender, self.put_incarnation, self.put_inbox = (
            vars(cls)[name].__set__ for name in ("sender", "incarnation", "inbox"))

    def write(self, msg: Any) -> bytes | None:
        """``msg`` packed, or None where its inbox or incarnation is not of the shape this layout carries."""
        inbox = msg.inbox
        if type(inbox) is not PostboxAddress or type(inbox.node) is not str or type(inbox.box) is not int \
                or type(msg.incarnation) is not int:
            return None
        node = inbox.node.encode()
        try:
            return self._FIXED.pack(MARK, self.tag, msg.incarnation, inbox.box, len(node)) + node
        except struct.error:  # a number beyond int64
            return None

    def read(self, buf: Any, sender: str | None) -> Any:
        """The ``Ready`` a packed header holds; Malformed where it does not fit."""
        end, size = len(buf), self._FIXED.size
        if end < size:
            raise Malformed(f"Ready: a packed header of {end} bytes (at least {size})")
        _, _, incarnation, box, n = self._FIXED.unpack_from(buf)
        lo, hi = self.whole
        if not (lo <= incarnation < hi and lo <= box < hi):
            raise Malformed(f"Ready: incarnation {incarnation} or mailbox {box} is not a whole number from {lo}")
        if size + n != end:
            raise Malformed(f"Ready: a packed header of {end} bytes whose parts take {size + n}")
        try:
            node = str(buf[size:end], "utf-8")
        except UnicodeDecodeError:
            raise Malformed("Ready.inbox: an address that is not UTF-8") from None
        if len(node) > self.max_str:
            raise Malformed(f"Ready.inbox: an address of more than {self.max_str} characters")
        address = _new(PostboxAddress)
        address.__dict__.update(node=node, box=box)
        obj: Any = _new(self.cls)
        self.put_sender(obj, sender)
        self.put_incarnation(obj, incarnation)
        self.put_inbox(obj, address)
        return obj
