"""The failures a run is told to suffer and how it recovers, as its configuration names them: the
recovery policies (``[faults] stage_recovery``), the scripted failures (``fail_at``) and the random
ones (``fail_rate``) as a ``FailureSchedule``. Plain Python: the run's configuration reads these
without PyTorch; the recovery itself is ``runtime/recovery.py``."""

from __future__ import annotations

import random

from .errors import PlanError

#: the recovery policies, as ``[faults] stage_recovery`` names them.
POLICIES = ("snapshot", "skip", "neighbours", "auto")


def parse_fail_at(text: str, stages: int) -> dict[int, list[int]]:
    """``fail_at`` ("10:2,30:1": at iteration 10 stage 2, at 30 stage 1) as {iteration: [stages]}.
    PlanError naming the bad entry otherwise."""
    out: dict[int, list[int]] = {}
    if not text.strip():
        return out
    for entry in text.split(","):
        parts = entry.strip().split(":")
        try:
            if len(parts) != 2:
                raise ValueError
            it, stage = int(parts[0]), int(parts[1])
        except ValueError:
            raise PlanError(f"fail_at: {entry.strip()!r} is not ITERATION:STAGE (e.g. \"10:2,30:1\")") from None
        if it < 0:
            raise PlanError(f"fail_at: iteration {it} in {entry.strip()!r} is negative")
        if not 0 <= stage < stages:
            raise PlanError(f"fail_at: stage {stage} in {entry.strip()!r} is not one of the run's stages "
                            f"0..{stages - 1}")
        out.setdefault(it, [])
        if stage not in out[it]:
            out[it].append(stage)
    return out


class FailureSchedule:
    """Which stages lose every replica at the start of which iteration (the module doc)."""

    def __init__(self, stages: int, seed: int = 0, fail_rate: float = 0.0, hour_iterations: int = 100,
                 fail_at: str = "") -> None:
        self.stages, self.seed = stages, seed
        #: the chance that a stage fails whole at one iteration
        self.chance = fail_rate / hour_iterations if fail_rate > 0 else 0.0
        self.scripted = parse_fail_at(fail_at, stages)

    def __bool__(self) -> bool:
        return bool(self.chance or self.scripted)

    def at(self, iteration: int) -> list[int]:
        """The stages killed whole at the start of ``iteration`` (sorted)."""
        out = set(self.scripted.get(iteration, []))
        if self.chance:
            for s in range(1, self.stages):
                if random.Random(f"fail:{self.seed}:{iteration}:{s}").random() < self.chance:
                    out.add(s)
        return sorted(out)
