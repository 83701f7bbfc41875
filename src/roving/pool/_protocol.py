"""The pool's messages between the parent's node and its workers (one custom node operation).

Worker → parent: ``[OP, header, ...]``, header = (pool id, kind, argument):

* HELLO(worker id) — the worker is connected and its initializer ran.
* READY(n) — it wants ``n`` more units of work (credit).
* RESULTS(count) — then a frame of (chunk id, offset, ok) triples and the pickled list of values.
* BYE — it is leaving (max tasks reached, or told to stop); it runs what it was sent before the ACK.

Parent → worker: ``[header, forget, offsets, *function frames, *argument frames]`` for TASKS, where header
= (kind, chunk id, job id, number of function frames, number of argument frames, items in the chunk); ``forget`` lists job ids
whose functions the worker may drop; ``offsets`` the items of the chunk to run (empty: all). ACK and STOP
are a header alone.
"""
from __future__ import annotations

import struct

OP = b"pool"
TO_PARENT = struct.Struct("<QBq")
TO_WORKER = struct.Struct("<BqqHHI")

HELLO, READY, RESULTS, BYE = 1, 2, 3, 4
TASKS, ACK, STOP = 1, 2, 3

# How a job's function is called with one item.
APPLY, MAP, STAR = 0, 1, 2
