"""Tokenizers: ``bytes`` (vocab 256), a byte-level BPE trained on the corpus (``bpe:VOCAB``), or a
Hugging Face ``tokenizer.json`` file.

Every tokenizer has a :attr:`~Tokenizer.hash`, a digest of its canonical JSON form. It goes into the
run's data configuration (``DataConfig.tokenizer_hash``) that every member compares before the first
iteration, so two nodes can never train one model with different vocabularies.

The byte tokenizer is also expressible as a ``tokenizers`` byte-level BPE without merges whose id of
a byte is the byte's value, so an export (:mod:`node.eval.export`) ships a ``tokenizer.json`` whatever
tokenizer the run used.

Spec strings (``--tokenizer``): ``bytes`` (or ``byte``), ``bpe:VOCAB`` (``bpe`` alone = 4096), or the
path of a ``tokenizer.json`` (a folder holding one works too).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Optional, Sequence

import numpy as np

from node.errors import UserError

__all__ = [
    "TokenizerSpec",
    "parse_tokenizer_spec",
    "ByteTokenizer",
    "HFTokenizer",
    "byte_to_unicode",
    "byte_level_tokenizer_json",
    "train_bpe",
    "load_tokenizer_file",
    "DEFAULT_BPE_VOCAB",
]

logger = logging.getLogger(__name__)

DEFAULT_BPE_VOCAB = 4096
#: Smallest BPE vocabulary: the 256 byte symbols must fit.
MIN_BPE_VOCAB = 257


@dataclass(frozen=True)
class TokenizerSpec:
    kind: str  # "byte" | "bpe" | "file"
    vocab_size: int = 0  # requested BPE vocab (kind "bpe")
    path: Optional[pathlib.Path] = None  # kind "file"

    @property
    def config_name(self) -> str:
        """What ``DataConfig.tokenizer`` records."""
        return {"byte": "byte", "bpe": "bpe"}.get(self.kind, str(self.path))


def parse_tokenizer_spec(text: str, default_bpe_vocab: int = DEFAULT_BPE_VOCAB) -> TokenizerSpec:
    """``bytes`` | ``bpe:VOCAB`` | ``PATH/tokenizer.json``; anything else is a UserError."""
    t = (text or "").strip()
    if t in ("byte", "bytes"):
        return TokenizerSpec("byte", 256)
    if t == "bpe" or t.startswith("bpe:"):
        raw = t[4:] if t.startswith("bpe:") else str(default_bpe_vocab)
        try:
            vocab = int(raw)
        except ValueError:
            raise UserError(f"--tokenizer bpe:VOCAB needs an integer vocabulary size, got {text!r}") from None
        if vocab < MIN_BPE_VOCAB:
            raise UserError(f"--tokenizer bpe:{vocab}: the vocabulary must hold at least {MIN_BPE_VOCAB} tokens "
                            "(the 256 bytes plus merges)")
        return TokenizerSpec("bpe", vocab)
    if not t:
        raise UserError("--tokenizer is empty; use bytes, bpe:VOCAB or PATH/tokenizer.json")
    path = pathlib.Path(t).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.exists():
        raise UserError(f"--tokenizer {text!r}: no such file (use bytes, bpe:VOCAB or PATH/tokenizer.json)")
    return TokenizerSpec("file", 0, path)


def byte_to_unicode() -> Dict[int, str]:
    """The byte-level alphabet of GPT-2-style BPE: printable bytes map to themselves, the others to
    code points from 256 upwards, in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _hash_json(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def byte_level_tokenizer_json() -> str:
    """A ``tokenizers`` JSON whose encoding of any text is its UTF-8 bytes (id = byte value)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, nothing to train or download."""

    vocab_size = 256
    name = "byte"
    #: fixed: the byte tokenizer never changes
    hash = _hash_json("skippipe-byte-tokenizer-v1")

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def encode_batch(self, texts: Sequence[str]) -> List[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def to_json(self) -> str:
        return byte_level_tokenizer_json()


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` (trained byte-level BPE or a tokenizer.json)."""

    def __init__(self, tokenizer, name: str = "bpe") -> None:
        self._tok = tokenizer
        self.name = name
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self.hash = _hash_json(tokenizer.to_str())

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.int64)

    def encode_batch(self, texts: Sequence[str]) -> List[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int64) for e in self._tok.encode_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def to_json(self) -> str:
        return self._tok.to_str()


def load_tokenizer_file(path: pathlib.Path) -> HFTokenizer:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UserError("the tokenizers package is needed for BPE tokenizers (pip install tokenizers)") from None
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception type on bad JSON
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"cannot read tokenizer {path}: {first[:200]}") from None
    return HFTokenizer(tok, name="bpe")


def train_bpe(documents: Iterable[str], vocab_size: int, path: pathlib.Path) -> HFTokenizer:
    """Train a byte-level BPE on ``documents`` (streamed) and save it atomically at ``path``."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise UserError("the tokenizers package is needed for --tokenizer bpe:VOCAB (pip install tokenizers)") from None
    logger.info("training a %d-token byte-level BPE (cached at %s)", vocab_size, path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_batched(documents), trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tok.save(str(tmp))
    os.replace(tmp, path)
    return HFTokenizer(tok, name="bpe")


def _batched(documents: Iterable[str], size: int = 256) -> Iterator[List[str]]:
    batch: List[str] = []
    for d in documents:
        batch.append(d)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch
