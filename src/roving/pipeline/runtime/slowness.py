"""Finding nodes much slower than the plan expects, from the compute seconds each node measured in
an iteration against the compute the plan gives it (``simulate.predict``'s busy seconds)."""

from __future__ import annotations

import statistics


class SlowNodes:
    """A node is slow when its measured compute over its planned compute is above ``factor`` times
    the median node's for ``iterations`` iterations in a row. Nodes the plan gives less than a tenth
    of the busiest node's compute are not judged (their ratio is noise), nor is anything with fewer
    than three nodes judged."""

    def __init__(self, factor: float, iterations: int) -> None:
        self.factor, self.iterations = factor, iterations
        self._counts: dict[str, int] = {}

    def observe(self, planned: dict[str, float], measured: dict[str, float]) -> dict[str, float]:
        """One iteration's compute seconds per node; returns the nodes found slow now, each with how
        many times slower than the median it was (those are judged afresh from here on)."""
        top = max(planned.values(), default=0.0)
        ratios = {n: measured[n] / planned[n] for n in measured if n in planned and planned[n] >= 0.1 * top > 0}
        if len(ratios) < 3:
            return {}
        typical = statistics.median(ratios.values())
        slow = {}
        for n, r in ratios.items():
            if r > self.factor * typical:
                self._counts[n] = self._counts.get(n, 0) + 1
                if self._counts[n] >= self.iterations:
                    slow[n] = r / typical
            else:
                self._counts.pop(n, None)
        for n in slow:
            self._counts.pop(n, None)
        return slow
