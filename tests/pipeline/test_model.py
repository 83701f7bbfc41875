"""The LLaMA-style model: shapes, causality, presets, and that it learns."""

import pytest
import torch

torch.set_num_threads(1)  # the machine is shared; tiny models gain nothing from more

from roving.pipeline.model import Block, Llama

from roving.pipeline.presets import LlamaConfig, PRESETS, preset


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


def test_forward_runs_any_subset_of_layers_in_the_order_given():
    cfg = preset("tiny")
    model = Llama(cfg, seed=2)
    tokens = torch.randint(0, cfg.vocab_size, (2, 10))
    h = model.tok_embeddings(tokens)
    for i in (2, 0):
        h = model.layers[i](h, model.rope_cos, model.rope_sin)
    want = model.output(model.norm(h))
    got, loss = model(tokens, tokens, layers=[2, 0])
    assert torch.equal(got, want)
    assert torch.equal(loss, torch.nn.functional.cross_entropy(want.flatten(0, 1), tokens.flatten()))
    assert torch.equal(model(tokens, layers=range(cfg.n_layers))[0], model(tokens)[0])
    assert not torch.equal(model(tokens, layers=[0, 2])[0], got)  # the order matters


def test_a_part_built_alone_has_the_whole_models_weights_and_names():
    cfg = preset("tiny", n_layers=5)
    whole = Llama(cfg, seed=4).state_dict()
    part = Llama(cfg, seed=4, layers=[3, 1], ends=False)
    sd = part.state_dict()
    assert set(sd) == {k for k in whole if k.startswith(("layers.1.", "layers.3."))}
    for k, v in sd.items():
        assert torch.equal(v, whole[k]), k
    assert part.layer_ids == [1, 3] and not part.ends and part.tok_embeddings is None
    ends = Llama(cfg, seed=4, layers=[], ends=True)
    assert set(ends.state_dict()) == {"tok_embeddings.weight", "norm.weight", "output.weight"}
    assert all(torch.equal(v, whole[k]) for k, v in ends.state_dict().items())


def test_on_the_meta_device_nothing_is_materialised():
    with torch.device("meta"):
        model = Llama(PRESETS["1b"], layers=[0, 1])
    assert all(p.is_meta for p in model.parameters())
    assert model.num_params() == 2 * sum(p.numel() for p in Block(PRESETS["1b"]).parameters()) + \
        2 * 32000 * 2048 + 2048


def test_a_part_names_only_layers_of_the_model():
    with pytest.raises(ValueError, match="not distinct layers of a 4-layer model"):
        Llama(preset("tiny"), layers=[1, 4])
    with pytest.raises(ValueError, match="not distinct layers"):
        Llama(preset("tiny"), layers=[1, 1])


def test_training_and_planning_presets_come_from_one_table():
    from roving.pipeline.planning.costs import MODEL_PRESETS
    from roving.pipeline.presets import ARCHITECTURES, PLANNING, TRAINING

    assert list(PRESETS) == list(TRAINING)
    for name, cfg in PRESETS.items():
        assert cfg == LlamaConfig(**ARCHITECTURES[name])
    for name, (size, settings) in PLANNING.items():
        spec, arch = MODEL_PRESETS[name], ARCHITECTURES[size]
        assert (spec.n_layers, spec.dim, spec.vocab_size) == (arch["n_layers"], arch["dim"], arch["vocab_size"]), name
        assert spec.seq_len == settings.get("seq_len", arch["max_seq_len"]) and spec.name == name
    # the size both train and plan: the same numbers under both names
    big, spec = PRESETS["500m"], MODEL_PRESETS["llama-500m"]
    assert (big.n_layers, big.dim, big.vocab_size, big.max_seq_len) == (spec.n_layers, spec.dim, spec.vocab_size,
                                                                        spec.seq_len)
