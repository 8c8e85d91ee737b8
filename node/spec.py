"""The run every daemon of a swarm shares, typed once: :class:`TrainSpec`.

Model, data, optimiser, device/precision/wire, schedule and swarm settings of a run, plus this node's stage
choice. ``node run`` and ``skippipe up`` take their defaults from it, :meth:`TrainSpec.from_args` reads a parsed
command line into it (a command that lacks a flag gets the default), :meth:`TrainSpec.to_argv` writes it back
as ``node run`` flags (``from_args(parse(to_argv(spec))) == spec``), and :meth:`TrainSpec.join_argv` is the
part a joiner repeats (the founder's printed join command). ``skippipe up`` builds one spec and starts every
daemon from its ``to_argv()`` plus the per-node flags (stage, ports, peers). A shared module: it imports
nothing of node's subpackages, so the command line, the daemons, the join banner and the compose checks read
the same numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

__all__ = ["TrainSpec", "DEFAULT_TRAIN_ITERATIONS", "DEFAULT_MICROBATCH_SIZE", "DEFAULT_MICROBATCHES",
           "DEFAULT_HEARTBEAT_S", "DEFAULT_RUN_ID", "DEFAULT_MEMORY_SLOTS", "DEFAULT_ITERATION_TIMEOUT_S",
           "DEFAULT_AGREEMENT_TIMEOUT_S", "DEADLINE_SOURCES", "HEDGING_MODES", "BRANCH_SCALING_MODES", "JOIN_FIELDS", "flag_of"]

#: iterations a run trains when ``--iterations`` is not given (a short demonstration run)
DEFAULT_TRAIN_ITERATIONS = 100
#: sequences per microbatch when ``--microbatch-size`` is not given (fits the tiny model on a laptop CPU)
DEFAULT_MICROBATCH_SIZE = 8
#: microbatches each data node feeds per iteration (two keep a 2-stage pipeline busy in both directions)
DEFAULT_MICROBATCHES = 2
#: seconds between two re-announcements of a node's stage adverts (and view refreshes)
DEFAULT_HEARTBEAT_S = 5.0
#: run id used when none is given; peers of different runs refuse to join each other
DEFAULT_RUN_ID = "skippipe"
#: in-flight microbatches a node accepts (the reference runtime's ``memory`` = 3)
DEFAULT_MEMORY_SLOTS = 3
#: seconds an iteration may take before training stops as stalled (a 500M stage on a slow CPU fits)
DEFAULT_ITERATION_TIMEOUT_S = 600.0
#: seconds to wait for every member of the pinned epoch to confirm it (volunteers start minutes apart)
DEFAULT_AGREEMENT_TIMEOUT_S = 600.0

#: Where a data node's microbatch deadlines come from: ``observed`` round trips of each route once it has enough
#: of them (median + k x MAD, the cost model before that), or the cost ``model`` only. The second is the control of
#: a straggler benchmark: the budgets a slow replica's microbatches get without observation.
DEADLINE_SOURCES = ("observed", "model")
#: Whether a data node hedges a late microbatch on other replicas (``on``) or only waits for its deadline
#: (``off``: the other control of the straggler benchmark).
HEDGING_MODES = ("on", "off")
#: How a visited stage's residual branches are scaled in training (node.train.branch_scaling): ``inverse``
#: (by 1/visit share, the measured best) or ``none`` (plain skip training). Every member must agree.
BRANCH_SCALING_MODES = ("inverse", "none")

#: What a joiner must repeat to train in the founder's run: what every member compares before training
#: (model, data, optimiser, precision, wire), the start condition and the checkpoint settings. The run's
#: stage count, path length and microbatches come from the founder in the hello handshake; the device and
#: the timeouts are each machine's own.
JOIN_FIELDS = ("train", "model", "model_config", "corpus", "text_field", "tokenizer", "iterations", "lr", "seed",
               "microbatch_size", "seq_len", "precision", "wire", "branch_scaling", "min_members", "checkpoint_dir",
               "checkpoint_every")


def flag_of(field_name: str) -> str:
    """The ``node run`` flag of a :class:`TrainSpec` field: ``min_members`` -> ``--min-members``."""
    return "--" + field_name.replace("_", "-")


def _flag_value(value) -> str:
    if isinstance(value, bool):
        raise TypeError("a bool is a flag, not a value")
    if isinstance(value, float):
        return repr(value)  # the shortest text that parses back to the same float
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    if isinstance(value, Path) and str(value).startswith("-"):
        return f"./{value}"  # the same path, and argparse reads neither a flag nor its "--" separator in it
    if value == "--":
        # argparse (3.11) reads "--flag=--" as the end-of-options marker and gives the flag []
        raise ValueError('"--" cannot be passed as a flag value; choose another')
    return str(value)


@dataclass(frozen=True)
class TrainSpec:
    """One run's settings as ``node run`` flags: each field is the flag ``--field-name`` (underscores as
    dashes), in the order :meth:`to_argv` writes them."""

    # model and data
    train: bool = False
    model: str = "tiny"
    model_config: Optional[Path] = None
    corpus: str = "shakespeare"
    text_field: str = "text"
    tokenizer: Optional[str] = None
    # optimiser and run length
    iterations: int = DEFAULT_TRAIN_ITERATIONS
    lr: Optional[float] = None
    seed: int = 0
    microbatch_size: int = DEFAULT_MICROBATCH_SIZE
    seq_len: Optional[int] = None
    # device, precision, wire
    device: str = "cpu"
    precision: str = "auto"
    wire: str = "fp32"
    #: one of :data:`BRANCH_SCALING_MODES`
    branch_scaling: str = BRANCH_SCALING_MODES[0]
    # start condition and checkpoints
    min_members: int = 1
    checkpoint_dir: Optional[Path] = None
    checkpoint_every: int = 10
    resume: bool = False
    # schedule (a founder's; joiners take the run's from the hello handshake)
    #: the run's stage count (None: the founder's, from the hello handshake)
    num_stages: Optional[int] = None
    #: stages each microbatch visits, stage 0 included (None: all; num_stages - path_length are skipped)
    path_length: Optional[int] = None
    microbatches: int = DEFAULT_MICROBATCHES
    memory_slots: int = DEFAULT_MEMORY_SLOTS
    # swarm
    run_id: str = DEFAULT_RUN_ID
    heartbeat: float = DEFAULT_HEARTBEAT_S
    threads: Optional[int] = None
    iteration_timeout: float = DEFAULT_ITERATION_TIMEOUT_S
    agreement_timeout: float = DEFAULT_AGREEMENT_TIMEOUT_S
    #: one of :data:`DEADLINE_SOURCES`; each data node's own policy (members need not agree on it)
    deadlines: str = DEADLINE_SOURCES[0]
    #: one of :data:`HEDGING_MODES`; each data node's own policy too
    hedging: str = HEDGING_MODES[0]
    # this node's stage choice: one of them, never both
    #: this node's stages (None with ``--auto``)
    stages: Optional[Tuple[int, ...]] = None
    auto: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace, base: Optional["TrainSpec"] = None) -> "TrainSpec":
        """The spec of a parsed command line: the flags it has, ``base``'s values (the defaults without one)
        for those it lacks (``up``, ``eval`` and tests parse fewer flags than ``node run``)."""
        base = base if base is not None else cls()
        given = vars(args)
        spec = dataclasses.replace(base, **{f.name: given[f.name] for f in dataclasses.fields(cls) if f.name in given})
        # an explicit None (a flag without a default) stands for the default, as on the command line
        return dataclasses.replace(spec, model=spec.model or base.model, text_field=spec.text_field or base.text_field)

    def to_argv(self, always: Iterable[str] = ()) -> List[str]:
        """``node run`` flags for every field that differs from its default (and the fields in ``always``,
        which are written even at their default), in field order; a value that starts with ``-`` is written
        as ``--flag=value`` so that it is not read as a flag."""
        always, values = set(always), vars(self)
        argv: List[str] = []
        for f in dataclasses.fields(self):
            value = values[f.name]
            if value is None or (value == f.default and f.name not in always):
                continue
            flag = flag_of(f.name)
            if isinstance(value, bool):
                argv += [flag] if value else []
                continue
            text = _flag_value(value)
            argv += [f"{flag}={text}"] if text.startswith("-") else [flag, text]
        return argv

    def join_argv(self) -> List[str]:
        """The ``--train ...`` flags a joiner needs to train in this run (empty without ``--train``): the
        :data:`JOIN_FIELDS` of :meth:`to_argv`, with the model, corpus, run length, seed and microbatch size
        spelled out even at their defaults (a joiner's version may default otherwise). The precision is the
        founder's resolved one (a joiner's GPU may differ), never ``auto``."""
        if not self.train:
            return []
        shared = dataclasses.replace(TrainSpec(), **{name: vars(self)[name] for name in JOIN_FIELDS})
        always = ["corpus", "iterations", "seed", "microbatch_size"]
        always += ["model"] if self.model_config is None else []
        always += ["checkpoint_every"] if self.checkpoint_dir is not None else []
        return shared.to_argv(always=always)
