"""The stages' AdamW (roving.pipeline.optim): torch.optim.AdamW's steps, bitwise, on the CPU; torch's state
dict layout both ways; a state that does not fit is refused and changes nothing; and no torch._dynamo."""
from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from roving.pipeline.errors import PlanError
from roving.pipeline.presets import preset
from roving.pipeline.optim import AdamW
from roving.pipeline.stages import Stage

HYPER = dict(betas=(0.9, 0.95), weight_decay=0.1)
LRS = [3e-3, 2e-3, 1e-3, 5e-4, 1e-4, 3e-3]


def _params(seed: int) -> list[torch.Tensor]:
    stage = Stage(preset("tiny"), 0, 2, seed=seed)
    return [p.detach().clone().requires_grad_(True) for p in stage.parameters()]


def _grads(params, step: int) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(1000 + step)
    # a parameter without a gradient in some steps (torch's AdamW leaves it and its state alone)
    return [None if (i + step) % 7 == 0 else torch.randn(p.shape, generator=gen) * (10.0 ** (i % 3 - 2))
            for i, p in enumerate(params)]


def _run(opt, params, steps, set_lr):
    for step in steps:
        for p, g in zip(params, _grads(params, step)):
            p.grad = None if g is None else g.clone()
        set_lr(LRS[step % len(LRS)])
        opt.step()


def _torch_lr(opt):
    def set_lr(lr):
        for group in opt.param_groups:
            group["lr"] = lr
    return set_lr


def _mine_lr(opt):
    def set_lr(lr):
        opt.lr = lr
    return set_lr


def test_its_steps_are_torch_adamws_bitwise_with_changing_learning_rates_and_missing_gradients():
    a, b = _params(1), _params(1)
    mine = AdamW(a, lr=LRS[0], **HYPER)
    ref = torch.optim.AdamW(b, lr=LRS[0], foreach=False, **HYPER)
    _run(mine, a, range(6), _mine_lr(mine))
    _run(ref, b, range(6), _torch_lr(ref))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    theirs = ref.state_dict()["state"]
    assert sorted(mine.state) == sorted(theirs)
    for i, s in mine.state.items():
        assert all(torch.equal(s[k], theirs[i][k]) for k in ("step", "exp_avg", "exp_avg_sq")), i


def test_torch_adamws_default_on_the_cpu_is_the_single_tensor_path_it_matches():
    a, b = _params(2), _params(2)
    mine, ref = AdamW(a, lr=LRS[0], **HYPER), torch.optim.AdamW(b, lr=LRS[0], **HYPER)
    _run(mine, a, range(3), _mine_lr(mine))
    _run(ref, b, range(3), _torch_lr(ref))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("direction", ["torch to roving", "roving to torch"])
def test_a_state_dict_moves_between_it_and_torch_and_training_goes_on_bitwise(direction):
    a, b = _params(3), _params(3)
    first = torch.optim.AdamW(a, lr=LRS[0], foreach=False, **HYPER) if direction == "torch to roving" \
        else AdamW(a, lr=LRS[0], **HYPER)
    _run(first, a, range(3), _torch_lr(first) if isinstance(first, torch.optim.Optimizer) else _mine_lr(first))
    with torch.no_grad():
        for x, y in zip(a, b):
            y.copy_(x)
    second = AdamW(b, lr=1.0, **HYPER) if direction == "torch to roving" \
        else torch.optim.AdamW(b, lr=1.0, foreach=False, **HYPER)
    # a copy, as a message or a checkpoint carries it (both state dicts hold the optimizer's own tensors)
    second.load_state_dict(copy.deepcopy(first.state_dict()))
    for opt, params in ((first, a), (second, b)):
        _run(opt, params, range(3, 6), _torch_lr(opt) if isinstance(opt, torch.optim.Optimizer) else _mine_lr(opt))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_state_that_does_not_fit_is_refused_by_what_is_wrong_and_changes_nothing():
    params = _params(4)
    opt = AdamW(params, lr=1e-3, **HYPER)
    _run(opt, params, range(2), _mine_lr(opt))
    good = opt.state_dict()
    before = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state.items()}
    other = AdamW(_params(4)[:-1], lr=1e-3, **HYPER)
    cases = [
        ({"state": {}}, "exactly one entry in 'param_groups'"),
        (other.state_dict(), f"for {len(params) - 1} parameters, this stage has {len(params)}"),
        ({**good, "state": {**good["state"], 1: {**good["state"][1], "exp_avg": torch.zeros(3)}}},
         "parameter 1 has shape"),
        ({**good, "state": {**good["state"], 1: {"step": torch.tensor(1.0)}}}, "parameter 1 has"),
        ({**good, "param_groups": [{**good["param_groups"][0], "amsgrad": True}]}, "amsgrad"),
    ]
    for bad, says in cases:
        with pytest.raises(PlanError, match=says.replace("(", r"\(").replace("[", r"\[")):
            opt.load_state_dict(bad)
        assert opt.lr == LRS[1] and sorted(opt.state) == sorted(before)
        assert all(torch.equal(opt.state[i][k], v) for i, s in before.items() for k, v in s.items())
    with pytest.raises(PlanError, match="two betas"):
        AdamW(params, lr=1e-3, betas=(0.9, 1.0))


def test_a_stage_and_its_optimizer_never_import_torch_dynamo():
    # the reason the optimizer is written out: torch.optim's methods, and normal_() on the meta device,
    # import torch._dynamo on first use (seconds of CPU at every stage process's start)
    program = (
        "import sys, torch\n"
        "from roving.pipeline.presets import preset\n"
        "from roving.pipeline.optim import AdamW\n"
        "from roving.pipeline.stages import Stage\n"
        "s = Stage(preset('tiny'), 0, 2, seed=1)\n"
        "opt = AdamW(list(s.parameters()), lr=1e-3)\n"
        "s.loss(s(s.embed(torch.randint(0, 256, (2, 16)))), torch.randint(0, 256, (2, 16))).backward()\n"
        "torch.nn.utils.clip_grad_norm_(s.parameters(), 1.0)\n"
        "opt.step(); opt.zero_grad(); opt.load_state_dict(opt.state_dict())\n"
        "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_its_multi_tensor_steps_are_torch_foreach_adamws_bitwise():
    """The accelerator's path (foreach=None picks it off the CPU), checked on the CPU against torch's own
    multi-tensor AdamW, with changing learning rates and gradients missing in some steps."""
    a, b = _params(2), _params(2)
    mine = AdamW(a, lr=LRS[0], foreach=True, **HYPER)
    ref = torch.optim.AdamW(b, lr=LRS[0], foreach=True, **HYPER)
    _run(mine, a, range(6), _mine_lr(mine))
    _run(ref, b, range(6), _torch_lr(ref))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    got, want = mine.state_dict()["state"], ref.state_dict()["state"]
    assert got.keys() == want.keys()
    assert all(torch.equal(got[i][k], want[i][k]) for i in got for k in ("step", "exp_avg", "exp_avg_sq"))


def test_by_default_the_multi_tensor_step_is_taken_off_the_cpu_and_the_single_tensor_one_on_it(monkeypatch):
    taken: list[str] = []
    monkeypatch.setattr(AdamW, "_step_many", lambda self, indices: taken.append("many"))
    monkeypatch.setattr(AdamW, "_step_one", lambda self, i: taken.append("one"))
    for device in ("cpu", "meta"):
        p = torch.zeros(3, device=device, requires_grad=True)
        p.grad = torch.ones(3, device=device)
        AdamW([p], lr=1e-3).step()
    assert taken == ["one", "many"]
