"""``skippipe eval``: validation perplexity of a checkpoint with stages omitted.

Why a command: the SkipPipe paper's robustness claim (a model trained with stage skipping still
works when whole stages are missing at inference, e.g. when their nodes are gone) is checked on
our own checkpoints, swarm-trained or single-process-trained (same folder layout), and against a
second checkpoint side by side (typically the same model trained on the full pipeline).

Every report starts with the full model (all stages kept), then the requested variant:
``--keep-stages 0,2,4`` (one subset) or ``--omit-fraction F --trials T --seed S`` (T random
subsets leaving out ``round(F x stages)`` stages, never stage 0, plus their mean).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from node.cli.validate import as_text, int_range
from node.errors import UserError
from node.spec import DEFAULT_MICROBATCH_SIZE
from node.ops.tables import text_table

__all__ = ["register", "EvalOptions", "run_eval", "format_table"]

logger = logging.getLogger(__name__)

#: Validation batches evaluated by default (each ``microbatch_size`` sequences of ``seq_len``).
DEFAULT_BATCHES = 32
#: Random subsets tried by ``--omit-fraction`` unless ``--trials`` says otherwise.
DEFAULT_TRIALS = 5
#: Labels of the checkpoint and of the ``--compare`` checkpoint in tables and JSON.
LABELS = ("A", "B")


@dataclass
class EvalOptions:
    checkpoint: "str | List[str]"  # one folder, or several (each node's --checkpoint-dir) gathered into one model
    compare: Optional[str] = None
    keep_stages: Optional[str] = None
    omit_fraction: Optional[str] = None
    trials: Optional[str] = None
    seed: Optional[str] = None
    batches: int = DEFAULT_BATCHES
    corpus: Optional[str] = None
    seq_len: Optional[int] = None
    microbatch_size: Optional[int] = None
    branch_scale: Optional[str] = None
    tokenizer: Optional[str] = None


def _number(text: Optional[str], kind, flag: str):
    if text is None:
        return None
    try:
        return kind(text)
    except ValueError:
        raise UserError(f"{flag} must be {'an integer' if kind is int else 'a number'}, got {text!r}") from None


def _describe(label: str, loaded) -> Dict[str, Any]:
    cfg = loaded.config
    return {"label": label, "path": str(loaded.run_dir), "run_id": loaded.meta.get("run_id"),
            "iteration": loaded.iteration, "trainer": loaded.trainer, "n_stages": cfg.n_stages,
            "layers_per_stage": cfg.layers_per_stage, "d_model": cfg.d_model, "vocab_size": cfg.vocab_size,
            "schedule": loaded.meta.get("schedule_kind")}


def _subsets(opts: EvalOptions, n_stages: int) -> Tuple[str, List[Tuple[int, ...]]]:
    """(variant kind, kept-stage subsets to evaluate besides the full model)."""
    from node.eval.omission import check_kept_stages, parse_stage_list, random_kept_subsets

    if opts.keep_stages is not None and opts.omit_fraction is not None:
        raise UserError("use either --keep-stages or --omit-fraction, not both")
    if opts.omit_fraction is None and (opts.trials is not None or opts.seed is not None):
        raise UserError("--trials and --seed only apply with --omit-fraction")
    if opts.keep_stages is not None:
        return "keep", [check_kept_stages(parse_stage_list(opts.keep_stages), n_stages)]
    if opts.omit_fraction is not None:
        fraction = _number(opts.omit_fraction, float, "--omit-fraction")
        trials = _number(opts.trials, int, "--trials")
        seed = _number(opts.seed, int, "--seed")
        return "random", random_kept_subsets(n_stages, fraction, DEFAULT_TRIALS if trials is None else trials,
                                             0 if seed is None else seed)
    return "full", []


def run_eval(opts: EvalOptions) -> Dict[str, Any]:
    """Evaluate and return the report as a JSON-ready dict (what ``--json`` prints)."""
    from node.train.data import load_splits, validation_batches
    from node.eval.omission import data_config_for, evaluate_kept, load_checkpoint_dirs, omitted_count

    if not opts.checkpoint:
        raise UserError("--checkpoint DIR is required")
    if opts.batches < 1:
        raise UserError(f"--batches must be at least 1, got {opts.batches}")
    checkpoints = [opts.checkpoint] if isinstance(opts.checkpoint, str) else list(opts.checkpoint)
    models = [load_checkpoint_dirs(checkpoints)]
    if opts.compare:
        models.append(load_checkpoint_dirs([opts.compare]))
    n_stages = models[0].n_stages
    if any(m.n_stages != n_stages for m in models):
        raise UserError(f"cannot compare a {n_stages}-stage model with a {models[1].n_stages}-stage one")
    data_cfgs = [data_config_for(m.meta, m.config, opts.corpus, opts.seq_len, opts.microbatch_size, opts.tokenizer)
                 for m in models]
    first = data_cfgs[0]
    if any((d.corpus, d.tokenizer, d.seq_len) != (first.corpus, first.tokenizer, first.seq_len) for d in data_cfgs):
        raise UserError("the checkpoints were trained on different data "
                        f"({', '.join(f'{d.corpus}/{d.tokenizer}/seq {d.seq_len}' for d in data_cfgs)}); "
                        "pass --corpus and --seq-len to evaluate both on the same batches")
    kind, subsets = _subsets(opts, n_stages)
    splits = load_splits(first)
    for m in models:
        if splits.vocab_size > m.config.vocab_size:
            raise UserError(f"tokenizer vocab {splits.vocab_size} exceeds the vocab {m.config.vocab_size} of {m.run_dir}")
    batches = validation_batches(splits, first, opts.batches)
    scale = _number(opts.branch_scale, float, "--branch-scale")
    if scale is not None:
        if not (math.isfinite(scale) and 0.0 < scale <= 1.0):
            raise UserError(f"--branch-scale must be in (0, 1], got {opts.branch_scale}")
        for m in models:
            for module in m.modules[1:]:
                module.branch_scale = scale
    full = tuple(range(n_stages))
    rows: List[Dict[str, Any]] = []
    base: Dict[str, float] = {}
    for i, kept in enumerate([full] + subsets):
        row = {"kept": list(kept), "omitted": n_stages - len(kept),
               "kind": "full" if i == 0 else kind, "trial": (i - 1) if (i > 0 and kind == "random") else None,
               "results": {}}
        for label, m in zip(LABELS, models):
            # an inverse-trained model's kept stages take on the missing ones' share, unless --branch-scale says
            res = evaluate_kept(m.modules, batches, kept, m.branch_scaling if scale is None else "none")
            if i == 0:
                base[label] = res.perplexity
            change = (res.perplexity / base[label] - 1.0) * 100.0 if math.isfinite(res.perplexity) else math.inf
            row["results"][label] = {"loss": res.loss, "perplexity": res.perplexity, "perplexity_change_pct": change}
        rows.append(row)
    report: Dict[str, Any] = {
        "checkpoints": [_describe(label, m) for label, m in zip(LABELS, models)],
        "validation": {"corpus": first.corpus, "tokenizer": first.tokenizer, "batches": len(batches),
                       "microbatch_size": first.microbatch_size, "seq_len": first.seq_len,
                       "tokens": sum(int(t.numel()) for _, t in batches)},
        "variant": kind,
        "branch_scale": 1.0 if scale is None else scale,
        "rows": rows,
    }
    if kind == "random":
        fraction = float(opts.omit_fraction)
        trial_rows = rows[1:]
        report["omit_fraction"] = fraction
        report["omitted_stages"] = omitted_count(fraction, n_stages)
        report["mean"] = {label: {key: sum(r["results"][label][key] for r in trial_rows) / len(trial_rows)
                                  for key in ("loss", "perplexity", "perplexity_change_pct")}
                          for label in LABELS[: len(models)]}
    return report


def _fmt(x: float, digits: int) -> str:
    return "inf" if not math.isfinite(x) else f"{x:.{digits}f}"


def format_table(report: Dict[str, Any]) -> str:
    """Human-readable report: one line per checkpoint, the validation set, then the table."""
    lines = []
    for c in report["checkpoints"]:
        lines.append(f"{c['label']}: {c['path']} (iteration {c['iteration']}, {c['trainer']}, "
                     f"{c['n_stages']} stages x {c['layers_per_stage']} layers, d_model {c['d_model']})")
    v = report["validation"]
    lines.append(f"validation: {v['corpus']} ({v['tokenizer']}), {v['batches']} batches x {v['microbatch_size']} "
                 f"x {v['seq_len']} tokens = {v['tokens']} tokens")
    if report.get("branch_scale", 1.0) != 1.0:
        lines.append(f"residual branches of stages 1.. scaled by {report['branch_scale']:g} (--branch-scale)")
    labels = [c["label"] for c in report["checkpoints"]]
    header = ["kept stages", "omitted"]
    for label in labels:
        header += [f"{label} loss", f"{label} ppl", f"{label} ppl vs full"]
    n_stages = report["checkpoints"][0]["n_stages"]
    table = [header]

    def cells(name: str, omitted: str, results: Dict[str, Dict[str, float]]) -> List[str]:
        out = [name, omitted]
        for label in labels:
            r = results[label]
            change = r["perplexity_change_pct"]
            out += [_fmt(r["loss"], 4), _fmt(r["perplexity"], 3), f"{change:+.1f}%" if math.isfinite(change) else "inf"]
        return out

    for row in report["rows"]:
        name = ",".join(map(str, row["kept"])) + (" (full)" if row["kind"] == "full" else "")
        table.append(cells(name, f"{row['omitted']}/{n_stages}", row["results"]))
    if "mean" in report:
        trials = len(report["rows"]) - 1
        table.append(cells(f"mean of {trials} subsets", f"{report['omitted_stages']}/{n_stages}", report["mean"]))
    lines += ["", text_table(table)]
    return "\n".join(lines)


def _handler(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    opts = EvalOptions(checkpoint=args.checkpoint, compare=args.compare, keep_stages=args.keep_stages,
                       omit_fraction=args.omit_fraction, trials=args.trials, seed=args.seed, batches=args.batches,
                       corpus=args.corpus, seq_len=args.seq_len, microbatch_size=args.microbatch_size,
                       branch_scale=args.branch_scale, tokenizer=args.tokenizer)
    report = run_eval(opts)
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(format_table(report))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "eval",
        help="validation perplexity of a checkpoint with pipeline stages omitted",
        description="Load a checkpoint folder (swarm or single-process: <dir>/stage<k>/*.pt, or a folder holding one "
        "such run), and report validation loss and perplexity of the full model and with stages left out. Stage 0 "
        "(embedding, LM head) is always kept; kept stages run in increasing order.",
    )
    # numbers the user types are parsed in the handler, so a bad value is one 'error:' line
    p.add_argument("--checkpoint", metavar="DIR", nargs="+", default=None,
                   help="checkpoint folder(s) to evaluate (required): one holding every stage<k>/, or every node's "
                        "--checkpoint-dir, gathered into one model")
    p.add_argument("--compare", metavar="DIR", default=None, help="second checkpoint evaluated side by side")
    p.add_argument("--keep-stages", metavar="0,S1,...", default=None, help="stages to keep (must include 0)")
    p.add_argument("--omit-fraction", metavar="F", default=None,
                   help="leave out round(F x stages) random non-zero stages, F in [0, 1)")
    p.add_argument("--trials", metavar="T", default=None, type=as_text(int_range(1, 100_000)),
                   help=f"random subsets for --omit-fraction (default {DEFAULT_TRIALS}; all if fewer exist)")
    p.add_argument("--seed", metavar="S", default=None, type=as_text(int_range(0, 2**32 - 1)), help="seed of the random subsets (default 0)")
    p.add_argument("--batches", type=int_range(1, 100_000), default=DEFAULT_BATCHES,
                   help=f"validation batches (default {DEFAULT_BATCHES})")
    p.add_argument("--corpus", default=None, help="validation corpus (default: the one the checkpoint records)")
    p.add_argument("--tokenizer", default=None, metavar="bytes|bpe:VOCAB|PATH",
                   help="the run's tokenizer (default: the one the checkpoint records; its hash must match)")
    p.add_argument("--seq-len", type=int_range(2, 1 << 20), default=None, help="tokens per sequence (default: recorded, else context)")
    p.add_argument("--microbatch-size", type=int_range(1, 65536), default=None, help=f"sequences per batch (default: recorded, else {DEFAULT_MICROBATCH_SIZE})")
    p.add_argument("--branch-scale", metavar="P", default=None,
                   help="run stages 1.. with their residual branches scaled by P in (0, 1]: the stochastic-depth "
                        "inference rule for a skip-trained model, P = the share of microbatches that visited each "
                        "stage, (path_length - 1) / (stages - 1); 0.6 for paths of 4 of 6 stages (default 1: off)")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    p.set_defaults(func=_handler)
