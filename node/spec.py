"""The training flags every member of a run shares, typed once: :class:`TrainSpec`.

``node run --train`` and ``skippipe up`` take their defaults from it, :meth:`TrainSpec.from_args` reads a
parsed command line into it (a command that lacks a flag gets the default), and :meth:`TrainSpec.join_argv`
writes the flags a joiner must repeat (the founder's printed join command). A shared module: it imports
nothing of node's subpackages, so the command line, the daemon's banner and the compose checks read the
same numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

__all__ = ["TrainSpec", "DEFAULT_TRAIN_ITERATIONS", "DEFAULT_MICROBATCH_SIZE"]

#: iterations a run trains when ``--iterations`` is not given (a short demonstration run)
DEFAULT_TRAIN_ITERATIONS = 100
#: sequences per microbatch when ``--microbatch-size`` is not given (fits the tiny model on a laptop CPU)
DEFAULT_MICROBATCH_SIZE = 8


def _fmt(value: float) -> str:
    return repr(float(value)) if not float(value).is_integer() else str(float(value))


@dataclass(frozen=True)
class TrainSpec:
    """Model, data, optimiser, precision/wire and checkpointing of a run, plus this node's stage choice."""

    train: bool = False
    model: str = "tiny"
    model_config: Optional[Path] = None
    corpus: str = "shakespeare"
    text_field: str = "text"
    tokenizer: Optional[str] = None
    iterations: int = DEFAULT_TRAIN_ITERATIONS
    lr: Optional[float] = None
    seed: int = 0
    microbatch_size: int = DEFAULT_MICROBATCH_SIZE
    seq_len: Optional[int] = None
    precision: str = "auto"
    wire: str = "fp32"
    min_members: int = 1
    checkpoint_dir: Optional[Path] = None
    checkpoint_every: int = 10
    #: the run's stage count (None: the founder's, from the hello handshake)
    num_stages: Optional[int] = None
    #: this node's stages (None with ``--auto``)
    stages: Optional[Sequence[int]] = None
    auto: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TrainSpec":
        """The spec of a parsed command line: the flags it has, the defaults for those it lacks (``up``,
        ``eval`` and tests parse fewer flags than ``node run``)."""
        given = vars(args)
        spec = cls(**{f.name: given[f.name] for f in dataclasses.fields(cls) if f.name in given})
        # an explicit None (a flag without a default) stands for the default, as on the command line
        return dataclasses.replace(spec, model=spec.model or cls.model, text_field=spec.text_field or cls.text_field)

    def join_argv(self) -> List[str]:
        """The ``--train ...`` flags a joiner needs to train in this run (empty without ``--train``).

        The run's ``--num-stages``, ``--path-length`` and ``--microbatches`` come from the founder in the hello
        handshake, so they are not repeated; the precision is the founder's resolved one (a joiner's GPU may
        differ), never ``auto``."""
        if not self.train:
            return []
        flags = ["--train"]
        if self.model_config is not None:
            flags += ["--model-config", str(self.model_config)]
        else:
            flags += ["--model", str(self.model)]
        flags += ["--corpus", str(self.corpus)]
        if self.text_field != TrainSpec.text_field:
            flags += ["--text-field", str(self.text_field)]
        if self.tokenizer:
            flags += ["--tokenizer", str(self.tokenizer)]
        flags += ["--iterations", str(self.iterations)]
        if self.lr is not None:
            flags += ["--lr", _fmt(self.lr)]
        flags += ["--seed", str(self.seed), "--microbatch-size", str(self.microbatch_size)]
        if self.seq_len is not None:
            flags += ["--seq-len", str(self.seq_len)]
        if self.precision not in (None, "auto"):
            flags += ["--precision", str(self.precision)]
        if self.wire != TrainSpec.wire:
            flags += ["--wire", str(self.wire)]
        if self.min_members != TrainSpec.min_members:
            flags += ["--min-members", str(self.min_members)]
        if self.checkpoint_dir is not None:
            flags += ["--checkpoint-dir", str(self.checkpoint_dir), "--checkpoint-every", str(self.checkpoint_every)]
        return flags
