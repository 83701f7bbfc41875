"""What verification finds (``verifier``, the module doc), each an event (``trainer._event``): a node
*caught* (who, which check, why, the evidence: the computation, microbatch and hop, the verifier and both
differences), a *dispute* (a sender or a holder lies, and the coordinator cannot tell which: both become
suspects, neither is blamed), a *suspect* (out of its boundary's screening band: checked more, never
blamed for that alone); and the run's counts of them (``totals``)."""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

from .checks import Check
from .screen import Suspect

log = logging.getLogger(__name__)


class Findings:
    """Who was caught or suspected, and why; the run's totals (``Verifier.totals``)."""

    def __init__(self, event: Callable[..., None]) -> None:
        self.event = event
        #: the nodes screening named or a dispute involved (checked at the suspect's rate from then on)
        self.suspects: set[str] = set()
        self._suspected: set[tuple] = set()  # (node, boundary, statistic) already an event
        #: the run's figures so far; ``max_difference``: the largest difference of a recheck that passed
        #: (what float nondeterminism amounts to here, against ``tolerance``)
        self.totals: dict[str, Any] = {
            "checks": 0, "rechecks": 0, "confirmations": 0, "caught": 0, "disputes": 0, "opposed": 0,
            "turned": 0, "exports": 0, "seconds": 0.0, "overlapped_seconds": 0.0, "cpu_seconds": 0.0,
            "max_difference": 0.0}

    def catch(self, caught: dict[str, str], node: str, check: str, c: Check, reason: str, **evidence: Any) -> None:
        """``node`` is caught by ``check`` (on computation ``c``) for ``reason``: added to ``caught`` (name ->
        why) and an event, once (a node caught already is not caught again)."""
        if node in caught:
            return
        caught[node] = f"{check}: {reason}"
        log.warning("verification: node %s caught: %s", node, reason)
        fields = {**c.describe(), "computed_by": c.node, **evidence}
        self.event("caught", node=node, nodes=[node], check=check, why=reason, **fields)

    def dispute(self, nodes: list[str], why: str, **evidence: Any) -> None:
        """One of ``nodes`` lies and which cannot be told: all are suspects, none is blamed."""
        self.suspects.update(nodes)
        self.totals["disputes"] += 1
        self.event("dispute", nodes=sorted(set(nodes)), why=why, **evidence)

    def suspect(self, s: Suspect) -> None:
        """Screening named ``s.node`` out of its boundary's band: a suspect, and an event the first time for
        this boundary and statistic (what is found at once is checked at once instead: not a suspect)."""
        mark = (s.node, str(s.boundary), s.check)
        if not math.isfinite(s.z) or mark in self._suspected:
            return
        self._suspected.add(mark)
        self.suspects.add(s.node)
        self.event("suspect", node=s.node, boundary=list(s.boundary) if isinstance(s.boundary, tuple)
                   else s.boundary, check=s.check, z=s.z, value=s.value, others=s.others)


def finite(x: float) -> float | None:
    """``x``, or None where it is not finite (an event is JSON)."""
    return x if math.isfinite(x) else None
