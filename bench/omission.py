"""Omission table: perplexity with stages left out, skip-trained vs full-trained.

Why: the paper reports that a model trained with SkipPipe loses little perplexity when whole
stages are missing at inference (+7% with half the model), which is what makes a swarm usable
when nodes are gone. This measures it on our two convergence checkpoints: the model trained with
paths of 4/6 stages and the one trained on the full pipeline, same tokens, same data.

For each number of kept stages (6/6, 5/6, 4/6 and 3/6, i.e. 100%, 83%, 67% and 50% of the model;
75% of 6 stages is not a whole number, so it lies between the 5/6 and 4/6 rows) every subset of
the non-zero stages is evaluated (stage 0 always kept, kept stages in increasing order), and the
mean, best and worst validation perplexity are reported, with the change against the same
model's full perplexity.

Checkpoints: ``runs/convergence/{skip,full}`` from ``bench/convergence.py``; if either is
missing, that benchmark is run first with its defaults. Output: the table on stdout and
``bench/results/omission.json``.

Run: ``python bench/omission.py [--batches N] [--checkpoints DIR]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys
from itertools import combinations
from typing import Dict, List, Optional, Sequence

_HERE = pathlib.Path(__file__).resolve().parent

import torch

from node.train.data import load_splits, validation_batches
from node.eval.omission import LoadedModel, data_config_for, evaluate_kept, load_checkpoint_dir
from node.ops.tables import text_table

__all__ = ["omission_table", "main"]

ROOT = _HERE.parent
RESULTS_DIR = ROOT / "bench" / "results"
DEFAULT_CHECKPOINTS = ROOT / "runs" / "convergence"
#: Validation batches per evaluation (each one microbatch of the training config).
DEFAULT_BATCHES = 32
#: Kept-stage counts are evaluated down to this fraction of the model.
MIN_KEPT_FRACTION = 0.5
RUNS = ("skip", "full")


def _load_convergence():
    """bench/convergence.py as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("bench_convergence", _HERE / "convergence.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def omission_table(models: Dict[str, LoadedModel], batches) -> List[dict]:
    """One row per kept-stage count: per model, mean/min/max perplexity over all subsets."""
    n_stages = next(iter(models.values())).n_stages
    rows = []
    full_ppl = {}
    n_min = max(1, int(round(MIN_KEPT_FRACTION * n_stages)))
    for n_keep in range(n_stages, n_min - 1, -1):
        subsets = [(0,) + c for c in combinations(range(1, n_stages), n_keep - 1)]
        row = {"kept": n_keep, "of": n_stages, "subsets": len(subsets), "models": {}}
        for name, m in models.items():
            ppls = [evaluate_kept(m.modules, batches, kept, m.branch_scaling).perplexity for kept in subsets]
            mean = sum(ppls) / len(ppls)
            if n_keep == n_stages:
                full_ppl[name] = mean
            row["models"][name] = {"mean_ppl": mean, "min_ppl": min(ppls), "max_ppl": max(ppls),
                                   "mean_change_pct": (mean / full_ppl[name] - 1.0) * 100.0,
                                   "per_subset": {",".join(map(str, k)): p for k, p in zip(subsets, ppls)}}
        rows.append(row)
    return rows


def format_rows(rows: Sequence[dict], names: Sequence[str]) -> str:
    header = ["kept stages", "subsets"] + [f"{n}: ppl mean (min..max)  vs full" for n in names]
    table = [header]
    for r in rows:
        cells = [f"{r['kept']}/{r['of']} ({100 * r['kept'] / r['of']:.0f}%)", str(r["subsets"])]
        for n in names:
            m = r["models"][n]
            cells.append(f"{m['mean_ppl']:.3f} ({m['min_ppl']:.3f}..{m['max_ppl']:.3f})  {m['mean_change_pct']:+.1f}%")
        table.append(cells)
    return text_table(table)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoints", type=pathlib.Path, default=DEFAULT_CHECKPOINTS,
                   help="root holding skip/ and full/ (default runs/convergence)")
    p.add_argument("--batches", type=int, default=DEFAULT_BATCHES, help=f"validation batches (default {DEFAULT_BATCHES})")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--models", default=None,
                   help="NAME=DIR,... : compare these checkpoints instead of skip/ and full/ under --checkpoints "
                        "(for example two skip-trained models of bench/tune.py); the first one's data is used")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS_DIR, help="results folder (default bench/results)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.models is not None:
        dirs = dict(item.partition("=")[::2] for item in args.models.split(",") if item)
        if not dirs or any(not name or not (pathlib.Path(d) / "stage0").is_dir() for name, d in dirs.items()):
            raise SystemExit(f"error: --models takes NAME=DIR pairs of checkpoint folders (with stage0/), got {args.models!r}")
        models = {name: load_checkpoint_dir(pathlib.Path(d)) for name, d in dirs.items()}
        return _report(models, args)
    if not all((args.checkpoints / r / "stage0").is_dir() for r in RUNS):
        print(f"no convergence checkpoints in {args.checkpoints}; running bench/convergence.py first", file=sys.stderr)
        _load_convergence().main(["--checkpoints", str(args.checkpoints), "--threads", str(args.threads)])
    return _report({r: load_checkpoint_dir(args.checkpoints / r) for r in RUNS}, args)


def _report(models: Dict[str, LoadedModel], args: argparse.Namespace) -> int:
    first = next(iter(models.values()))
    data = data_config_for(first.meta, first.config)
    batches = validation_batches(load_splits(data), data, args.batches)
    rows = omission_table(models, batches)
    tokens = sum(int(t.numel()) for _, t in batches)
    if args.models is None:
        print(f"omission: {first.config.n_stages}-stage models from {args.checkpoints} "
              f"(skip = trained on paths of {first.meta.get('path_length', 4)}/6 stages, full = full pipeline), "
              f"iteration {first.iteration}; {data.corpus} validation, {len(batches)} batches = {tokens} tokens")
    else:
        print(f"omission: {first.config.n_stages}-stage models " + ", ".join(
            f"{n} ({m.run_dir}, iteration {m.iteration}, branch scaling {m.branch_scaling})" for n, m in models.items())
              + f"; {data.corpus} validation, {len(batches)} batches = {tokens} tokens")
    print(format_rows(rows, list(models)))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "omission.json").write_text(json.dumps(
        {"checkpoints": {r: str(m.run_dir) for r, m in models.items()}, "iteration": first.iteration,
         "validation": {"corpus": data.corpus, "batches": len(batches), "tokens": tokens}, "rows": rows}, indent=1))
    print(f"wrote {args.out / 'omission.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
