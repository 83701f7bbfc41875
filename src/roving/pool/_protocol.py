"""The pool's messages between the parent's node and its workers (one custom node operation).

Worker → parent: ``[OP, header, ...]``, header = (pool id, kind, argument, key):

* HELLO(worker id) — the worker is connected and its initializer ran.
* READY(n, key) — it wants ``n`` more units of work (credit); while it is busy, only of work with that
  key (that of the unit it runs, found short; a map's own, or one per function for apply); 0: any.
* RESULTS(n) — then a frame of runs (chunk id, first offset, count, ok) and the pickled list of values,
  one per item of the runs in order; ``n`` more units of work are asked for at the same time.
* BYE — it is leaving (max tasks reached, or told to stop); it runs what it was sent before the ACK.
* RETURNED(chunk id) — answer to REVOKE: the unit had not started and is given back unrun.
* HEARTBEAT(worker id) — from the worker's heartbeat thread, on a connection of its own, every
  ``heartbeat_interval`` seconds, also while a task runs.

Parent → worker: TASKS is one or more units back to back, each ``[header, forget, offsets, *function frames,
*argument frames]``, where header = (kind, chunk id, function id, key, number of function frames, number
of argument frames, items in the chunk). The function frames come only the first time a worker is sent
that function id; it keeps the function under that id (0: do not keep). ``forget`` lists function ids the
worker may drop; ``offsets`` the items of the chunk to run (empty: all). ACK and STOP are a header alone;
REVOKE(chunk id) asks for a unit back if it has not started (an idle worker wants it).

The messages travel over a :class:`roving.transport.channel.Channel` per worker (a stream where the
parent's node has a listener, else ZeroMQ), so their frames are any bytes-like object.
"""
from __future__ import annotations

import struct
from array import array
from typing import Any

OP = b"pool"
TO_PARENT = struct.Struct("<QBqq")
TO_WORKER = struct.Struct("<BqqqHHI")

HELLO, READY, RESULTS, BYE, RETURNED, HEARTBEAT = 1, 2, 3, 4, 5, 6
TASKS, ACK, STOP, REVOKE = 1, 2, 3, 4

# How a job's function is called with one item.
APPLY, MAP, STAR = 0, 1, 2


def ints(code: str, frame: Any) -> "array[int]":
    """The integers of a frame (any bytes-like: a ZeroMQ frame, or bytes off a stream) as an array."""
    out = array(code)
    out.frombytes(frame)
    return out
