"""Tasks that use memory, for the memory tests (importable by the workers)."""
from __future__ import annotations

import os
import time
import uuid

MiB = 2**20
_kept = []


def touched(mib: int) -> bytearray:
    """``mib`` MiB really in memory (each page written)."""
    block = bytearray(mib * MiB)
    for i in range(0, len(block), 4096):
        block[i] = 1
    return block


def grow_and_keep(mib: int) -> int:
    """Keep ``mib`` more MiB alive in this worker (a leak); its pid."""
    _kept.append(touched(mib))
    return os.getpid()


def use_for_a_while(mib: int, seconds: float) -> int:
    """Hold ``mib`` MiB for ``seconds`` (heartbeats see it), then free it; its pid."""
    block = touched(mib)
    time.sleep(seconds)  # the task's own work: holding the memory while heartbeats report it
    del block
    return os.getpid()


def hog(mib: int, attempts_dir: str) -> int:
    """Note this attempt (a file of its own: containers' pids repeat) and use ``mib`` MiB: past a worker's
    limit, it is killed for memory."""
    with open(os.path.join(attempts_dir, uuid.uuid4().hex), "w"):
        pass
    return len(touched(mib))


def pid(_: object = None) -> int:
    return os.getpid()
