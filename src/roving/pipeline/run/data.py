"""Training text: real English prose that is available offline, byte-level tokens, a held-out split.

Where the text comes from, first found wins:

1. files or folders the user names (``corpus = [...]`` / ``--corpus``): every ``.txt``, ``.md``,
   ``.rst`` file (or ``.gz`` of one) under them;
2. the Jargon File, ``/usr/share/doc/jargon-text/jargon.txt.gz`` (Debian package ``jargon-text``,
   public domain, about 1.7 MB of English prose: definitions written as essays and anecdotes);
3. the licence texts every Debian system ships in ``/usr/share/common-licenses`` (package
   ``base-files``; about 250 kB of formal English) -- small, but always there, so tests can rely on it.

The tokenizer is byte-level: token = UTF-8 byte, vocabulary 256. It needs no training, covers any text,
and makes the loss directly comparable between runs (bits per byte = loss / ln 2).

The last ``val_fraction`` of the text is the validation split; training never sees it.
"""

from __future__ import annotations

import gzip
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch

from ..errors import DataError

log = logging.getLogger(__name__)

VOCAB_SIZE = 256
JARGON = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
LICENSES = Path("/usr/share/common-licenses")
TEXT_SUFFIXES = (".txt", ".md", ".rst", "")


def _read(path: Path) -> str:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return raw.decode("utf-8", errors="replace")


def _text_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    files = []
    for p in sorted(root.rglob("*")):
        stem_suffix = Path(p.stem).suffix if p.suffix == ".gz" else p.suffix
        if p.is_file() and not p.is_symlink() and stem_suffix in TEXT_SUFFIXES:
            files.append(p)
    return files


def default_sources() -> list[Path]:
    """The first built-in source present on this machine (see the module doc)."""
    if JARGON.is_file():
        return [JARGON]
    if LICENSES.is_dir():
        return [LICENSES]
    raise DataError("no corpus given and none found on this machine: install the Debian package "
                    "jargon-text, or name text files or folders with --corpus")


def load_text(sources: Sequence[str | Path] | None = None) -> tuple[str, list[str]]:
    """The concatenated text of ``sources`` (default: ``default_sources()``) and the files it came from."""
    roots = [Path(s) for s in sources] if sources else default_sources()
    files: list[Path] = []
    for root in roots:
        if not root.exists():
            raise DataError(f"corpus path {root} does not exist")
        found = _text_files(root)
        if not found:
            raise DataError(f"corpus path {root} holds no text files (.txt, .md, .rst or .gz of them)")
        files.extend(found)
    text = "\n\n".join(_read(f) for f in files)
    return text, [str(f) for f in files]


def encode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def decode(tokens: Iterable[int]) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


@dataclass
class Corpus:
    train: torch.Tensor
    val: torch.Tensor
    files: list[str]

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE


def load_corpus(sources: Sequence[str | Path] | None = None, *, val_fraction: float = 0.1,
                seq_len: int, batch_samples: int) -> Corpus:
    """Tokens split into train and validation. Raises DataError when either split is too small for one
    batch of ``batch_samples`` sequences of ``seq_len`` (+1 for the shifted targets)."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    text, files = load_text(sources)
    tokens = encode(text)
    cut = int(len(tokens) * (1.0 - val_fraction))
    train, val = tokens[:cut], tokens[cut:]
    need = batch_samples * (seq_len + 1)
    if len(train) < need or len(val) < seq_len + 1:
        raise DataError(f"corpus too small: {len(tokens)} tokens from {len(files)} file(s) give {len(train)} "
                        f"for training and {len(val)} for validation, but one batch needs {need} "
                        f"({batch_samples} samples of {seq_len}+1) and validation {seq_len + 1}; give more text "
                        "with --corpus or lower the sequence length or microbatch size")
    log.info("corpus: %d train and %d validation tokens from %d file(s)", len(train), len(val), len(files))
    return Corpus(train, val, files)


def train_batches(tokens: torch.Tensor, samples: int, seq_len: int,
                  seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (inputs, targets) batches of random windows; the same seed gives the same batches."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(tokens) - seq_len, (samples,), generator=gen)
        windows = torch.stack([tokens[s:s + seq_len + 1] for s in starts.tolist()])
        yield windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def val_batches(tokens: torch.Tensor, samples: int, seq_len: int,
                max_batches: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The validation split as consecutive, non-overlapping windows in fixed batches (the same every
    evaluation), at most ``max_batches`` of them spread over the whole split."""
    n = (len(tokens) - 1) // seq_len
    windows = [tokens[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)]
    batches = [windows[i:i + samples] for i in range(0, len(windows), samples)]
    if max_batches is not None and len(batches) > max_batches:
        step = len(batches) / max_batches
        batches = [batches[int(i * step)] for i in range(max_batches)]
    out = []
    for b in batches:
        w = torch.stack(b)
        out.append((w[:, :-1].contiguous(), w[:, 1:].contiguous()))
    return out
