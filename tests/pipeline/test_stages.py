"""A stage split computes exactly what the whole model computes."""

import pytest
import torch

torch.set_num_threads(1)  # the machine is shared; tiny models gain nothing from more

from roving.pipeline.errors import PlanError
from roving.pipeline.model import Llama
from roving.pipeline.presets import preset
from roving.pipeline.stages import Stage, layer_ranges, merge_state_dicts, run_path


def _split(cfg, n, seed):
    return [Stage(cfg, s, n, seed=seed) for s in range(n)]


def test_layer_ranges_cover_every_layer_once_in_order():
    cfg = preset("tiny", n_layers=7)
    ranges = layer_ranges(cfg, 3)
    assert [i for r in ranges for i in r] == list(range(7))
    assert [len(r) for r in ranges] == [2, 2, 3]


def test_more_stages_than_layers_is_a_clear_error():
    with pytest.raises(PlanError, match="only 4 layers"):
        layer_ranges(preset("tiny"), 5)


def test_stages_built_from_a_seed_hold_the_whole_models_weights():
    cfg = preset("tiny")
    whole = Llama(cfg, seed=7).state_dict()
    merged = merge_state_dicts([s.state_dict() for s in _split(cfg, 3, seed=7)])
    assert merged.keys() == whole.keys()
    for k in whole:
        assert torch.equal(whole[k], merged[k]), k


def test_full_path_gives_the_same_loss_and_gradients_as_the_whole_model():
    cfg = preset("tiny")
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (3, 24))
    targets = torch.randint(0, cfg.vocab_size, (3, 24))
    whole = Llama(cfg, seed=5)
    _, loss = whole(tokens, targets)
    loss.backward()
    stages = _split(cfg, 4, seed=5)
    split_loss = run_path(stages, [1, 2, 3], tokens, targets)
    split_loss.backward()
    assert torch.equal(loss, split_loss)
    grads = {n: p.grad for s in stages for n, p in s.named_parameters()}
    for n, p in whole.named_parameters():
        assert torch.equal(p.grad, grads[n]), n


def test_a_skip_path_runs_only_the_stages_it_names():
    cfg = preset("tiny")
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    stages = _split(cfg, 4, seed=1)
    run_path(stages, [2, 1], tokens, tokens).backward()  # swapped order, stage 3 skipped
    assert all(p.grad is not None for p in stages[1].parameters())
    assert all(p.grad is None for p in stages[3].parameters())


def test_dropping_stages_runs_the_kept_layers_as_a_path_would():
    from roving.pipeline.run.evaluate import half_of_the_stages, kept_layers, validation_loss

    cfg = preset("tiny", n_layers=6)
    whole = Llama(cfg, seed=2)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    targets = torch.randint(0, cfg.vocab_size, (2, 16))
    assert half_of_the_stages(6) == [2, 4]  # 2 of the 5 droppable stages, not 3
    assert half_of_the_stages(4) == [1, 3] and half_of_the_stages(3) == [2] and half_of_the_stages(2) == []
    for s in range(2, 13):
        drop = half_of_the_stages(s)
        assert len(drop) == round((s - 1) / 2) and 0 not in drop and drop == sorted(set(drop))
        assert all(1 <= d < s for d in drop)
    assert kept_layers(whole, 6, [1, 3, 5]) == [0, 2, 4]
    stages = _split(cfg, 6, seed=2)
    want = run_path(stages, [2, 4], tokens, targets).item()
    assert abs(validation_loss(whole, [(tokens, targets)], [0, 2, 4]) - want) < 1e-5
    assert abs(validation_loss(whole, [(tokens, targets)]) - whole(tokens, targets)[1].item()) < 1e-5
    with pytest.raises(ValueError, match="stage 0"):
        kept_layers(whole, 6, [0])


def test_a_stage_is_the_model_cut_to_its_part_with_its_parameters_in_checkpoint_order():
    """A checkpoint matches each stage's optimizer state to its parameters by position: a stage lists
    its layers first, then (stage 0) the embedding, final norm and head, as checkpoints have them."""
    cfg = preset("tiny")
    first = Stage(cfg, 0, 2, seed=3)
    names = [n for n, _ in first.named_parameters()]
    assert names[-3:] == ["tok_embeddings.weight", "norm.weight", "output.weight"]
    assert all(n.startswith(("layers.0.", "layers.1.")) for n in names[:-3]) and len(names) == 3 + 2 * 9
    later = Stage(cfg, 1, 2, seed=3)
    assert isinstance(later, Llama) and not later.ends and later.layer_ids == [2, 3]
    assert all(n.startswith(("layers.2.", "layers.3.")) for n, _ in later.named_parameters())
    h = torch.randn(2, 8, cfg.dim)
    whole = Llama(cfg, seed=3)
    assert torch.equal(later(h), whole.run_layers(h, [2, 3]))
