"""Pipe and Connection with the semantics of :mod:`multiprocessing.connection`.

Each direction of a pipe is a mailbox in the process that created the pipe. A Connection end can be sent
to any roving process of the session (as a Process argument or inside a message). ``recv`` raises
EOFError once nothing is left and no process holds the other end any more — it was closed everywhere,
or the processes holding it ended.

When the two ends are used by two different processes, they open a direct stream to each other and
messages skip the mailboxes (:mod:`roving.transport.link`): a round trip then costs about what a
multiprocessing Pipe's does, and large messages are not copied on the way. Everything above holds
either way; an end used by two processes at once (which multiprocessing does not support either) just
stays on the mailboxes.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Deque, List, Optional, Tuple

from .transport import rpc as _rpc
from . import config as _config
from .process_payload import pickling_for
from .stdlib_process import refuse_standard_start
from .queues import raise_error
from .transport import link as _link
from .transport import node as _node
from .transport import session as _session
from .transport import timeouts
from .transport.mailbox import TRANSIT
from .transport.serialize import dumps, loads

if TYPE_CHECKING:  # what typeshed calls the buffers multiprocessing's Connection takes
    from _typeshed import ReadableBuffer, WriteableBuffer

__all__ = ["Pipe", "Connection"]

log = logging.getLogger(__name__)
_RAW = _link.RAW_MARK  # marks a message sent with send_bytes
_open: "weakref.WeakSet[Connection]" = weakref.WeakSet()


def Pipe(duplex: bool = True) -> Tuple["Connection", "Connection"]:
    """Two connected ends. With ``duplex=False``, the first can only receive, the second only send."""
    node = _session.current().node()
    first_in = node.mailboxes.new_box(track_writers=True)
    second_in = node.mailboxes.new_box(track_writers=True) if duplex else None
    a = Connection._new(node.address, inbox=first_in, outbox=second_in)
    b = Connection._new(node.address, inbox=second_in, outbox=first_in)
    return a, b


class Connection:
    """One end of a Pipe."""

    @classmethod
    def _new(cls, address: str, inbox: Optional[int], outbox: Optional[int]) -> "Connection":
        self = cls.__new__(cls)
        self._address, self._inbox, self._outbox = address, inbox, outbox
        self._setup()
        self._hold(_session.current().uid)
        return self

    def _setup(self) -> None:
        self._endpoint = _session.current().endpoint(self._address)
        # What this end's direct stream sees of it (its stream, claim and closed state, under its lock).
        self._end = _link.End(self._address, self._endpoint, self._inbox, self._outbox)
        self._stash: Deque[Tuple[bytes, List[Any]]] = collections.deque()  # read, not yet returned
        _open.add(self)

    def _hold(self, key: str) -> None:
        if self._outbox is not None:
            self._endpoint.tell(_node.HOLD, self._outbox, [key.encode()])

    def _release(self, key: str) -> None:
        if self._outbox is not None:
            self._endpoint.tell(_node.RELEASE, self._outbox, [key.encode()])

    def __getstate__(self) -> tuple:
        self._check_closed()
        refuse_standard_start("Pipe's Connection")
        # Hold the writing end in the receiver's name before this copy leaves, so that the sender
        # closing its own copy right after cannot look like end-of-file to the reader.
        holder = pickling_for() or (TRANSIT.decode() + os.urandom(8).hex())
        self._let_go()
        self._hold(holder)
        return self._address, self._inbox, self._outbox, holder

    def __setstate__(self, state: tuple) -> None:
        self._address, self._inbox, self._outbox, holder = state
        self._setup()
        uid = _session.current().uid
        if holder != uid:
            self._hold(uid)
            self._release(holder)

    def __repr__(self) -> str:
        return f"<Connection {self._address}#{self._inbox}/{self._outbox}{' closed' if self._end.closed else ''}>"

    # -- state -------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._end.closed

    @property
    def readable(self) -> bool:
        return self._inbox is not None

    @property
    def writable(self) -> bool:
        return self._outbox is not None

    def _check_closed(self) -> None:
        if self._end.closed:
            raise OSError("handle is closed")

    def _check_readable(self) -> None:
        self._check_closed()
        if self._inbox is None:
            raise OSError("connection is write-only")

    def _check_writable(self) -> None:
        self._check_closed()
        if self._outbox is None:
            raise OSError("connection is read-only")

    def close(self) -> None:
        """Close this end in this process. The peer sees EOFError once no process holds it."""
        if not self._end.closed:
            self._end.closed = True
            try:
                self._let_go()
            except Exception as exc:  # the pipe's owner or the peer may be gone already
                log.debug("roving: closing a pipe end: %s", exc)
            try:
                self._release(_session.current().uid)
            except Exception:  # the pipe's owner may be gone already
                pass

    # -- direct streams ----------------------------------------------------------------------
    def _use(self) -> Optional[_link.Link]:
        """This end's stream, claiming the end on its first use in this process."""
        end = self._end
        if end.claim is None:
            end.claim = "claimed"
            try:
                _session.current().node().service("pipe-revoke", _RevokeServer)
                holder = _link.claim(end)
                if holder is not None:
                    _revoke_at(holder, self)
            except Exception as exc:  # the mailboxes work regardless
                log.debug("roving: pipe end stays on its mailbox: %s", exc)
        return end.link

    def _let_go(self) -> None:
        """This process stops using this end (pickled away or closed): leave its stream, give back what
        was read and not returned, and let another process claim it."""
        end = self._end
        with end.lock:
            link, end.link = end.link, None
            claimed = end.claim in ("claimed", "shared")
            if claimed:
                end.claim = "given"
            stash, self._stash = list(self._stash), collections.deque()
        if link is not None:
            link.unlink(stash)
        else:
            for kind, frames in reversed(stash):
                self._endpoint.tell(_node.PUT_FRONT, self._inbox, _link.as_item(kind, frames))
        if claimed:
            _link.unclaim(end)
        elif stash:
            self._endpoint.ping(30.0)

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- sending -----------------------------------------------------------------------------
    def _write(self, kind: bytes, frames: List[Any]) -> None:
        link = self._use()
        if link is not None and link.write(kind, frames):
            return
        self._endpoint.tell(_node.PUT_NOREPLY, self._outbox, _link.as_item(kind, frames))

    def send(self, obj: object) -> None:
        """Send a picklable object. Does not wait for the reader."""
        self._check_writable()
        self._write(_link.DATA, dumps(obj))

    def send_bytes(self, buf: ReadableBuffer, offset: int = 0, size: Optional[int] = None) -> None:
        """Send bytes from a bytes-like object, without pickling."""
        self._check_writable()
        view = memoryview(buf).cast("B")
        if offset < 0:
            raise ValueError("offset is negative")
        if len(view) < offset:
            raise ValueError("buffer length < offset")
        if size is None:
            size = len(view) - offset
        elif size < 0:
            raise ValueError("size is negative")
        elif offset + size > len(view):
            raise ValueError("buffer length < offset + size")
        self._write(_link.RAW, [view[offset:offset + size]])

    # -- receiving ---------------------------------------------------------------------------
    def _fetch(self, timeout: Optional[float]) -> int:
        """Make the next message ready in the stash within ``timeout`` s (None: as long as it takes).

        Returns OK (ready), EOF or EMPTY (nothing came in time).
        """
        deadline = timeouts.deadline(timeout)
        while True:
            if self._stash:
                return _node.OK
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            link = self._use()
            if link is not None and link.in_ == _link.OPEN:
                got = link.read(left)
                if got is None:
                    return _node.EMPTY
                kind, frames = got
                if kind != _link.BACK:
                    self._stash.append((kind, frames))
                continue
            status, frames = self._endpoint.call(_node.GET, self._inbox, -1 if left is None else left)
            if status == _node.OK:
                if _link.is_switch(frames):
                    link = self._end.link  # (opened while this call waited, maybe: it is set before)
                    if link is not None:
                        link.switch_in(frames)
                    continue  # a stream's switch item: not a message
                if len(frames[0]) == len(_RAW) and bytes(frames[0]) == _RAW:
                    self._stash.append((_link.RAW, frames[1:]))
                else:
                    self._stash.append((_link.DATA, frames))
                return _node.OK
            if status in (_node.EOF, _node.EMPTY):
                return status
            raise_error(frames)

    def _take(self) -> Tuple[bytes, List[Any]]:
        self._check_readable()
        if self._fetch(None) == _node.EOF:
            raise EOFError
        return self._stash.popleft()

    def recv(self) -> Any:
        """Receive an object. Blocks until one arrives; EOFError once the other end is closed."""
        kind, frames = self._take()
        return loads([frames[0]] if kind == _link.RAW else frames)

    def recv_bytes(self, maxlength: Optional[int] = None) -> bytes:
        """Receive a message sent by send_bytes (or the pickle of one sent by send)."""
        if maxlength is not None and maxlength < 0:
            raise ValueError("negative maxlength")
        kind, frames = self._take()
        data = frames[0] if type(frames[0]) is bytes else bytes(frames[0])
        if maxlength is not None and len(data) > maxlength:
            self.close()
            raise OSError("bad message length")
        return data

    def recv_bytes_into(self, buf: WriteableBuffer, offset: int = 0) -> int:
        """Receive a message into ``buf`` at ``offset``; returns its size."""
        view = memoryview(buf).cast("B")
        if offset < 0 or offset > len(view):
            raise ValueError("offset out of bounds")
        data = self.recv_bytes()
        if len(data) > len(view) - offset:
            from multiprocessing import BufferTooShort

            raise BufferTooShort(data)
        view[offset:offset + len(data)] = data
        return len(data)

    def poll(self, timeout: Optional[float] = 0.0) -> bool:
        """Whether there is something to read within ``timeout`` seconds (None: wait as long as it takes).

        True at end-of-file too, so that the following recv() raises EOFError, as in multiprocessing.
        """
        self._check_readable()
        return self._fetch(timeouts.limit(timeout)) != _node.EMPTY


# -- an end written by two processes ------------------------------------------------------------

_REVOKE = b"pipe-revoke"


class _RevokeServer(_rpc.Server):
    """Answers "stop writing to your stream" for the pipe ends this process claimed (see link.revoke)."""

    def __init__(self, node: Any) -> None:
        super().__init__(node, _REVOKE)

    def serve(self, ident: bytes, req_id: int, kind: int, frames: List[Any]) -> None:
        owner, inbox, outbox = json.loads(bytes(frames[0]))

        def run() -> None:  # off the I/O thread: stopping may wait for a send in progress
            try:
                _link.revoke(owner, int(inbox), int(outbox))
            finally:
                self.answer(ident, req_id, _rpc.OK)
        threading.Thread(target=run, name="roving-pipe-revoke", daemon=True).start()


def _revoke_at(node_address: str, end: "Connection") -> None:
    """Make the process at ``node_address``, which claimed ``end`` first, stop writing it to a stream
    before this process writes it to the mailbox: both then write to the one mailbox, in causal order."""
    try:
        caller = _rpc.Caller(node_address, _session.current().secret, _REVOKE, "the other process writing "
                             "this pipe end", connect_timeout=min(5.0, _config.current().connect_timeout))
    except ConnectionError as exc:  # it has ended: its stream ended with it
        log.debug("roving: %s", exc)
        return
    try:
        req_id = caller.submit([json.dumps([end._address, end._inbox or 0, end._outbox or 0]).encode()])
        if caller.collect(req_id, 30.0) is None:
            log.warning("roving: the process at %s did not leave its pipe stream within 30 s; messages "
                        "of this pipe end may arrive out of order", node_address)
    except ConnectionError as exc:
        log.debug("roving: %s", exc)
    finally:
        caller.close()


def close_all(timeout: float = 10.0) -> None:
    """Close every Connection of this process (a child does this as it exits), and wait up to
    ``timeout`` s for what their direct streams still carried to be back in the pipes' mailboxes."""
    for conn in list(_open):
        conn.close()
    _link.wait_relays(timeout)
