"""Corpus, tokenizer and per-data-node shards, all offline, deterministic and streamed.

The corpus (:mod:`node.train.corpus`: a built-in name, a text file, a folder of .txt/.md files, a
.jsonl or .parquet file) is read as a stream of documents. Each document goes to the validation split
when a hash of its text falls below ``val_fraction`` (so the split is a pure function of the document,
the same on every node and independent of its position), else to the train split. The tokenizer
(:mod:`node.train.tokenizer`: bytes, a byte-level BPE trained on the train documents, or a
tokenizer.json) encodes both splits once into flat token files in the cache folder; a data node
memory-maps them and reads only the windows of its microbatches, so a corpus larger than memory works
and a node never holds more than the windows it is training on.

Shards: the train stream is cut into non-overlapping windows of ``seq_len + 1`` tokens; data node
``r`` of ``R`` owns windows ``r, r+R, r+2R, ...`` so shards are disjoint. Which windows form
microbatch ``j`` of iteration ``i`` is a pure function of ``(seed, r, i, j)``, which is what lets the
single-process reference replay the swarm's exact batches.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
from dataclasses import dataclass, replace
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from node.errors import UserError
from node.spec import DEFAULT_MICROBATCH_SIZE
from node.train.corpus import CORPORA, check_corpus, corpus_identity, default_tokenizer_cache_path, iter_documents
from node.train.tokenizer import (DEFAULT_BPE_VOCAB, ByteTokenizer, HFTokenizer, TokenizerSpec, load_tokenizer_file,
                                  parse_tokenizer_spec, train_bpe)

__all__ = [
    "CORPORA",
    "DataConfig",
    "ByteTokenizer",
    "HFTokenizer",
    "TokenSplits",
    "DataShard",
    "load_corpus_text",
    "load_tokenizer",
    "resolve_data_config",
    "tokenizer_spec_of",
    "load_splits",
    "validation_batches",
    "default_cache_dir",
    "corpus_fingerprint",
    "is_validation_document",
    "DOCUMENT_SEPARATOR",
]

logger = logging.getLogger(__name__)

#: Fraction of the documents (by hash) held out for validation.
DEFAULT_VAL_FRACTION = 0.05
#: Text appended after every document before it is tokenised.
DOCUMENT_SEPARATOR = "\n\n"
#: Documents encoded per tokenizer call while building the token files.
_ENCODE_BATCH = 512
#: Bumped when the layout of the token files changes.
_TOKENS_FORMAT = 2


def default_cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("SKIPPIPE_CACHE", pathlib.Path.home() / ".cache" / "skippipe"))


@dataclass(frozen=True)
class DataConfig:
    """What a data node reads and how it batches it.

    ``tokenizer`` is ``byte``, ``bpe`` (trained on the corpus, ``bpe_vocab_size`` tokens) or the path
    of a tokenizer.json; ``tokenizer_hash`` is the resolved tokenizer's digest (:func:`resolve_data_config`),
    part of the run configuration every member compares (empty: not resolved yet)."""

    corpus: str = "shakespeare"
    tokenizer: str = "byte"
    bpe_vocab_size: int = DEFAULT_BPE_VOCAB
    seq_len: int = 64
    microbatch_size: int = DEFAULT_MICROBATCH_SIZE  # sequences per microbatch
    val_fraction: float = DEFAULT_VAL_FRACTION
    seed: int = 0
    text_field: str = "text"
    tokenizer_hash: str = ""


def load_corpus_text(corpus: str, text_field: str = "text") -> str:
    """The whole corpus as one string (small corpora, tests); training streams instead."""
    text = DOCUMENT_SEPARATOR.join(iter_documents(corpus, text_field))
    if not text:
        raise UserError(f"corpus {corpus!r} is empty")
    return text


def is_validation_document(text: str, val_fraction: float) -> bool:
    """Deterministic split by the document's content: the same document is held out everywhere."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") < val_fraction * 2.0 ** 64


def _check_fraction(val_fraction: float) -> None:
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"val_fraction must be in (0, 1), got {val_fraction}")


def _train_documents(cfg: DataConfig) -> Iterator[str]:
    for doc in iter_documents(cfg.corpus, cfg.text_field):
        if not is_validation_document(doc, cfg.val_fraction):
            yield doc + DOCUMENT_SEPARATOR


def tokenizer_spec_of(cfg: DataConfig) -> TokenizerSpec:
    if cfg.tokenizer in ("byte", "bytes"):
        return TokenizerSpec("byte", 256)
    if cfg.tokenizer == "bpe":
        return parse_tokenizer_spec(f"bpe:{cfg.bpe_vocab_size}")
    return parse_tokenizer_spec(cfg.tokenizer)


def load_tokenizer(cfg: DataConfig, cache_dir: Optional[pathlib.Path] = None):
    """The run's tokenizer: bytes, a BPE trained once on the corpus's train documents (cached next to
    the data, or in the cache folder for a built-in corpus), or a tokenizer.json. Raises UserError if
    ``cfg.tokenizer_hash`` is set and the tokenizer found here is a different one."""
    _check_fraction(cfg.val_fraction)
    spec = tokenizer_spec_of(cfg)
    if spec.kind == "byte":
        tok = ByteTokenizer()
    elif spec.kind == "file":
        tok = load_tokenizer_file(spec.path)
    else:
        cache = cache_dir or default_cache_dir()
        path = default_tokenizer_cache_path(cfg.corpus, cfg.text_field, spec.vocab_size, cache)
        if path.exists():
            tok = load_tokenizer_file(path)
        else:
            check_corpus(cfg.corpus, cfg.text_field)
            tok = train_bpe(_train_documents(cfg), spec.vocab_size, path)
    if cfg.tokenizer_hash and cfg.tokenizer_hash != tok.hash:
        raise UserError(f"tokenizer {cfg.tokenizer!r} here has hash {tok.hash}, but the run uses {cfg.tokenizer_hash}: "
                        "every node must use the same tokenizer (copy the run's tokenizer.json and pass its path)")
    return tok


def resolve_data_config(cfg: DataConfig, cache_dir: Optional[pathlib.Path] = None,
                        reads_corpus: bool = True) -> Tuple[DataConfig, object]:
    """``(cfg with tokenizer_hash filled in, tokenizer)``; checks the corpus up front on a node that
    reads it (``reads_corpus``: a data node, or one that may become one). A node that never holds
    stage 0 needs the corpus only to train a ``bpe:VOCAB`` tokenizer, and not even then when it is
    given the tokenizer.json."""
    if reads_corpus:
        check_corpus(cfg.corpus, cfg.text_field)
    try:
        tok = load_tokenizer(cfg, cache_dir)
    except UserError as e:
        if reads_corpus or tokenizer_spec_of(cfg).kind != "bpe":
            raise
        raise UserError(f"{e} (this node holds no data stage, but training the bpe tokenizer needs the corpus: "
                        "pass the run's tokenizer.json with --tokenizer PATH instead)") from None
    return replace(cfg, tokenizer_hash=tok.hash), tok


@dataclass
class TokenSplits:
    """Train/validation token streams: 1-D integer arrays, memory-mapped from the cache files."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int


def _token_files(cfg: DataConfig, tok, cache: pathlib.Path) -> Tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
    key = hashlib.sha256(json.dumps([_TOKENS_FORMAT, corpus_identity(cfg.corpus, cfg.text_field), cfg.text_field,
                                     tok.hash, cfg.val_fraction]).encode()).hexdigest()[:16]
    label = cfg.corpus if cfg.corpus in CORPORA else pathlib.Path(cfg.corpus).name
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)[:40]
    stem = f"tokens-{safe}-{key}"
    return cache / f"{stem}.train.bin", cache / f"{stem}.val.bin", cache / f"{stem}.json"


def _build_token_files(cfg: DataConfig, tok, train_path: pathlib.Path, val_path: pathlib.Path,
                       meta_path: pathlib.Path) -> None:
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    train_path.parent.mkdir(parents=True, exist_ok=True)
    suffix = f".{os.getpid()}.tmp"
    tmp_train, tmp_val = train_path.with_name(train_path.name + suffix), val_path.with_name(val_path.name + suffix)
    counts = {"train": 0, "val": 0, "documents_train": 0, "documents_val": 0}
    try:
        with open(tmp_train, "wb") as ft, open(tmp_val, "wb") as fv:
            batch: List[Tuple[bool, str]] = []

            def flush() -> None:
                ids = tok.encode_batch([t for _, t in batch])
                for (is_val, _), arr in zip(batch, ids):
                    (fv if is_val else ft).write(np.asarray(arr, dtype=dtype).tobytes())
                    counts["val" if is_val else "train"] += len(arr)
                    counts["documents_val" if is_val else "documents_train"] += 1
                batch.clear()

            for doc in iter_documents(cfg.corpus, cfg.text_field):
                batch.append((is_validation_document(doc, cfg.val_fraction), doc + DOCUMENT_SEPARATOR))
                if len(batch) >= _ENCODE_BATCH:
                    flush()
            if batch:
                flush()
        if counts["documents_train"] + counts["documents_val"] == 0:
            raise UserError(f"corpus {cfg.corpus!r} holds no text")
        os.replace(tmp_train, train_path)
        os.replace(tmp_val, val_path)
    finally:
        for t in (tmp_train, tmp_val):
            if t.exists():
                t.unlink()
    meta = dict(counts, dtype=np.dtype(dtype).name, vocab_size=tok.vocab_size, tokenizer_hash=tok.hash,
                corpus=cfg.corpus)
    tmp = meta_path.with_name(meta_path.name + suffix)
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, meta_path)


def _map(path: pathlib.Path, dtype: str) -> np.ndarray:
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def load_splits(cfg: DataConfig, cache_dir: Optional[pathlib.Path] = None) -> TokenSplits:
    """Tokenised train/validation streams, built once (streaming) and memory-mapped from the cache."""
    cache = cache_dir or default_cache_dir()
    tok = load_tokenizer(cfg, cache)
    train_path, val_path, meta_path = _token_files(cfg, tok, cache)
    if not meta_path.exists():
        logger.info("tokenising corpus %s with %s (vocab %d)", cfg.corpus, tok.name, tok.vocab_size)
        _build_token_files(cfg, tok, train_path, val_path, meta_path)
    meta = json.loads(meta_path.read_text())
    train, val = _map(train_path, meta["dtype"]), _map(val_path, meta["dtype"])
    if len(train) == 0:
        raise UserError(f"corpus {cfg.corpus!r}: every document went to validation; it needs more documents")
    if len(val) == 0:
        raise UserError(f"corpus {cfg.corpus!r} has too few documents for a validation split "
                        f"({meta['documents_train']} documents, val_fraction {cfg.val_fraction}); "
                        "split it into more documents (blank lines between paragraphs, one JSON record each)")
    return TokenSplits(train, val, tok.vocab_size)


class _Windows:
    """Lazy (N, seq_len+1) view of every ``step``-th window of a token stream, from ``first``."""

    def __init__(self, tokens: np.ndarray, seq_len: int, first: int = 0, step: int = 1):
        self.tokens, self.seq_len, self.first, self.step = tokens, seq_len, first, step
        total = (len(tokens) - 1) // seq_len
        self.n = len(range(first, total, step)) if total > 0 else 0

    def __len__(self) -> int:
        return self.n

    def rows(self, idx: Sequence[int]) -> torch.Tensor:
        out = np.empty((len(idx), self.seq_len + 1), dtype=np.int64)
        for k, i in enumerate(idx):
            i = int(i)
            if not 0 <= i < self.n:
                raise IndexError(f"window {i} of {self.n}")
            start = (self.first + i * self.step) * self.seq_len
            out[k] = self.tokens[start : start + self.seq_len + 1]
        return torch.from_numpy(out)

    def __getitem__(self, key) -> torch.Tensor:
        if isinstance(key, slice):
            return self.rows(range(*key.indices(self.n)))
        if isinstance(key, (int, np.integer)):
            return self.rows([key])[0]
        if isinstance(key, torch.Tensor):
            key = key.tolist()
        return self.rows(list(np.asarray(key).reshape(-1)))


def _windows(tokens: np.ndarray, seq_len: int, first: int = 0, step: int = 1) -> _Windows:
    """Non-overlapping (seq_len+1)-token windows (input + shifted target), read lazily."""
    if seq_len < 1 or (len(tokens) - 1) // seq_len <= 0:
        raise UserError(f"corpus too small for seq_len {seq_len}")
    return _Windows(tokens, seq_len, first, step)


def _rng(*parts: int) -> np.random.Generator:
    return np.random.default_rng([int(p) for p in parts])


class DataShard:
    """The train windows owned by data node ``shard_index`` of ``num_shards``."""

    def __init__(self, splits: TokenSplits, cfg: DataConfig, shard_index: int, num_shards: int):
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard {shard_index} of {num_shards}")
        self.cfg, self.shard_index, self.num_shards = cfg, shard_index, num_shards
        self.windows = _windows(splits.train, cfg.seq_len, shard_index, num_shards)  # lazy: memory-mapped
        if len(self.windows) < cfg.microbatch_size:
            raise UserError(f"shard {shard_index} of {num_shards} has only {len(self.windows)} windows of {cfg.seq_len + 1} tokens, "
                            f"fewer than a microbatch ({cfg.microbatch_size}): the corpus is too small")

    def window_ids(self, iteration: int, microbatch: int) -> np.ndarray:
        """Indices (into this shard) of the sequences of one microbatch; deterministic."""
        rng = _rng(self.cfg.seed, self.shard_index, iteration, microbatch)
        return rng.choice(len(self.windows), size=self.cfg.microbatch_size, replace=False)

    def batch(self, iteration: int, microbatch: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (microbatch_size, seq_len) int64; targets never leave the data node."""
        rows = self.windows.rows(self.window_ids(iteration, microbatch))
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
        raise UserError(f"validation split of corpus {cfg.corpus!r} is too small for one batch of "
                        f"{cfg.microbatch_size} x {cfg.seq_len} tokens")
    return out


def corpus_fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
