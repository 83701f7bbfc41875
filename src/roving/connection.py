"""Pipe and Connection with the semantics of :mod:`multiprocessing.connection`.

Each direction of a pipe is a mailbox in the process that created the pipe. A Connection end can be sent
to any roving process of the session (as a Process argument or inside a message). ``recv`` raises
EOFError once nothing is left and no process holds the other end any more — it was closed everywhere,
or the processes holding it ended.
"""
from __future__ import annotations

import os
import weakref
from typing import Any, Optional, Tuple

from . import process as _process
from .queues import raise_error, wait_time
from .transport import node as _node
from .transport import session as _session
from .transport.mailbox import TRANSIT
from .transport.serialize import dumps, loads

__all__ = ["Pipe", "Connection"]

_RAW = b"\x00roving-raw"  # marks a message sent with send_bytes
_open: "weakref.WeakSet[Connection]" = weakref.WeakSet()


def Pipe(duplex: bool = True) -> Tuple["Connection", "Connection"]:
    """Two connected ends. With ``duplex=False``, the first can only receive, the second only send."""
    node = _session.current().node()
    first_in = node.new_box(track_writers=True)
    second_in = node.new_box(track_writers=True) if duplex else None
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
        self._closed = False
        self._endpoint = _session.current().endpoint(self._address)
        _open.add(self)

    def _hold(self, key: str) -> None:
        if self._outbox is not None:
            self._endpoint.tell(_node.HOLD, self._outbox, [key.encode()])

    def _release(self, key: str) -> None:
        if self._outbox is not None:
            self._endpoint.tell(_node.RELEASE, self._outbox, [key.encode()])

    def __getstate__(self) -> tuple:
        self._check_closed()
        # Hold the writing end in the receiver's name before this copy leaves, so that the sender
        # closing its own copy right after cannot look like end-of-file to the reader.
        holder = _process.pickling_for() or (TRANSIT.decode() + os.urandom(8).hex())
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
        return f"<Connection {self._address}#{self._inbox}/{self._outbox}{' closed' if self._closed else ''}>"

    # -- state -------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def readable(self) -> bool:
        return self._inbox is not None

    @property
    def writable(self) -> bool:
        return self._outbox is not None

    def _check_closed(self) -> None:
        if self._closed:
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
        if not self._closed:
            self._closed = True
            try:
                self._release(_session.current().uid)
            except Exception:  # the pipe's owner may be gone already
                pass

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- sending -----------------------------------------------------------------------------
    def send(self, obj: Any) -> None:
        """Send a picklable object. Does not wait for the reader."""
        self._check_writable()
        self._endpoint.tell(_node.PUT_NOREPLY, self._outbox, dumps(obj))

    def send_bytes(self, buf: Any, offset: int = 0, size: Optional[int] = None) -> None:
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
        self._endpoint.tell(_node.PUT_NOREPLY, self._outbox, [_RAW, view[offset:offset + size]])

    # -- receiving ---------------------------------------------------------------------------
    def _take(self) -> list:
        self._check_readable()
        status, frames = self._endpoint.call(_node.GET, self._inbox, -1)
        if status == _node.OK:
            return frames
        if status == _node.EOF:
            raise EOFError
        raise_error(frames)

    def recv(self) -> Any:
        """Receive an object. Blocks until one arrives; EOFError once the other end is closed."""
        frames = self._take()
        if bytes(frames[0]) == _RAW:
            return loads([frames[1]])
        return loads(frames)

    def recv_bytes(self, maxlength: Optional[int] = None) -> bytes:
        """Receive a message sent by send_bytes (or the pickle of one sent by send)."""
        if maxlength is not None and maxlength < 0:
            raise ValueError("negative maxlength")
        frames = self._take()
        data = bytes(frames[1]) if bytes(frames[0]) == _RAW else bytes(frames[0])
        if maxlength is not None and len(data) > maxlength:
            self.close()
            raise OSError("bad message length")
        return data

    def recv_bytes_into(self, buf: Any, offset: int = 0) -> int:
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
        wait = -1.0 if timeout is None else max(0.0, float(timeout))
        status, frames = self._endpoint.call(_node.POLL, self._inbox, wait)
        if status == _node.ERROR:
            raise_error(frames)
        return status in (_node.OK, _node.EOF)


def close_all() -> None:
    """Close every Connection of this process (a child does this as it exits)."""
    for conn in list(_open):
        conn.close()
