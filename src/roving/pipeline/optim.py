"""The stages' optimizer: AdamW (decoupled weight decay, bias-corrected moments), written out.

Why not ``torch.optim.AdamW``: the first call of any of its methods imports ``torch._dynamo`` (torch's
methods are wrapped so that a compiler would skip them), about 2.3 s of CPU that every stage process
paid on every start, for a compiler roving never runs. This one does the same arithmetic as torch's
single-tensor AdamW, operation for operation, so on the CPU its steps are bitwise those of
``torch.optim.AdamW(foreach=False)`` (the CPU default; ``tests/pipeline/test_optim.py`` holds it to
that), and its state dict has torch's layout (``{"state": {index: {"step", "exp_avg", "exp_avg_sq"}},
"param_groups": [{..., "params": [indices]}]}``), so checkpoints written with either load into either.

On an accelerator the step runs as torch's multi-tensor ("foreach") AdamW does, operation for
operation (``foreach=None``, the default, picks that wherever a parameter is not on the CPU): one
kernel per operation for a stage's tensors of a device and dtype rather than one per tensor. On the CPU,
``foreach=True`` is bitwise ``torch.optim.AdamW(foreach=True)`` (tested); torch's ``fused`` kernel is
not used (a handful of kernels a step instead of one: not measured on a GPU yet).

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
                 eps: float = 1e-8, weight_decay: float = 1e-2, foreach: bool | None = None) -> None:
        if not lr >= 0.0 or not eps >= 0.0 or not weight_decay >= 0.0:
            raise PlanError(f"AdamW needs lr, eps and weight_decay >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise PlanError(f"AdamW needs two betas in [0, 1), got {betas}")
        self.params = list(params)
        self.lr, self.betas, self.eps, self.weight_decay = float(lr), (float(betas[0]), float(betas[1])), \
            float(eps), float(weight_decay)
        #: whether steps run as multi-tensor operations (None: where a parameter is not on the CPU)
        self.foreach = foreach
        #: index -> {"step": float32 scalar tensor, "exp_avg", "exp_avg_sq"}; made at a parameter's first step
        self.state: dict[int, dict[str, torch.Tensor]] = {}

    def _state(self, i: int, p: torch.Tensor) -> dict[str, torch.Tensor]:
        s = self.state.get(i)
        if s is None:
            s = self.state[i] = {"step": torch.tensor(0.0, dtype=torch.float32),
                                 "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                 "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        return s

    @torch.no_grad()
    def step(self) -> None:
        """Update every parameter that has a gradient (the others, and their state, are left alone)."""
        todo = [i for i, p in enumerate(self.params) if p.grad is not None]
        foreach = self.foreach if self.foreach is not None else any(self.params[i].device.type != "cpu"
                                                                    for i in todo)
        if not foreach:
            for i in todo:
                self._step_one(i)
            return
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i in todo:
            groups.setdefault((self.params[i].device, self.params[i].dtype), []).append(i)
        for indices in groups.values():
            self._step_many(indices)

    def _step_many(self, indices: list[int]) -> None:
        """One device's and dtype's parameters, as torch's multi-tensor AdamW steps them."""
        beta1, beta2 = self.betas
        params = [self.params[i] for i in indices]
        grads = [p.grad for p in params if p.grad is not None]  # every one has a gradient (step)
        states = [self._state(i, p) for i, p in zip(indices, params)]
        steps = [s["step"] for s in states]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        torch._foreach_add_(steps, 1)
        if self.weight_decay != 0:
            torch._foreach_mul_(params, 1 - self.lr * self.weight_decay)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        ts = [t.item() for t in steps]
        step_size = [(self.lr / (1 - beta1 ** t)) * -1 for t in ts]
        correction2_sqrt = [(1 - beta2 ** t) ** 0.5 for t in ts]
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, correction2_sqrt)
        torch._foreach_add_(denom, self.eps)
        torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)

    def _step_one(self, i: int) -> None:
        """One parameter, as torch's single-tensor AdamW steps it."""
        beta1, beta2 = self.betas
        p = self.params[i]
        grad = p.grad
        assert grad is not None
        s = self._state(i, p)
        s["step"] += 1
        if self.weight_decay != 0:
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
