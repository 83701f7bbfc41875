"""Where the pipeline's messages are read and written: inboxes that know who wrote, outboxes that send data.

An :class:`Inbox` is a postbox of this process (:class:`roving.transport.postbox.Postbox`): any process
of the run may write to it, a stage process that runs code of its own included, and what it reads is
decoded by the data-only wire (:mod:`.codec`), never unpickled. Each message's ``sender`` is the name
that the inbox's :class:`Directory` gives the node id its writer's connection authenticated; a letter
from a node id the directory does not know, or one that does not decode, is not a message: the inbox
counts it against its writer (:meth:`Inbox.refused`) and reads on. ``accept`` (optional) refuses
messages a writer may not send (the coordinator's messages from anyone but the coordinator).

An :class:`Outbox` writes to one inbox, from its :class:`~roving.transport.postbox.PostboxAddress`
(plain data, told to others in messages); ``put`` encodes and hands over without waiting.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from ...transport import postbox
from ...transport.postbox import PostboxAddress
from . import codec
from .. import protocol as m
from ..errors import Malformed

log = logging.getLogger(__name__)

#: ``accept(name, msg)``: None when ``name`` may send ``msg``, else why not.
Accept = Callable[[str, m.Message], "str | None"]


class Directory:
    """Node ids and the names they go by in the run (the coordinator's is ``protocol.COORDINATOR``);
    thread-safe. Who is in it is the directory owner's word: the coordinator's for a stage process."""

    def __init__(self, names: dict[str, str] | None = None) -> None:
        self._names: dict[str, str] = dict(names or {})
        self._lock = threading.Lock()

    def add(self, node_id: str, name: str) -> None:
        with self._lock:
            self._names[node_id] = name

    def drop(self, name: str) -> None:
        with self._lock:
            for node_id in [i for i, n in self._names.items() if n == name]:
                del self._names[node_id]

    def name(self, node_id: str) -> str | None:
        return self._names.get(node_id)

    def ids_of(self, name: str) -> list[str]:
        """The node ids that go by ``name`` now."""
        with self._lock:
            return [i for i, n in self._names.items() if n == name]


class Inbox:
    """This process's inbox: decoded messages, each with the sender its connection proved."""

    def __init__(self, directory: Directory, accept: Accept | None = None) -> None:
        self.directory = directory
        self._accept = accept
        self._box = postbox.Postbox()
        self.address: PostboxAddress = self._box.address
        #: Writers (by name, or by node id when the directory has none for it) with what they sent that
        #: was refused: (how many, the first reason); taken by :meth:`refused`.
        self._refused: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()

    def get(self, block: bool = True, timeout: float | None = None) -> m.Message:
        """The next message; queue.Empty when none came within ``timeout`` (or at once, without
        ``block``). Letters that are not messages (refused) are skipped: those already waiting, and
        those that come within the same time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 0.0 if not block else (None if deadline is None else max(0.0, deadline - time.monotonic()))
            letter = self._box.get(left)
            msg = self.read(letter)
            if msg is not None:
                return msg

    def get_nowait(self) -> m.Message:
        return self.get(False)

    def read(self, letter: postbox.Letter) -> m.Message | None:
        """The message of ``letter``, or None when it is refused (counted against its writer)."""
        name = self.directory.name(letter.writer)
        if name is None:
            self._refuse(letter.writer, "a process this inbox does not know wrote to it")
            return None
        try:
            msg = codec.decode(letter.frames, name)
        except Malformed as exc:
            self._refuse(name, str(exc))
            return None
        why = self._accept(name, msg) if self._accept is not None else None
        if why is not None:
            self._refuse(name, why)
            return None
        return msg

    def _refuse(self, writer: str, why: str) -> None:
        with self._lock:
            count, first = self._refused.get(writer, (0, why))
            self._refused[writer] = (count + 1, first)
        if not count:
            log.warning("pipeline inbox: refused a message of %s: %s", writer, why)

    def refused(self) -> dict[str, tuple[int, str]]:
        """The writers whose letters were refused since the last call: name (or node id) -> (how many,
        the first reason); those that wrote more than the inbox holds unread are among them."""
        for node_id, count in self._box.overflowed().items():
            self._refuse(self.directory.name(node_id) or node_id, f"{count} message(s) over what it may leave unread")
        with self._lock:
            taken, self._refused = self._refused, {}
        return taken

    def close(self) -> None:
        self._box.close()


class Outbox:
    """Writes messages to the inbox at ``address``; the ``Queue``-like surface the senders use."""

    def __init__(self, address: PostboxAddress) -> None:
        if not isinstance(address, PostboxAddress):
            raise TypeError(f"an inbox's address is a PostboxAddress, not {type(address).__name__}")
        self.address = address
        self._slot = postbox.Slot(address)

    def put(self, msg: m.Message) -> None:
        """Encode ``msg`` and hand it over (OSError when its process cannot be reached)."""
        self._slot.send(codec.encode(msg))

    def reachable(self, timeout: float) -> bool:
        """Whether the inbox's process answers (a round trip behind everything put before) within
        ``timeout`` seconds; False when it does not, or cannot be reached at all."""
        try:
            return self._slot.confirm(timeout)
        except OSError:
            return False

    def qsize(self) -> int:
        """A round trip behind everything put before it (what the senders' ``confirm`` needs); 0."""
        if not self._slot.confirm(60.0):
            raise OSError(f"the inbox at {self.address.node} did not answer within 60 s")
        return 0

    def abandon(self) -> None:
        self._slot.abandon()

    def __repr__(self) -> str:
        return f"<Outbox {self.address.node}#{self.address.box}>"


def coordinator_only(name: str, msg: m.Message) -> str | None:
    """``accept`` for a stage process's inbox: the coordinator's messages come from it alone, and a
    stage process's only from a stage process."""
    from_coordinator = name == m.COORDINATOR
    if isinstance(msg, m.COORDINATOR_MESSAGES) != from_coordinator:
        return (f"{type(msg).__name__} from {name}: only the coordinator sends it" if not from_coordinator
                else f"{type(msg).__name__} from the coordinator: only stage processes send it")
    return None
