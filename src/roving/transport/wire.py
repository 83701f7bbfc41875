"""The wire format of the transport: what a node (:mod:`.node`) and the processes that call it
(:mod:`.endpoint`) send each other, over ZeroMQ and over streams alike.

A request is ``[op, HEADER(box id, request id, timeout), *payload]``: ``op`` is one byte (the
operations below), the timeout is in seconds (-1: wait as long as it takes, 0: not at all). An answer
is ``[reply header(request id, status), *frames]`` (:func:`pack_reply`), with a status of
:mod:`.mailbox` (OK, EMPTY, FULL, EOF, ERROR). This module owns each struct of the wire: it packs and
reads them (``pack_header``/``unpack_header``, ``pack_reply``/``unpack_reply``,
``pack_sizes``/``unpack_sizes``), and nobody else indexes into their bytes. Over ZeroMQ a message is
its frames; over a stream it is one stream message of kind :data:`REQUEST` or :data:`ANSWER`
(:mod:`.stream` frames it). The authentication handshake that comes before any of this is
:mod:`.auth`'s.

Guarantees: no frame larger than :data:`MAX_FRAME` reaches a node's ZeroMQ socket (libzmq drops a
peer that declares one); :func:`split_frames` cuts larger frames into pieces and :func:`join_pieces`
gives them back whole, sharing memory with the caller's buffers on the sending side. A message that
does not follow this format, as far as this module reads it, raises :class:`MalformedMessage`, whose
text is one line saying what was wrong (a node drops such a message with a one-line warning).
"""
from __future__ import annotations

import array
import itertools
import os
import struct
from typing import Any, Callable, List, NamedTuple, Optional, Tuple

import zmq

from . import addressing
from .errors import AddressError, MalformedMessage

from .stream import KEEPALIVE_COUNT, KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S

Frames = List[Any]

# Operations on mailboxes. One byte each.
PUT, PUT_NOREPLY, GET, POLL, SIZE, TASK_DONE, JOIN, HOLD, RELEASE, PUT_FRONT, PING = (
    bytes([c]) for c in b"PpGLSTJHRFI"
)
# Pipe ends that talk over a direct stream (roving.transport.link): who uses which end, and the gate
# that keeps a direction's readers in order while a stream is taken down.
CLAIM, UNCLAIM, GATE, INSERT, UNGATE = (bytes([c]) for c in b"CUgiu")
#: Asks a node where its stream listener is (roving.transport.stream): requests then go over a stream.
STREAMS = b"W"
#: Operations sent without waiting for an answer.
NO_REPLY = frozenset({PUT_NOREPLY, HOLD, RELEASE, PUT_FRONT, INSERT, UNGATE})
#: Stream message kinds: a request to a node, a node's answer, and a message of a protocol of one's own
#: (``[op, *frames]`` to the node's handler for ``op``; from the node, what that handler sent back).
REQUEST, ANSWER, MESSAGE = b"Q", b"A", b"M"
#: A request's header: box id, request id, timeout in seconds (-1: forever). Made by :func:`pack_header`
#: and read by :func:`unpack_header` (a test that plays a client may pack one itself).
HEADER = struct.Struct("<QQd")
pack_header: Callable[[int, int, float], bytes] = HEADER.pack


def unpack_header(data: Any) -> Tuple[int, int, float]:
    """(box id, request id, timeout) of a request's header; MalformedMessage when it is not one."""
    if len(data) != HEADER.size:
        raise MalformedMessage(f"a request header of {len(data)} bytes, not {HEADER.size}")
    return HEADER.unpack(data)
# An answer's header: request id, status; the node's answers and rpc's (roving.transport.rpc) alike.
# This module owns it: pack_reply makes it, unpack_reply reads it (a bytes-like, or a zmq.Frame's .bytes).
_REPLY = struct.Struct("<Qb")
pack_reply: Callable[[int, int], bytes] = _REPLY.pack
unpack_reply: Callable[[Any], Tuple[int, int]] = _REPLY.unpack
#: The size of an answer's header.
REPLY_SIZE = _REPLY.size
# The answer to SIZE: items in the mailbox (and writers waiting to put), tasks not yet done.
_SIZES = struct.Struct("<QQ")


class Sizes(NamedTuple):
    """What a node answers SIZE with (:func:`pack_sizes`, :func:`unpack_sizes`)."""

    items: int  #: items held, plus writers waiting to put one
    unfinished: int  #: items put and not yet marked done (``task_done``)


def pack_sizes(sizes: Sizes) -> bytes:
    """The frame a node answers SIZE with."""
    return _SIZES.pack(*sizes)


def unpack_sizes(frame: Any) -> Sizes:
    """The sizes in a SIZE answer's frame; MalformedMessage when it is not one."""
    data = bytes(frame)
    if len(data) != _SIZES.size:
        raise MalformedMessage(f"a SIZE answer of {len(data)} bytes, not {_SIZES.size}")
    return Sizes(*_SIZES.unpack(data))

#: The largest frame a node's ZeroMQ socket takes from any peer (libzmq disconnects a peer that declares
#: a larger one, before buffering it); larger frames travel in pieces (split_frames).
MAX_FRAME = 1 << 20
_PIECE = MAX_FRAME - 4096  # CURVE adds its box and command header to each frame on the wire
#: First frame of a message whose large frames were cut into pieces; then the layout (pieces per frame).
PIECES = b"\x00pieces"
_LAYOUT = "Q"
#: A ZeroMQ connection that has not completed ZeroMQ's handshake (CURVE included) within this is closed.
HANDSHAKE_IVL_MS = 10_000
#: Frames smaller than this are copied into ZeroMQ: cheaper than tracking them.
COPY_BELOW = 65536


def nbytes(frame: Any) -> int:
    """The size of a frame in bytes (bytes, bytearray, memoryview, zmq.Frame)."""
    if type(frame) is memoryview:
        return frame.nbytes
    return len(frame)


def send_frames(sock: zmq.Socket, frames: Frames) -> None:
    """Send a multipart message: small frames copied, large ones and received Frames without a copy.

    Several times cheaper than ``send_multipart`` for small messages, which matters on the hot path.
    The caller must not change a large frame's buffer until ZeroMQ has sent it.
    """
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        flags = zmq.SNDMORE if i < last else 0
        if type(frame) is bytes:
            sock.send(frame, flags)
        else:
            sock.send(frame, flags, copy=nbytes(frame) < COPY_BELOW)


def split_frames(frames: Frames) -> Frames:
    """``frames`` as a node's socket takes them: unchanged when every frame fits in :data:`MAX_FRAME`,
    else ``[PIECES, layout, *pieces]`` (pieces share memory with the frames; the node joins them)."""
    if all(nbytes(f) <= _PIECE for f in frames):
        return frames
    counts, pieces = [], []
    for frame in frames:
        size = nbytes(frame)
        if size <= _PIECE:
            counts.append(1)
            pieces.append(frame)
            continue
        view = memoryview(frame).cast("B") if type(frame) is not memoryview else frame.cast("B")
        counts.append((size + _PIECE - 1) // _PIECE)
        pieces.extend(view[at:at + _PIECE] for at in range(0, size, _PIECE))
    return [PIECES, array.array(_LAYOUT, counts).tobytes(), *pieces]


def join_pieces(frames: List[Any]) -> List[Any]:
    """The frames of a message made by :func:`split_frames` (``frames`` from its layout on, as
    zmq.Frames). MalformedMessage, saying what was wrong, when the layout is missing, is not a whole
    number of counts, names no frame or a frame of no pieces, or does not match the pieces that came."""
    if not frames:
        raise MalformedMessage("a message in pieces has no layout frame")
    layout = frames[0].bytes
    counts = array.array(_LAYOUT)
    if len(layout) % counts.itemsize:
        raise MalformedMessage(f"the layout of a message in pieces is {len(layout)} bytes, not a multiple "
                               f"of {counts.itemsize}")
    counts.frombytes(layout)
    pieces, out, at = frames[1:], [], 0
    if not counts:
        raise MalformedMessage("the layout of a message in pieces names no frame")
    if any(c < 1 for c in counts):
        raise MalformedMessage("the layout of a message in pieces gives a frame no pieces")
    if sum(counts) != len(pieces):
        raise MalformedMessage(f"a message in pieces does not match its layout: {sum(counts)} pieces "
                               f"announced, {len(pieces)} came")
    for count in counts:
        if count == 1:
            out.append(pieces[at])
        else:
            whole = bytearray(sum(len(p) for p in pieces[at:at + count]))
            pos = 0
            for piece in pieces[at:at + count]:
                whole[pos:pos + len(piece)] = piece.buffer
                pos += len(piece)
            out.append(whole)
        at += count
    return out


def context() -> zmq.Context:
    """The ZeroMQ context of this process."""
    return zmq.Context.instance()


def keep_alive(sock: zmq.Socket) -> None:
    """TCP keepalive on a ZeroMQ socket's connections, with the streams' timings (stream.keep_alive)."""
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTERVAL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_COUNT)


# -- ZeroMQ sockets of a node ---------------------------------------------------------------

def bind_router(sock: zmq.Socket, host: str, port_range: Optional[Tuple[int, int]]) -> int:
    """Bind ``sock`` to ``host`` on a port of ``port_range`` (or any); the port."""
    url = f"tcp://[{host}]" if ":" in host else f"tcp://{host}"
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)

    def bind(port: int) -> None:
        try:
            sock.bind(f"{url}:{port}")
        except zmq.ZMQError as exc:
            raise OSError(exc.errno, f"{exc}") from None

    try:
        if port_range is None:
            return sock.bind_to_random_port(url)
        return addressing.bind_in_range(bind, port_range, host)
    except zmq.ZMQError as exc:
        raise AddressError(f"cannot listen on {host} ({exc}): is it an address of this machine?") from None


def recv_message(sock: zmq.Socket) -> List[zmq.Frame]:
    """The next message's frames without waiting (zmq.Again if none): as ``recv_multipart(copy=False)``,
    reading each frame's "more" flag (which pyzmq set when it received the frame) instead of asking the
    socket again for each frame."""
    frame = sock.recv(zmq.NOBLOCK, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(copy=False)
        frames.append(frame)
    return frames


_monitor_ids = itertools.count()


def watch(sock: zmq.Socket, events: int) -> zmq.Socket:
    """A PAIR socket that receives ``sock``'s monitor ``events``, with no high-water mark.

    libzmq sends monitor events from its own I/O thread with a blocking send: were the pipe to this
    socket full, or this socket gone while the monitor runs, that thread would stop, and with it every
    connection of the context (hellos unanswered, in every node of the process). Hence no limit here,
    the reader connected before the monitor starts, and :meth:`.node.Node.close` stopping the monitor before
    it closes this socket."""
    address = f"inproc://roving-node-monitor-{os.getpid()}-{next(_monitor_ids)}"
    reader = sock.context.socket(zmq.PAIR)
    reader.setsockopt(zmq.LINGER, 0)
    reader.setsockopt(zmq.RCVHWM, 0)
    reader.connect(address)  # inproc allows connecting first: no event finds the monitor without a reader
    sock.monitor(address, events)
    return reader
