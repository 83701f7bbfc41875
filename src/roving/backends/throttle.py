"""Starting many jobs at once without overrunning the cluster: a bounded number of submissions in flight
(:func:`concurrently`), and back-off while the cluster says it is busy (:func:`retry_busy`).

Guarantees:

* :func:`concurrently` runs at most ``bound`` calls at the same time and returns one result per item, in
  the items' order: what the call returned, or the exception it raised (never raised itself).
* :func:`retry_busy` tries again only when the backend's ``busy`` test names the failure as the cluster
  being busy (a rate limit, a controller that timed out, a full submit queue); each retry is logged as a
  warning with the cluster's own words and the delay. Delays double from 0.5 s up to 8 s; after
  ``BUSY_WINDOW_S`` seconds of refusals the last error is raised with how long it was tried. Any other
  failure is raised at once.
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Callable, List, Optional, Sequence, TypeVar, Union

__all__ = ["concurrently", "retry_busy", "BUSY_WINDOW_S", "CONCURRENCY"]

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

#: How long a submission is retried while the cluster says it is busy.
BUSY_WINDOW_S = 60.0
#: How many containers or pods a backend creates at the same time.
CONCURRENCY = 32
_FIRST_DELAY_S = 0.5
_MAX_DELAY_S = 8.0


def concurrently(call: Callable[[T], R], items: Sequence[T], bound: Optional[int] = None) -> List[Union[R, Exception]]:
    """``call(item)`` for every item, at most ``bound`` (default :data:`CONCURRENCY`) at a time; per item
    its result or its exception."""
    bound = CONCURRENCY if bound is None else bound
    def one(item: T) -> Union[R, Exception]:
        try:
            return call(item)
        except Exception as exc:
            return exc

    if len(items) <= 1 or bound <= 1:
        return [one(item) for item in items]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(bound, len(items)),
                                               thread_name_prefix="roving-submit") as ex:
        return list(ex.map(one, items))


def retry_busy(attempt: Callable[[], R], busy: Callable[[Exception], Optional[str]], what: str,
               window: Optional[float] = None) -> R:
    """``attempt()``, tried again with back-off while ``busy(exc)`` returns the cluster's words (a string)
    for its failure; ``what`` names the submission in the log. See the module docstring."""
    window = BUSY_WINDOW_S if window is None else window
    start = time.monotonic()
    delay = _FIRST_DELAY_S
    while True:
        try:
            return attempt()
        except Exception as exc:
            words = busy(exc)
            if words is None:
                raise
            waited = time.monotonic() - start
            if waited + delay > window:
                log.error("roving: %s: the cluster is still busy after %.0f s of retries: %s", what, waited, words)
                raise
            log.warning("roving: %s: the cluster says it is busy (%s); trying again in %.1f s", what, words, delay)
            time.sleep(delay)
            delay = min(delay * 2, _MAX_DELAY_S)
