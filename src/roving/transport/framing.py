"""How a stream's bytes become messages, and back: the framing of :mod:`roving.transport.stream`.

A message is a kind (one byte), a count of frames, one 8-byte mark per frame (its length, shifted left
once, plus one when the frame is a bytes object), then the frames' bytes. :func:`encode` gives the
buffers to write (the frames themselves, not copied); :class:`Reader` assembles messages from what a
socket gives, in any pieces, resuming where it stopped after an interruption. A large frame is read
straight into a buffer of its own (a bytes object when it was one), which an unpickled object then uses
as its memory.
"""
from __future__ import annotations

import collections
import ctypes
import socket
import struct
from typing import Any, Callable, Deque, List, Optional, Sequence, Tuple

from .progress import FROM as _TOLD_FROM
from .progress import Progress, peer_of

_HEAD = struct.Struct("<cI")  # kind, number of frames; then one <Q per frame: length << 1 | is-bytes
_FIRST_BUFFER = 4096  # a reader's buffer at first: an idle stream (a heartbeat's) costs little
_BUFFER = 64 * 1024  # it doubles, up to this, each time a read fills it (a busy stream reads more at once)
_OWN_BUFFER = 64 * 1024  # frames at least this large are read into a buffer of their own


def _fresh_buffers() -> Tuple[Callable[[int], Any], Callable[[int], bytearray]]:
    """Makers of uninitialised bytes and bytearray objects, filled by the reader before anyone sees
    them (the C API's documented way to build one), so that a large frame is written once, by the
    kernel, instead of being zeroed first and, for bytes, copied again."""
    try:
        api = ctypes.pythonapi
        new_bytes, as_string = api.PyBytes_FromStringAndSize, api.PyBytes_AsString
        new_bytearray = api.PyByteArray_FromStringAndSize
    except AttributeError:  # not CPython
        return (lambda n: None), bytearray
    new_bytes.restype = new_bytearray.restype = ctypes.py_object
    new_bytes.argtypes = new_bytearray.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
    as_string.restype, as_string.argtypes = ctypes.c_void_p, [ctypes.py_object]

    def bytes_to_fill(n: int) -> Tuple[bytes, memoryview]:
        obj = new_bytes(None, n)
        return obj, memoryview((ctypes.c_char * n).from_address(as_string(obj))).cast("B")

    return bytes_to_fill, (lambda n: new_bytearray(None, n))


_bytes_to_fill, _bytearray = _fresh_buffers()


def is_bytes(frame: object) -> bool:
    """Whether a frame is (the memory of) a bytes object: it is rebuilt as one on the other side."""
    return type(frame) is bytes or type(frame) is memoryview and type(frame.obj) is bytes


def encode(kind: bytes, frames: Sequence[Any]) -> List[Any]:
    """A message as the buffers to write: its header, then its frames (not copied)."""
    views = [f if type(f) is bytes else memoryview(f).cast("B") for f in frames]
    marks = [len(v) << 1 | is_bytes(f) for v, f in zip(views, frames)]
    # (empty frames are in the header only: a zero-length buffer would never count as written)
    return [_HEAD.pack(kind, len(views)) + struct.pack(f"<{len(views)}Q", *marks), *(v for v in views if len(v))]


def advance(todo: Deque[Any], sent: int) -> None:
    """Drop ``sent`` bytes from the front of a list of buffers."""
    while sent:
        first = len(todo[0])
        if sent >= first:
            sent -= first
            todo.popleft()
        else:
            todo[0] = memoryview(todo[0])[sent:]
            sent = 0



class Reader:
    """Assembles the messages of a stream from its bytes. All its state lives here, so a read that is
    interrupted (a signal, or nothing yet on a non-blocking socket) resumes where it stopped."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.ready: Deque[Tuple[bytes, List[Any]]] = collections.deque()
        self.ended = False
        # Small at first, since a node serves thousands of streams (a pool worker keeps two open);
        # frames of _OWN_BUFFER or more are read into buffers of their own, whatever its size. (It also
        # grows beyond _BUFFER when a message's header or a smaller frame needs it.)
        self._buf = bytearray(_FIRST_BUFFER)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        self._msg: Optional[Tuple[bytes, Tuple[int, ...], List[Any]]] = None
        self._big: Optional[List[Any]] = None  # [frame, view, bytes in, its Progress or None]: a large frame

    def buffered(self) -> bool:
        return bool(self.ready) or self._end > self._start

    def step(self) -> None:
        """Parse what is buffered; if that completes no message, read once from the socket (blocking,
        or BlockingIOError on a non-blocking socket with nothing to read) and parse again."""
        while self._parse():
            pass
        if self.ready:
            return
        if self._big is not None:
            frame, view, have, told = self._big
            got = self.sock.recv_into(view[have:])
            if got:
                self._big[2] = have + got
                if told is not None:
                    told.advance(have + got)
                if have + got == len(view):
                    view.release()
                    self._big = None
                    if told is not None:
                        told.finish()
                    assert self._msg is not None  # a big frame is read only inside a message
                    self._msg[2].append(frame)
        else:
            if self._start == self._end:
                self._start = self._end = 0
            elif self._end == len(self._buf):
                self._compact()
            room = len(self._buf) - self._end
            got = self.sock.recv_into(self._view[self._end:])
            self._end += got
            if got == room and len(self._buf) < _BUFFER:
                self._grow()
        if not got:
            self.ended = True
            return
        while self._parse():
            pass

    def _grow(self) -> None:
        self._view.release()
        self._buf.extend(bytes(len(self._buf)))
        self._view = memoryview(self._buf)

    def _compact(self) -> None:
        left = self._end - self._start
        if self._start:
            self._view[:left] = self._view[self._start:self._end]
            self._start, self._end = 0, left
        if self._end == len(self._buf):  # a header larger than the buffer: grow it
            self._grow()

    def _parse(self) -> bool:
        """Take what the buffer holds of the current message; True when that completed one."""
        if self._big is not None:
            return False
        avail = self._end - self._start
        if self._msg is None:
            if avail < _HEAD.size:
                return False
            kind, count = _HEAD.unpack_from(self._view, self._start)
            if avail < _HEAD.size + 8 * count:
                if self._start + _HEAD.size + 8 * count > len(self._buf):
                    self._compact()
                return False
            marks = struct.unpack_from(f"<{count}Q", self._view, self._start + _HEAD.size)
            self._start += _HEAD.size + 8 * count
            self._msg = (kind, marks, [])
        kind, marks, frames = self._msg
        while len(frames) < len(marks):
            mark = marks[len(frames)]
            length, avail = mark >> 1, self._end - self._start
            if length >= _OWN_BUFFER:
                made = _bytes_to_fill(length) if mark & 1 else None
                if made is None:
                    frame = _bytearray(length)
                    view = memoryview(frame)
                else:
                    frame, view = made
                have = min(length, avail)
                view[:have] = self._view[self._start:self._start + have]
                self._start += have
                if have < length:
                    told = Progress(f"receiving a frame from {peer_of(self.sock)}", length) \
                        if length >= _TOLD_FROM else None
                    self._big = [frame, view, have, told]
                    return False
                view.release()
                frames.append(frame)
            elif avail >= length:
                chunk = self._view[self._start:self._start + length]
                frames.append(bytes(chunk) if mark & 1 else bytearray(chunk))
                self._start += length
            else:
                if self._start + length > len(self._buf):
                    self._compact()
                return False
        self.ready.append((kind, frames))
        self._msg = None
        return True

