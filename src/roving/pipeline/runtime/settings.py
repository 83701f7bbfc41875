"""A stage process's settings: plain values, made by the coordinator and pickled into the process (its
own module, so that the parts a stage process is made of read them without importing the process)."""
from __future__ import annotations

from dataclasses import dataclass

from ..planning.network import Link
from ..presets import LlamaConfig
from ..verify.conduct import Conduct

__all__ = ["StageSettings"]


@dataclass(frozen=True)
class StageSettings:
    """What a stage process needs besides its stage: plain values, pickled into the process."""

    name: str
    stage: int
    stages: int
    model: LlamaConfig
    seed: int
    in_flight: int
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    device: str = "cpu"
    bf16: bool = False
    threads: int = 1
    #: this process's position among the run's (picks its GPU when several share a machine).
    index: int = 0
    #: destination -> link, when the network is emulated (None: send at once).
    emulate: dict[str, Link] | None = None
    #: how many times a process of this name was started before (a restarted one is a new incarnation).
    incarnation: int = 0
    #: seconds between heartbeats (0: none).
    heartbeat: float = 0.5
    #: how the stage's replicas' gradient shares are combined (``aggregate.RULES``).
    aggregation: str = "mean"
    #: adversary injection: how this process lies (an ``adversary.Adversary``; None: honest, ``conduct.HONEST``).
    adversary: Conduct | None = None
    #: ``[verify] mode``: with anything but "off", receipts on what it sends, and what it receives kept
    #: for the coordinator's checks (``evidence``).
    verify: str = "off"
    #: this node's receipt key (``receipts.node_key``), given by the coordinator.
    receipt_key: bytes = b""
    #: the node id the coordinator's connections authenticate as (its messages are taken from it alone).
    coordinator_id: str = ""
    #: seconds the process waits for an answer from the coordinator (its heartbeats' inbox) before it
    #: leaves with ``CoordinatorLost`` (0: it never does): a node someone else started has no parent to
    #: outlive, and must not wait for ever for a training that has gone.
    coordinator_timeout: float = 60.0
