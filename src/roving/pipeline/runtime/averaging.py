"""A stage process's replica averaging and optimizer step: once its backward passes of a round are done
it sends its gradients to the other replicas of its stage, combines every replica's in one order (so
that all replicas hold bitwise the same result, ``verify.aggregate``), reports the squared norm, and
steps when the coordinator says so.

``Averaging`` is that part of ``stage_process.StageProcess``: the round's gradients (``grads``), the
replicas' counts and the coordinator's averaging order are its; what it reads of the process's state is
declared below and set by ``StageProcess``.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import torch

from .. import protocol as m
from ..optim import AdamW
from ..stages import Stage
from ..verify.aggregate import combine
from ..verify.conduct import Conduct
from ..verify.evidence import Evidence
from .senders import Senders

if TYPE_CHECKING:
    from .settings import StageSettings


class Averaging:
    """Replicas' gradients averaged, and the step (a mixin of ``StageProcess``)."""

    settings: StageSettings
    name: str
    device: torch.device
    control: Any  # anything with ``put``
    conduct: Conduct
    evidence: Evidence
    platform: str
    stage: Stage
    stage_index: int
    params: list[torch.nn.Parameter]
    opt: AdamW
    stats: dict[str, Any]
    last_sq_norm: float
    backwards: int
    grads: dict[int, dict[str, torch.Tensor]]
    share_counts: dict[int, dict[str, int]]
    sync_order: dict[int, m.SyncOrder]
    _out: Callable[[torch.Tensor], torch.Tensor]
    _senders: Callable[[], Senders]

    def _on_sync_order(self, msg: m.SyncOrder) -> None:
        self.sync_order[msg.round] = msg
        self._try_sync(msg.round)

    def _on_gradients(self, msg: m.Gradients) -> None:
        self.grads.setdefault(msg.round, {})[msg.sender] = msg.flat
        self.share_counts.setdefault(msg.round, {})[msg.sender] = msg.count
        self._try_sync(msg.round)

    def _on_step(self, msg: m.Step) -> None:
        self._step(msg.round, msg.clip_coef, msg.lr)

    def _flat_grads(self) -> torch.Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().float()
                          for p in self.params])

    def _try_sync(self, rnd: int) -> None:
        """Send this replica's gradients to the other replicas once its backward passes of the round
        are all done; average once every replica's have arrived (then report the squared norm)."""
        if rnd not in self.sync_order:
            return
        order = self.sync_order[rnd]
        replicas, count, expect = order.replicas, order.count, order.expect
        got = self.grads.setdefault(rnd, {})
        if self.name not in got:
            if expect is not None and self.backwards < expect:
                return
            mine = self._flat_grads()
            got[self.name] = mine
            self.share_counts.setdefault(rnd, {})[self.name] = self.backwards
            out = honest = self._out(mine)
            if len(replicas) > 1:
                out = self.conduct.tamper("share", honest, self.name, rnd, -1)
                got[self.name] = self.conduct.averages(mine, honest, out)
            seal = self.evidence.sealer("share", rnd, -1, -1, out) if len(replicas) > 1 else None
            for r in replicas:
                if r != self.name:
                    self._senders().send(r, m.Gradients(rnd, self.name, out, self.backwards), out, seal)
        if any(r not in got for r in replicas):
            return
        # Every replica combines the same tensors in the same order: the results are bitwise equal
        # (``aggregate``; "mean" adds them in this order and divides by ``count``, as always).
        counts = self.share_counts.get(rnd, {})
        cosines = self.evidence.shares(rnd, {r: got[r] for r in replicas}, counts)
        total = combine([got[r].to(self.device) for r in replicas], [counts.get(r, 0) for r in replicas],
                        count, self.settings.aggregation)
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = total[offset:offset + n].view_as(p).to(p.dtype)
            offset += n
        del self.grads[rnd], self.sync_order[rnd]
        self.share_counts.pop(rnd, None)
        self.last_sq_norm = float(total.pow(2).sum())
        ev = self.evidence
        combined = ev.combined(total) if len(replicas) > 1 and order.combined else None
        self.control.put(m.Norm(rnd, self.name, self.stage_index, self.last_sq_norm, ev.summaries(),
                                tuple(ev.disputes), cosines or None, combined))

    def _step(self, rnd: int, coef: float, lr: float) -> None:
        if coef < 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        self.conduct.steps([p.grad for p in self.params if p.grad is not None], self.name, rnd)
        self.opt.lr = lr
        self.opt.step()
        self.opt.zero_grad()
        # replicas step bitwise alike (the same gradient, coefficient and optimizer state): what each
        # holds now is compared (``verify``), where there are replicas to compare with; every replica's,
        # a single one's too, is what its weights exported or shown until its next step are held to
        weights = self.evidence.stepped(self.stage.state_dict())
        stats = dict(self.stats, verify_cpu_s=self.evidence.spent())
        self.stats.update(processed=0, compute_s=0.0, peak_in_flight=0, trace=[])
        norm, self.last_sq_norm = math.sqrt(self.last_sq_norm), math.nan
        self.control.put(m.Stepped(rnd, self.name, stats, norm, weights, self.platform))

