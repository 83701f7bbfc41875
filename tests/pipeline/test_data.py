"""Offline English text, byte-level tokens, a held-out split, clear errors for too little text."""

import pytest
import torch

from roving.pipeline.errors import DataError
from roving.pipeline.run.data import decode, encode, load_corpus, train_batches, val_batches


def test_encode_decode_round_trip_utf8():
    text = "naïve café — roving"
    assert decode(encode(text).tolist()) == text
    assert int(encode(text).max()) < 256


def test_default_corpus_is_english_prose_with_a_disjoint_validation_split():
    c = load_corpus(seq_len=64, batch_samples=4)
    text = decode(c.train[:200_000].tolist()).lower()
    # real English: the commonest words are everywhere (random tokens would have none)
    for word in (" the ", " of ", " and ", " to "):
        assert text.count(word) > 100, word
    assert len(c.val) > 0.05 * (len(c.train) + len(c.val))
    # the split is by position: validation is the tail of the text, training the head
    head = decode(c.val[:64].tolist())
    assert head not in decode(c.train[-5000:].tolist())


def test_user_files_and_too_small_corpus(tmp_path):
    (tmp_path / "a.txt").write_text("It was a bright cold day in April. " * 40)
    c = load_corpus([tmp_path], seq_len=16, batch_samples=2)
    assert decode(c.train[:10].tolist()) == "It was a b"
    with pytest.raises(DataError, match="corpus too small"):
        load_corpus([tmp_path], seq_len=512, batch_samples=8)
    with pytest.raises(DataError, match="does not exist"):
        load_corpus([tmp_path / "nope"], seq_len=16, batch_samples=2)


def test_batches_are_shifted_windows_and_reproducible():
    tokens = torch.arange(1000) % 256
    a = next(train_batches(tokens, 3, 10, seed=1))
    b = next(train_batches(tokens, 3, 10, seed=1))
    assert torch.equal(a[0], b[0]) and a[0].shape == (3, 10)
    assert torch.equal(a[0][:, 1:], a[1][:, :-1])
    vb = val_batches(tokens, 4, 10, max_batches=3)
    assert len(vb) == 3 and torch.equal(vb[0][0][0], tokens[:10])
