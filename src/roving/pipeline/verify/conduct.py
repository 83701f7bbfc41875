"""How a stage process conducts itself where a node could lie: the hook a stage process calls at each such
point, whatever the node is (``stage_process``). ``Conduct`` itself is the honest node's: every method
gives back what it was given, changes nothing and costs a call. An injected adversary
(``adversary.Adversary``) is a ``Conduct`` that lies; the stage process never asks which one it holds.

The points: what it sends (``tamper``: activations, gradients, its gradient share), the share it averages
(``averages``), what it answers to a recheck (``reports``), the gradient it steps with (``steps``), and
the weights it exports (``exported``). Read without PyTorch (the run's configuration parses adversaries).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class Conduct:
    """An honest node's conduct: every hook gives back what it was given (the module doc)."""

    def tamper(self, what: str, tensor: torch.Tensor, node: str, rnd: int, mb: int,
               given: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor ``node`` sends as its ``what`` ("activation", "gradient", "share") of microbatch
        ``mb`` (-1: its share) of round ``rnd``, where it computed ``tensor`` (``given``: its input)."""
        return tensor

    def averages(self, own: torch.Tensor, honest: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
        """The share ``node`` averages with its replicas': ``own`` (its gradients, on its device), where it
        sent ``sent`` in place of ``honest`` (``tamper``)."""
        return own

    def reports(self, node: str, rnd: int, difference: float) -> float:
        """What ``node`` answers to a recheck of round ``rnd`` whose recomputation differs by ``difference``."""
        return difference

    def steps(self, grads: list[torch.Tensor], node: str, rnd: int) -> None:
        """Before ``node``'s optimizer step of round ``rnd``: its gradients (``grads``), changed in place by
        a node that steps with others."""

    def exported(self, weights: dict[str, torch.Tensor], node: str, rnd: int) -> dict[str, torch.Tensor]:
        """The weights ``node`` exports in round ``rnd`` where it holds ``weights``."""
        return weights


#: the honest node's conduct (what a stage process holds unless an adversary is injected).
HONEST = Conduct()
