"""What a run's verification is set to (``[verify]``), shared by the verifier's parts (``verifier``)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Settings:
    """``[verify]``'s values as the verifier's parts read them (``mode``, ``rate``: ``verify_rate``,
    ``tolerance``, ``verifiers``, ``confirm_rate``, ``aggregation``, ``timeout``), the model's (``stages``,
    ``seed``, ``bf16``: what the coordinator recomputes with), and ``rng``: where every draw is made (the
    operating system's randomness, so no node can know what will be drawn; a test may put another)."""

    mode: str = "off"
    rate: float = 0.0
    tolerance: float = 1e-3
    verifiers: int = 2
    confirm_rate: float = 0.0
    aggregation: str = "mean"
    stages: int = 1
    seed: int = 0
    bf16: bool = False
    timeout: float = 60.0
    rng: random.Random = field(default_factory=random.SystemRandom)

    @classmethod
    def of(cls, config: Any) -> Settings:
        """The settings of a run's ``config`` (a ``TrainConfig``, or anything with its fields)."""
        return cls(config.mode, config.verify_rate, config.tolerance, config.verifiers, config.confirm_rate,
                   config.aggregation, config.stages, config.seed, config.bf16, config.timeout)

    @property
    def on(self) -> bool:
        return self.mode != "off"
