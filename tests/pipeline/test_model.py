"""The LLaMA-style model: shapes, causality, presets, and that it learns."""

import pytest
import torch

torch.set_num_threads(1)  # the machine is shared; tiny models gain nothing from more

from roving.pipeline.model import Block, Llama, LlamaConfig, PRESETS, preset


def test_logits_shape_and_loss_near_uniform_at_init():
    cfg = preset("tiny")
    model = Llama(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    logits, loss = model(tokens, tokens)
    assert logits.shape == (2, 16, cfg.vocab_size)
    # small init: predictions are close to uniform over the vocabulary
    assert abs(loss.item() - torch.log(torch.tensor(float(cfg.vocab_size))).item()) < 0.2


def test_attention_is_causal_a_later_token_does_not_change_earlier_logits():
    model = Llama(preset("tiny"), seed=1)
    a = torch.randint(0, 256, (1, 12))
    b = a.clone()
    b[0, 8:] = (b[0, 8:] + 1) % 256
    la, _ = model(a)
    lb, _ = model(b)
    assert torch.allclose(la[0, :8], lb[0, :8], atol=1e-6)
    assert not torch.allclose(la[0, 8:], lb[0, 8:], atol=1e-6)


def test_same_seed_same_weights_other_seed_other_weights():
    cfg = preset("tiny")
    a, b, c = Llama(cfg, seed=3), Llama(cfg, seed=3), Llama(cfg, seed=4)
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), n
        if not n.endswith("norm.weight"):
            assert not torch.equal(p, r), n


def _params(cfg):
    with torch.device("meta"):  # no memory: only the parameter count is wanted
        return sum(
            p.numel() for p in torch.nn.ModuleList([
                torch.nn.Embedding(cfg.vocab_size, cfg.dim), *(Block(cfg) for _ in range(cfg.n_layers)),
                torch.nn.Linear(cfg.dim, cfg.vocab_size, bias=False)]).parameters())


def test_presets_have_the_sizes_they_are_named_for():
    assert 0.45e9 < _params(PRESETS["500m"]) < 0.6e9
    assert 0.9e9 < _params(PRESETS["1b"]) < 1.2e9


def test_bad_config_is_a_clear_error():
    with pytest.raises(ValueError, match="heads"):
        LlamaConfig(dim=66, n_heads=4)
    with pytest.raises(ValueError, match="unknown model"):
        preset("huge")


def test_a_few_adam_steps_fit_a_repeated_batch():
    torch.manual_seed(0)
    model = Llama(preset("tiny"), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 256, (4, 32))
    first = None
    for _ in range(30):
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first
