"""The run's flags, declared once: every :class:`node.spec.TrainSpec` field a command takes on its command line.

``node run``, ``skippipe up`` and ``swarm local`` call :func:`add_run_arguments` with the fields they take and
their own defaults (a spec), so a flag's type, range, choices and help are written in one place and a
command's defaults are its spec's (``up``'s ``--iterations`` is 40 because ``UP_SPEC.iterations`` is). A
command may rename a flag (``up --memory``) or say what a default means for it (``help``), nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence

from node.cli.validate import (MAX_DURATION_S, MAX_MEMORY_SLOTS, MAX_MICROBATCHES, MAX_NODES, MAX_STAGES, MAX_THREADS,
                               float_range, int_range)
from node.spec import BRANCH_SCALING_MODES, DEADLINE_SOURCES, HEDGING_MODES, TrainSpec, flag_of
from node.train.precision import DEVICES, PRECISIONS
from protocol.compression import WIRE_TABLE

__all__ = ["RunFlag", "RUN_FLAGS", "add_run_arguments", "MODEL_SIZE_NAMES", "MODEL_DATA_FIELDS",
           "PRECISION_WIRE_FIELDS"]

#: ``--model`` choices: the keys of :data:`node.train.model.MODEL_SIZES`, written out so that parsing the
#: command line does not import torch (tests/node_units/test_run_spec.py checks that they agree)
MODEL_SIZE_NAMES = ("tiny", "small", "500m")
#: Model and data flags (``node run --train`` and ``up``: same names, same meaning).
MODEL_DATA_FIELDS = ("model", "model_config", "corpus", "text_field", "tokenizer")
#: Compute precision and wire format (``node run --train`` and ``up``).
PRECISION_WIRE_FIELDS = ("precision", "wire")


@dataclass(frozen=True)
class RunFlag:
    """How one spec field is typed on a command line. ``help`` may say ``{default}``: the command's default,
    or ``unset`` when that is None (what an unset flag means)."""

    help: str
    type: Optional[Callable[[str], object]] = None
    choices: Optional[Sequence[str]] = None
    metavar: Optional[str] = None
    unset: str = "none"

    def help_for(self, default, text: Optional[str] = None) -> str:
        """``text`` (this flag's help when not given) with ``{default}`` filled in, safe for argparse's %-format."""
        shown = self.unset if default is None else str(default).replace("%", "%%")
        return (self.help if text is None else text).format(default=shown)


#: Every field of :class:`TrainSpec` that a command line sets (``stages`` and ``auto`` are ``node run``'s
#: own exclusive choice, declared there); booleans are ``store_true`` flags.
RUN_FLAGS: Mapping[str, RunFlag] = {
    "train": RunFlag("run a trainer for this node's stage inside the daemon"),
    "model": RunFlag("named model size (its stage count follows the run's --num-stages; default {default})",
                     choices=MODEL_SIZE_NAMES),
    "model_config": RunFlag("model shape from a JSON file instead of --model: layers, d_model, heads, kv_heads, ffn, "
                            "vocab (optional: the tokenizer's), context, stages", type=Path, metavar="model.json"),
    "corpus": RunFlag("data nodes' corpus: shakespeare, sotu, a text file, a folder of .txt/.md files, "
                      "or a .jsonl/.parquet file (default {default})", metavar="NAME|PATH"),
    "text_field": RunFlag("field holding the text in .jsonl/.parquet corpora (default {default})", metavar="FIELD"),
    "tokenizer": RunFlag("bytes, bpe:VOCAB (a byte-level BPE trained once on the corpus and cached), or a "
                         "tokenizer.json (default: {default})", metavar="bytes|bpe:VOCAB|PATH",
                         unset="bytes; bpe:32000 for --model 500m"),
    "iterations": RunFlag("iterations to train in total (default {default})", type=int_range(1, 10**9)),
    "lr": RunFlag("AdamW learning rate (default {default})", type=float_range(0, 10.0, lo_open=True), unset="1e-3"),
    "seed": RunFlag("model initialisation and data order seed (default {default})", type=int_range(0, 2**32 - 1)),
    "microbatch_size": RunFlag("sequences per microbatch (default {default})", type=int_range(1, 65536)),
    "seq_len": RunFlag("tokens per sequence (default: {default})", type=int_range(2, 1 << 20),
                       unset="64 for tiny, else the context"),
    "device": RunFlag("torch device of this node's stage (auto: cuda when available; default {default})",
                      choices=DEVICES),
    "precision": RunFlag("compute precision (autocast; fp32 master weights); auto: bf16 on a GPU that supports it, "
                         "else fp32. All members of a run must use the same (default {default})",
                         choices=("auto", *PRECISIONS)),
    "wire": RunFlag("wire format of activations and gradients (int8: blockwise 8-bit with per-block scales); the "
                    "replicas' averaging uses the matching hivemind compression. All members must agree "
                    "(default {default})", choices=tuple(WIRE_TABLE)),
    "branch_scaling": RunFlag("how a visited stage's residual branches are scaled in training with skipping paths: "
                              "inverse (by 1/p, p = the share of microbatches visiting it; the checkpoint runs as a "
                              "plain model) or none (plain skip training). All members must agree (default {default})",
                              choices=BRANCH_SCALING_MODES),
    "min_members": RunFlag("start training only on a schedule epoch with at least this many members "
                           "(default {default})", type=int_range(1, MAX_NODES)),
    "checkpoint_dir": RunFlag("folder for this node's checkpoints", type=Path),
    "checkpoint_every": RunFlag("iterations between checkpoints (0 = at exit only; default {default})",
                                type=int_range(0, 10**9)),
    "resume": RunFlag("continue from the checkpoint in --checkpoint-dir"),
    "num_stages": RunFlag("stages of the run (new swarm only; default {default})", type=int_range(2, MAX_STAGES),
                          unset="max(--stages)+1, at least 2"),
    "path_length": RunFlag("stages each microbatch visits, stage 0 included (new swarm; default {default})",
                           type=int_range(2, MAX_STAGES), unset="all"),
    "microbatches": RunFlag("microbatches per data node per iteration (new swarm; default {default})",
                            type=int_range(1, MAX_MICROBATCHES)),
    "memory_slots": RunFlag("in-flight microbatches this node accepts (default {default})",
                            type=int_range(1, MAX_MEMORY_SLOTS)),
    "run_id": RunFlag("name of the training run (default {default})"),
    "heartbeat": RunFlag("seconds between advert re-announcements (default {default})", type=float_range(0.05, 3600.0)),
    "threads": RunFlag("torch threads of this process (default: {default})", type=int_range(1, MAX_THREADS),
                       unset="torch's"),
    "iteration_timeout": RunFlag("seconds an iteration may take before training stops as stalled (default {default})",
                                 type=float_range(0, MAX_DURATION_S, lo_open=True)),
    "agreement_timeout": RunFlag("seconds to wait for every member of the pinned epoch to confirm it "
                                 "(default {default})", type=float_range(0, MAX_DURATION_S, lo_open=True)),
    "deadlines": RunFlag("where a data node's microbatch deadlines come from: observed (median + k x MAD of the "
                         "round trips measured on each route, the cost model until there are enough) or model (the "
                         "cost model only, the control of bench/stragglers.py; default {default})",
                         choices=DEADLINE_SOURCES),
    "hedging": RunFlag("whether a data node re-sends a late microbatch on other replicas (the first back wins) "
                       "before its deadline: on, or off (the control of bench/stragglers.py; default {default})",
                       choices=HEDGING_MODES),
}


def add_run_arguments(g, fields: Iterable[str], defaults: TrainSpec = TrainSpec(), *,
                      help: Optional[Mapping[str, str]] = None, flags: Optional[Mapping[str, str]] = None) -> None:
    """Add the flags of ``fields`` (in that order) to the parser or group ``g``, with ``defaults``' values as
    their defaults. ``help`` replaces a field's help for this command (what its default means here; ``{default}``
    is filled in); ``flags`` renames a field's flag (the value still lands on the field's name)."""
    help, flags = dict(help or {}), dict(flags or {})
    values = vars(defaults)
    for name in fields:
        spec = RUN_FLAGS[name]
        text = spec.help_for(values[name], help.get(name))
        flag = flags.get(name, flag_of(name))
        if isinstance(values[name], bool):
            g.add_argument(flag, dest=name, action="store_true", help=text)
            continue
        g.add_argument(flag, dest=name, default=values[name], type=spec.type, help=text,
                       **({"choices": list(spec.choices)} if spec.choices is not None else {}),
                       **({"metavar": spec.metavar or flag.lstrip("-").upper()} if spec.metavar or name in flags else {}))
