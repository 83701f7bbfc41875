"""Debugging a call that failed far away: run it again here.

``roving.debug.rerun(failure)`` runs the call that failed on a pool worker (or an Executor's) again in
this process — the very function and pickled arguments the worker got — so that ``pdb`` (``pdb=True``), a
``breakpoint()`` in the function, or an IDE stops in it::

    try:
        results = pool.map(simulate, configs)
    except ValueError as exc:
        roving.debug.rerun(exc, pdb=True)     # the failed item's simulate(config), here, under pdb

``failure`` is the exception the call raised (as it was raised), the failed ``AsyncResult``
(``result.rerun_locally()`` is the same) or the ``concurrent.futures.Future``. An item that ended with
``WorkerLostError`` (its workers died: a segfault, the OOM killer) is rerun too, to reproduce the crash here.
The crashed workers' own last output: ``roving logs --failed``.
"""
from __future__ import annotations

from .pool import rerun

__all__ = ["rerun"]
