"""The pool's messages between the parent's node and its workers (one custom node operation): the one
place that knows their layout. The dispatcher (:mod:`roving.pool._dispatch`), the worker loop
(:mod:`roving.pool._worker`) and the router (:mod:`roving.pool._router`) build and read them only
through the functions and types here.

Worker → parent: ``[OP, header, ...]``, header = :class:`Header` (pool id, kind, argument, key):

* HELLO(worker id) — the worker is connected and its initializer ran.
* READY(n, key) — it wants ``n`` more units of work (credit); while it is busy, only of work with that
  key (that of the unit it runs, found short; a map's own, or one per function for apply); 0: any.
* RESULTS(n, key) — then a frame of :class:`Run` s (chunk id, first offset, length, ok) and the pickled
  list of values, one per item of the runs in order; ``n`` more units of work of ``key`` are asked for at
  the same time (as READY).
* BYE — it is leaving (max tasks reached, or told to stop); it runs what it was sent before the ACK.
* RETURNED(chunk id) — answer to REVOKE: the unit had not started and is given back unrun.
* BYE(MEMORY_LIMIT, resident set) — it is leaving because it grew past ``worker_memory_limit``.
* HEARTBEAT(worker id) — from the worker's heartbeat thread, on a connection of its own, every
  ``heartbeat_interval`` seconds, also while a task runs; then a frame with its memory (:data:`MEMORY`:
  RSS, peak RSS, its cgroup's usage, limit and peak in bytes, -1 where not known), read by
  :func:`read_memory`. The worker loop's own idle HEARTBEAT is a header alone.
* ENDING(worker id, seconds left) — then a frame with what told it (``signal SIGTERM``, ...; UTF-8): from
  the heartbeat thread too, at once: the worker was told it will end (a time limit, a preemption;
  :mod:`roving.pool._ending`). It takes no more work, gives back what it
  has not started (RETURNED, unasked), finishes what it runs within that many seconds and says BYE; what it
  leaves unfinished costs no retry.

Parent → worker: TASKS is one or more units back to back (:func:`unit_frames`, read back as
:class:`Unit` s by :func:`read_units`), each ``[header, forget, offsets, *function frames, *argument
frames]``, where header = (kind, chunk id, function id, key, number of function frames, number of argument
frames, items in the chunk). The function frames come only the first time a worker is sent that function
id; it keeps the function under that id (0: do not keep). ``forget`` lists function ids the worker may
drop; ``offsets`` the items of the chunk to run (empty: all). ACK and STOP are a header alone; REVOKE(chunk
id) asks for a unit back if it has not started (an idle worker wants it). :func:`read_control` reads any
of them: a :class:`Control`.

The messages travel over a :class:`roving.transport.channel.Channel` per worker (a stream where the
parent's node has a listener, else ZeroMQ), so their frames are any bytes-like object.

Cost: this is the per-task path of millisecond tasks. Headers are NamedTuples made straight from
``struct``; the per-item work (merging results into runs) is a few integer compares in
:class:`RunWriter`, no object per item.
"""
from __future__ import annotations

import enum
import struct
from array import array
from multiprocessing.pool import MaybeEncodingError  # type: ignore[attr-defined]  # (not in typeshed's stub)
from typing import Any, Callable, List, NamedTuple, Sequence, Tuple, Union

from ..backends.memory import MemorySample
from ..transport.serialize import dumps, loads

OP = b"pool"
#: Header of a message to the parent: pool id, kind, argument, key.
TO_PARENT = struct.Struct("<QBqq")
#: Header of a message to a worker: kind, chunk id, function id, key, function frames, argument frames,
#: items in the chunk.
TO_WORKER = struct.Struct("<BqqqHHI")
#: One run of a RESULTS message: chunk id, first offset, length, ok.
RUN = struct.Struct("<qqqq")
#: A heartbeat's memory frame: RSS, peak RSS, cgroup usage, cgroup limit, cgroup peak (bytes; -1: unknown).
MEMORY = struct.Struct("<qqqqq")
#: BYE's argument when the worker leaves because it grew past ``worker_memory_limit`` (0: any other reason).
BYE_MEMORY_LIMIT = 1

# The named tuples of this module are made with tuple.__new__ from what struct gives (a C call; a
# NamedTuple's own constructor and _make are Python functions, a microsecond a message at the worst).
_new = tuple.__new__
_EMPTY: Tuple[int, ...] = ()


class ToParent(enum.IntEnum):
    """Kinds of message from a worker to the parent."""

    HELLO = 1
    READY = 2
    RESULTS = 3
    BYE = 4
    RETURNED = 5
    HEARTBEAT = 6
    ENDING = 7


class ToWorker(enum.IntEnum):
    """Kinds of message from the parent to a worker."""

    TASKS = 1
    ACK = 2
    STOP = 3
    REVOKE = 4


class Mode(enum.IntEnum):
    """How a job's function is called with one item: ``f(*args, **kwds)``, ``f(item)``, ``f(*item)``."""

    APPLY = 0
    MAP = 1
    STAR = 2


# Module-level names for the hot paths (a module global is read faster than an enum class attribute).
HELLO, READY, RESULTS, BYE, RETURNED, HEARTBEAT, ENDING = ToParent
TASKS, ACK, STOP, REVOKE = ToWorker
APPLY, MAP, STAR = Mode


def list_frames(values: List[Any]) -> List[Any]:
    """A chunk's items, or a RESULTS message's values: one pickled list (large buffers out of band).
    SerializationError if one of them cannot be pickled."""
    return dumps(values)


def read_list(frames: Sequence[Any]) -> List[Any]:
    """The list :func:`list_frames` made; whatever unpickling raises."""
    return loads(frames)


# -- worker → parent ------------------------------------------------------------------------------
class Header(NamedTuple):
    """The header of every message to the parent."""

    pool_id: int
    kind: int
    arg: int
    key: int


class Run(NamedTuple):
    """Results of consecutive items of one chunk with one outcome: items ``first .. first + length - 1``."""

    chunk: int
    first: int
    length: int
    ok: bool


def read_header(frames: Sequence[Any]) -> Header:
    """The header of a message to the parent (its frame after OP)."""
    return _new(Header, TO_PARENT.unpack(frames[0]))


def to_parent(pool_id: int, kind: int, arg: int = 0, key: int = 0) -> List[Any]:
    """A message to the parent that is a header alone (HELLO, READY, BYE, RETURNED, HEARTBEAT)."""
    return [OP, TO_PARENT.pack(pool_id, kind, arg, key)]


def ending(pool_id: int, worker_id: int, seconds_left: int, reason: str) -> List[Any]:
    """ENDING: worker ``worker_id`` will end within ``seconds_left`` s, as ``reason`` told it."""
    return [OP, TO_PARENT.pack(pool_id, ENDING, worker_id, seconds_left), reason.encode()]


def heartbeat(pool_id: int, worker_id: int, memory: MemorySample) -> List[Any]:
    """HEARTBEAT from worker ``worker_id``, with its memory."""
    fields = (memory.rss, memory.rss_peak, memory.cgroup_usage, memory.cgroup_limit, memory.cgroup_peak)
    return [OP, TO_PARENT.pack(pool_id, HEARTBEAT, worker_id, 0),
            MEMORY.pack(*(-1 if v is None else v for v in fields))]


def read_memory(frames: Sequence[Any]) -> Union[MemorySample, None]:
    """The memory a HEARTBEAT carries (frames after OP), or None for one without (or a malformed one)."""
    if len(frames) < 2 or len(frames[1]) != MEMORY.size:
        return None
    values = [None if v < 0 else v for v in MEMORY.unpack(frames[1])]
    return MemorySample(*values)


def read_ending_reason(frames: Sequence[Any]) -> str:
    """What told the worker of an ENDING message it will end ("" from a worker that does not say)."""
    return bytes(frames[1]).decode(errors="replace") if len(frames) > 1 else ""


class RunWriter:
    """The runs of a RESULTS message as its results are added one or several at a time: an item that
    follows the last one added, of the same chunk and outcome, extends its run (no object per item)."""

    __slots__ = ("_closed", "_chunk", "_first", "_count", "_ok")

    def __init__(self) -> None:
        self._closed: List[bytes] = []  # the runs before the open one, packed
        self._chunk = self._first = self._count = self._ok = 0  # the open run (count 0: none)

    def add(self, chunk: int, first: int, count: int, ok: bool) -> None:
        """Items ``first .. first + count - 1`` of ``chunk`` had outcome ``ok``."""
        ok_ = 1 if ok else 0
        if self._count and chunk == self._chunk and first == self._first + self._count and ok_ == self._ok:
            self._count += count
            return
        if self._count:
            self._closed.append(RUN.pack(self._chunk, self._first, self._count, self._ok))
        self._chunk, self._first, self._count, self._ok = chunk, first, count, ok_

    def runs(self) -> List[Run]:
        """The runs so far, in order."""
        return _runs(self._packed(), True)

    def _packed(self) -> bytes:
        last = RUN.pack(self._chunk, self._first, self._count, self._ok) if self._count else b""
        return b"".join((*self._closed, last)) if self._closed else last

    def results(self, pool_id: int, ask: int, key: int, value_frames: List[Any]) -> List[Any]:
        """The RESULTS message of these runs and their values (pickled, ``value_frames``), asking for
        ``ask`` more units of ``key``."""
        return [OP, TO_PARENT.pack(pool_id, RESULTS, ask, key), self._packed(), *value_frames]


def _runs(frame: Any, loaded: bool) -> List[Run]:
    """The runs packed in ``frame``; every one failed unless ``loaded``."""
    if len(frame) == RUN.size:  # the usual case: one run
        chunk, first, length, ok = RUN.unpack(frame)
        return [_new(Run, (chunk, first, length, loaded and ok != 0))]
    return [_new(Run, (chunk, first, length, loaded and ok != 0))
            for chunk, first, length, ok in RUN.iter_unpack(frame)]


class Results(NamedTuple):
    """A RESULTS message as the parent reads it: the runs and one value per item of them, in order."""

    runs: List[Run]
    values: List[Any]


def read_results(frames: Sequence[Any]) -> Results:
    """The runs and values of a RESULTS message. Values that cannot be unpickled here (their class cannot
    be imported in the parent, say) make every item of the message fail with ``MaybeEncodingError``."""
    try:
        values = read_list(frames[2:])
    except BaseException as exc:  # its class cannot be imported here, or unpickling it exits (SystemExit)
        err = MaybeEncodingError(exc, "<result that could not be unpickled in the parent>")
        err.__cause__ = exc
        runs = _runs(frames[1], False)
        return _new(Results, (runs, [err] * sum(run.length for run in runs)))
    return _new(Results, (_runs(frames[1], True), values))


# -- parent → worker ------------------------------------------------------------------------------
class Control(NamedTuple):
    """The header of a message to a worker: its kind and, for TASKS, the first unit's fields."""

    kind: int
    chunk: int
    func: int
    key: int
    nfunc: int
    nargs: int
    items: int  #: items in the chunk


class Unit(NamedTuple):
    """One unit of work as a worker reads it from TASKS."""

    chunk: int  #: the chunk's id
    func: int  #: the function's id (0: not kept)
    key: int  #: the key of work it counts under (a call's, or a function's for apply)
    func_frames: Sequence[Any]  #: the pickled (function, mode); empty when the worker holds ``func``
    arg_frames: Sequence[Any]  #: the pickled list of the chunk's items
    offsets: Union[range, Sequence[int]]  #: the items of the chunk to run
    forget: Sequence[int]  #: ids of functions the worker may drop


def function_frames(func: Callable[..., Any], mode: int) -> List[Any]:
    """The function frames of a unit: ``func`` and how it is called. SerializationError if unpicklable."""
    return dumps((func, int(mode)))


def read_function(frames: Sequence[Any]) -> Tuple[Callable[..., Any], int]:
    """(function, mode) from a unit's function frames; whatever unpickling raises."""
    func, mode = loads(frames)
    return func, mode


_STOP_HEADER = TO_WORKER.pack(STOP, 0, 0, 0, 0, 0, 0)
_ACK_HEADER = TO_WORKER.pack(ACK, 0, 0, 0, 0, 0, 0)
_NONE = b""


def control(kind: int, chunk: int = 0) -> List[Any]:
    """A message to a worker that is a header alone: ACK, STOP, or REVOKE(``chunk``)."""
    if kind == STOP:
        return [_STOP_HEADER]
    if kind == ACK:
        return [_ACK_HEADER]
    return [TO_WORKER.pack(kind, chunk, 0, 0, 0, 0, 0)]


def unit_frames(chunk: int, func: int, key: int, count: int, func_frames: Sequence[Any], arg_frames: Sequence[Any],
                forget: Sequence[int], offsets: Union[None, Sequence[int]]) -> Tuple[Any, ...]:
    """The frames of one unit of a TASKS message (units of one message go back to back): items
    ``offsets`` (None: all ``count``) of chunk ``chunk``."""
    header = TO_WORKER.pack(TASKS, chunk, func, key, len(func_frames), len(arg_frames), count)
    gone = array("q", forget).tobytes() if forget else _NONE
    offs = array("I", offsets).tobytes() if offsets is not None else _NONE
    return (header, gone, offs, *func_frames, *arg_frames)


def read_control(frames: Sequence[Any]) -> Control:
    """The header of a message to a worker (TASKS: the first unit's; read them with :func:`read_units`)."""
    return _new(Control, TO_WORKER.unpack(frames[0]))


def read_units(frames: Sequence[Any], first: Control) -> List[Unit]:
    """The units of a TASKS message whose header ``first`` was read by :func:`read_control`."""
    units = []
    head, at, n = first, 0, len(frames)
    while True:
        _, chunk, func, key, nfunc, nargs, items = head
        start = at + 3
        units.append(_new(Unit, (chunk, func, key, frames[start:start + nfunc],
                                 frames[start + nfunc:start + nfunc + nargs],
                                 _ints("I", frames[at + 2]) or range(items), _ints("q", frames[at + 1]))))
        at = start + nfunc + nargs
        if at >= n:
            return units
        head = _new(Control, TO_WORKER.unpack(frames[at]))


def _ints(code: str, frame: Any) -> Sequence[int]:
    """The integers packed in ``frame`` (any bytes-like object); an empty tuple for an empty frame."""
    if not len(frame):
        return _EMPTY
    out = array(code)
    out.frombytes(frame)
    return out
