"""The stages' optimizer: AdamW (decoupled weight decay, bias-corrected moments), written out.

Why not ``torch.optim.AdamW``: the first call of any of its methods imports ``torch._dynamo`` (torch's
methods are wrapped so that a compiler would skip them), about 2.3 s of CPU that every stage process
paid on every start, for a compiler roving never runs. This one does the same arithmetic as torch's
single-tensor AdamW, operation for operation, so on the CPU its steps are bitwise those of
``torch.optim.AdamW(foreach=False)`` (the CPU default; ``tests/pipeline/test_optim.py`` holds it to
that), and its state dict has torch's layout (``{"state": {index: {"step", "exp_avg", "exp_avg_sq"}},
"param_groups": [{..., "params": [indices]}]}``), so checkpoints written with either load into either.

One parameter group: a stage's parameters share the learning rate, which the coordinator sets before
each step (:attr:`AdamW.lr`), and the weight decay.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .errors import PlanError

__all__ = ["AdamW"]


class AdamW:
    """AdamW over ``params`` (tensors that require gradients, in a fixed order: the state dict names
    them by position). ``step()`` updates every parameter that has a gradient, as torch's does."""

    def __init__(self, params: Sequence[torch.Tensor], *, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        if not lr >= 0.0 or not eps >= 0.0 or not weight_decay >= 0.0:
            raise PlanError(f"AdamW needs lr, eps and weight_decay >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise PlanError(f"AdamW needs two betas in [0, 1), got {betas}")
        self.params = list(params)
        self.lr, self.betas, self.eps, self.weight_decay = float(lr), (float(betas[0]), float(betas[1])), \
            float(eps), float(weight_decay)
        #: index -> {"step": float32 scalar tensor, "exp_avg", "exp_avg_sq"}; made at a parameter's first step
        self.state: dict[int, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def step(self) -> None:
        beta1, beta2 = self.betas
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            grad = p.grad
            s = self.state.get(i)
            if s is None:
                s = self.state[i] = {"step": torch.tensor(0.0, dtype=torch.float32),
                                     "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                     "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
            s["step"] += 1
            p.mul_(1 - self.lr * self.weight_decay)
            s["exp_avg"].lerp_(grad, 1 - beta1)
            s["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            t = s["step"].item()
            step_size = self.lr / (1 - beta1 ** t)
            denom = (s["exp_avg_sq"].sqrt() / (1 - beta2 ** t) ** 0.5).add_(self.eps)
            p.addcdiv_(s["exp_avg"], denom, value=-step_size)

    def zero_grad(self) -> None:
        """Drop every parameter's gradient (``set_to_none``: the next backward writes it afresh)."""
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        """The state in torch's layout (tensors are this optimizer's own, not copies)."""
        group = {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay,
                 "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                 "differentiable": False, "fused": None, "decoupled_weight_decay": True,
                 "params": list(range(len(self.params)))}
        return {"state": {i: dict(s) for i, s in self.state.items()}, "param_groups": [group]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take ``state`` (this class's or ``torch.optim.AdamW``'s, one group): the moments are copied
        onto each parameter's device and dtype, the hyperparameters taken. PlanError, changing nothing,
        when it does not fit these parameters."""
        groups = state.get("param_groups") if isinstance(state, dict) else None
        if not isinstance(groups, list) or len(groups) != 1 or not isinstance(state.get("state"), dict):
            raise PlanError("an AdamW state needs 'state' and exactly one entry in 'param_groups'")
        group = groups[0]
        if len(group.get("params", ())) != len(self.params):
            raise PlanError(f"the AdamW state is for {len(group.get('params', ()))} parameters, this stage has "
                            f"{len(self.params)}")
        if group.get("amsgrad") or group.get("maximize") or group.get("decoupled_weight_decay") is False:
            raise PlanError("the AdamW state was made with amsgrad, maximize or coupled weight decay, which "
                            "this optimizer does not do")
        position = {pid: n for n, pid in enumerate(group["params"])}
        loaded: dict[int, dict[str, torch.Tensor]] = {}
        for pid, s in state["state"].items():
            if pid not in position:
                raise PlanError(f"the AdamW state has an entry for parameter {pid!r}, not in its group")
            i = position[pid]
            p = self.params[i]
            if set(s) != {"step", "exp_avg", "exp_avg_sq"}:
                raise PlanError(f"the AdamW state of parameter {i} has {sorted(s)}, not step, exp_avg and "
                                "exp_avg_sq")
            if s["exp_avg"].shape != p.shape or s["exp_avg_sq"].shape != p.shape:
                raise PlanError(f"the AdamW state of parameter {i} has shape {tuple(s['exp_avg'].shape)}, the "
                                f"parameter {tuple(p.shape)}")
            loaded[i] = {"step": torch.as_tensor(s["step"]).detach().to("cpu", torch.float32, copy=True),
                         "exp_avg": s["exp_avg"].detach().to(device=p.device, dtype=p.dtype, copy=True),
                         "exp_avg_sq": s["exp_avg_sq"].detach().to(device=p.device, dtype=p.dtype, copy=True)}
        betas = group.get("betas", self.betas)
        self.lr, self.betas = float(group.get("lr", self.lr)), (float(betas[0]), float(betas[1]))
        self.eps, self.weight_decay = float(group.get("eps", self.eps)), float(group.get("weight_decay",
                                                                                         self.weight_decay))
        self.state = loaded
