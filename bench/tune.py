"""Equal tuning budgets for the full pipeline and SkipPipe, so that every gap is against a tuned baseline.

Why: a gap measured against an untuned full pipeline says little (docs/evaluation.md: the inverse
branch scale "closes" the gap only against a full run at the default settings, and the full
pipeline itself gains 13.8% from the same scale at one seed and loses 5.2% at another). Here both
variants get the same grid of settings, every setting trained at every seed, and each variant is
judged by its best setting (the lowest mean over seeds), so neither is compared against a poorly
tuned rival.

The grid, the same size for both (``--lrs`` x ``--warmups`` x two branch treatments):

* full pipeline: residual branches of stages 1.. at 1 (plain) or at 1/p in training and at
  inference (``--full-branch-scale``, the control of the skip run's ``inverse``), p the skip
  schedule's visit share (0.6 here);
* SkipPipe: ``--train-branch-scale none`` (plain skip training) or ``inverse`` (the swarm's default).

Each setting is one run of :func:`bench.convergence.train_run` (tiny model, the convergence bench's
schedules, data and evaluation), ``--jobs`` runs at a time, one torch thread each. Finished runs
are appended to ``runs.jsonl`` in ``--out`` as they end, and a rerun with the same ``--out`` skips
them, so an interrupted sweep loses at most the runs in flight. Losses do not depend on the load,
so the sweep may share the machine (its wall times then mean nothing).

The figure of a setting is its **mean validation loss over the last five evaluations** (steadier
than the last one alone; docs/evaluation.md shows single evaluations moving by about 1%) and the
final one beside it. Output: a table per variant and ``summary.json`` with each variant's best
setting and the gap of the best SkipPipe setting to the best full-pipeline setting, per seed and
as a mean with its spread.

Run: ``python bench/tune.py`` (tiny, 200 iterations, seeds 0 and 1; 24 runs of 2-3.5
CPU-minutes each).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import pathlib
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: Evaluations averaged into a setting's figure: the last five of a run (see the module docstring).
LAST_EVALUATIONS = 5


@dataclass(frozen=True)
class Setting:
    variant: str  # "full" or "skip"
    lr: float
    warmup: int
    branch: str  # full: "1" or "inverse-control"; skip: "none" or "inverse"
    seed: int

    def key(self) -> str:
        return f"{self.variant} lr={self.lr:g} warmup={self.warmup} branch={self.branch} seed={self.seed}"

    def group(self) -> str:
        """The setting without its seed: what is tuned."""
        return f"lr={self.lr:g} warmup={self.warmup} branch={self.branch}"


#: Branch treatments each variant is tried with by default (see the module docstring). A SkipPipe
#: treatment may add ``+stage-lr``: each stage's rate divided by its visit share (``--stage-lr inverse-visit``).
FULL_BRANCHES = ("1", "inverse-control")
SKIP_BRANCHES = ("none", "inverse")


def grid(lrs: Sequence[float], warmups: Sequence[int], seeds: Sequence[int],
         full_branches: Sequence[str] = FULL_BRANCHES, skip_branches: Sequence[str] = SKIP_BRANCHES) -> List[Setting]:
    out = []
    for seed in seeds:
        for lr in lrs:
            for warmup in warmups:
                for variant, branches in (("full", full_branches), ("skip", skip_branches)):
                    for branch in branches:
                        out.append(Setting(variant, lr, warmup, branch, seed))
    return out


def _run(setting: Setting, iterations: int, eval_every: int, checkpoints: str) -> dict:
    """One setting in a worker process (spawned: each loads its own data and schedule)."""
    import torch

    from bench import convergence as cv
    from node.eval.path_training import full_pipeline_schedule, stage_visit_shares, stage_routes
    from node.train.data import DataConfig, load_splits
    from node.train.model import model_config

    torch.set_num_threads(1)
    cfg = cv.BenchConfig(iterations=iterations, eval_every=eval_every, lr=setting.lr,
                         warmup_iterations=setting.warmup, seed=setting.seed)
    mcfg = model_config(cfg.model)
    data = DataConfig(corpus=cfg.corpus, microbatch_size=cfg.microbatch_size, seq_len=mcfg.context, seed=cfg.seed)
    skip = cv.skip_schedule(mcfg.n_stages, cfg.seed)
    if setting.variant == "full":
        schedule = full_pipeline_schedule(mcfg.n_stages, cv.DATA_NODES, cv.MICROBATCHES, cv.MEMORY)
        if setting.branch == "inverse-control":
            shares = stage_visit_shares(stage_routes(skip), mcfg.n_stages)
            cfg = dataclasses.replace(cfg, full_branch_scale=1.0 / min(shares[1:]))
    else:
        schedule = skip
        scale, _, extra = setting.branch.partition("+")
        cfg = dataclasses.replace(cfg, train_branch_scale=scale,
                                  stage_lr="inverse-visit" if extra == "stage-lr" else "none")
    t0 = time.perf_counter()
    res = cv.train_run(setting.variant, schedule, cfg, data, load_splits(data),
                       pathlib.Path(checkpoints) / setting.key().replace(" ", "_"), log=lambda line: None)
    tail = res.val_loss[-LAST_EVALUATIONS:]
    return {"setting": setting.__dict__, "key": setting.key(), "final": res.val_loss[-1],
            "last5": sum(tail) / len(tail), "iterations": res.iterations, "val_loss": res.val_loss,
            "full_branch_scale": cfg.full_branch_scale, "seconds": time.perf_counter() - t0}


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def summarise(rows: Sequence[dict], seeds: Sequence[int]) -> dict:
    """Each variant's settings ranked by their mean over ``seeds`` (only settings run at every seed),
    and the best SkipPipe setting against the best full-pipeline setting."""
    by: Dict[str, Dict[str, Dict[int, dict]]] = {"full": {}, "skip": {}}
    for r in rows:
        s = Setting(**r["setting"])
        by[s.variant].setdefault(s.group(), {})[s.seed] = r
    out: dict = {"seeds": list(seeds), "figure": f"mean validation loss over the last {LAST_EVALUATIONS} evaluations"}
    best = {}
    for variant, groups in by.items():
        ranked = []
        for group, per_seed in groups.items():
            if not all(seed in per_seed for seed in seeds):
                continue
            ranked.append({"setting": group,
                           "last5": {seed: per_seed[seed]["last5"] for seed in seeds},
                           "final": {seed: per_seed[seed]["final"] for seed in seeds},
                           "mean_last5": _mean([per_seed[seed]["last5"] for seed in seeds]),
                           "mean_final": _mean([per_seed[seed]["final"] for seed in seeds])})
        ranked.sort(key=lambda g: g["mean_last5"])
        out[variant] = ranked
        if ranked:
            best[variant] = ranked[0]
    if "full" in best and "skip" in best:
        f, s = best["full"], best["skip"]
        gaps = {seed: (s["last5"][seed] / f["last5"][seed] - 1.0) * 100.0 for seed in seeds}
        final_gaps = {seed: (s["final"][seed] / f["final"][seed] - 1.0) * 100.0 for seed in seeds}
        out["best"] = {"full": f["setting"], "skip": s["setting"],
                       "gap_pct_last5": gaps, "mean_gap_pct_last5": _mean(list(gaps.values())),
                       "spread_pct_last5": max(gaps.values()) - min(gaps.values()),
                       "gap_pct_final": final_gaps, "mean_gap_pct_final": _mean(list(final_gaps.values()))}
    return out


def _print(summary: dict) -> None:
    seeds = summary["seeds"]
    for variant in ("full", "skip"):
        print(f"\n{variant}: {summary['figure']} (mean over seeds {seeds}; final evaluation in brackets)")
        for g in summary.get(variant, []):
            per = "  ".join(f"s{seed} {g['last5'][seed]:.4f} ({g['final'][seed]:.4f})" for seed in seeds)
            print(f"  {g['setting']:40s} mean {g['mean_last5']:.4f} ({g['mean_final']:.4f})  {per}")
    b = summary.get("best")
    if b:
        per = ", ".join(f"seed {seed} {v:+.2f}%" for seed, v in b["gap_pct_last5"].items())
        print(f"\nbest full: {b['full']}\nbest skip: {b['skip']}\n"
              f"gap of the best skip to the best full (last {LAST_EVALUATIONS} evaluations): {per}; "
              f"mean {b['mean_gap_pct_last5']:+.2f}%, spread {b['spread_pct_last5']:.2f} points; "
              f"final evaluation: mean {b['mean_gap_pct_final']:+.2f}%")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lrs", default="1.5e-3,3e-3,6e-3", help="learning rates to try (default 1.5e-3,3e-3,6e-3)")
    p.add_argument("--warmups", default="0", help="linear warm-up lengths in iterations to try (default 0)")
    p.add_argument("--seeds", default="0,1", help="seeds every setting runs at (default 0,1)")
    p.add_argument("--full-branches", default=",".join(FULL_BRANCHES),
                   help=f"full-pipeline branch treatments: 1, inverse-control (default {','.join(FULL_BRANCHES)})")
    p.add_argument("--skip-branches", default=",".join(SKIP_BRANCHES),
                   help="SkipPipe treatments: none, visit, inverse, each optionally +stage-lr "
                        f"(default {','.join(SKIP_BRANCHES)})")
    p.add_argument("--iterations", type=int, default=200, help="iterations per run (default 200)")
    p.add_argument("--eval-every", type=int, default=10, help="default 10")
    p.add_argument("--only", default=None, help="run only the settings whose key contains this text")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="runs at a time (default 2)")
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results" / "tuning-lr",
                   help="results folder (default bench/results/tuning-lr)")
    p.add_argument("--checkpoints", type=pathlib.Path, default=pathlib.Path("/tmp/skippipe-tune"),
                   help="where each run's final checkpoint goes (default /tmp/skippipe-tune)")
    p.add_argument("--summary-only", action="store_true", help="reprint the table of the runs in --out")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        lrs = [float(x) for x in args.lrs.split(",") if x.strip()]
        warmups = [int(x) for x in args.warmups.split(",") if x.strip()]
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError as e:
        raise SystemExit(f"error: --lrs, --warmups and --seeds take comma-separated numbers ({e})")
    if not lrs or not warmups or not seeds or args.jobs < 1 or args.iterations < LAST_EVALUATIONS:
        raise SystemExit("error: give at least one lr, warm-up and seed, --jobs >= 1 and enough iterations")
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "runs.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
    done = {r["key"] for r in rows}
    full_branches = [b for b in args.full_branches.split(",") if b]
    skip_branches = [b for b in args.skip_branches.split(",") if b]
    if (set(full_branches) - set(FULL_BRANCHES)
            or any(b.partition("+")[0] not in ("none", "visit", "inverse") or b.partition("+")[2] not in ("", "stage-lr")
                   for b in skip_branches)):
        raise SystemExit("error: unknown branch treatment in --full-branches or --skip-branches (see --help)")
    todo = [s for s in grid(lrs, warmups, seeds, full_branches, skip_branches) if s.key() not in done and (args.only is None or args.only in s.key())]
    if not args.summary_only and todo:
        print(f"tune: {len(todo)} runs to do ({len(done)} done in {log}), {args.jobs} at a time", flush=True)
        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(_run, s, args.iterations, args.eval_every, str(args.checkpoints)): s for s in todo}
            for n, fut in enumerate(as_completed(futures), 1):
                r = fut.result()
                rows.append(r)
                with log.open("a") as fh:
                    fh.write(json.dumps(r) + "\n")
                print(f"  [{n}/{len(todo)}] {r['key']}: last5 {r['last5']:.4f} final {r['final']:.4f} "
                      f"({r['seconds']:.0f}s)", flush=True)
    summary = summarise(rows, seeds)
    summary["command"] = " ".join(["python", "bench/tune.py", *(argv if argv is not None else sys.argv[1:])])
    previous = args.out / "summary.json"
    if args.summary_only and previous.exists():  # a reprint keeps the command that trained the runs
        summary["command"] = json.loads(previous.read_text()).get("command", summary["command"])
    summary["iterations"] = args.iterations
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    _print(summary)
    print(f"\nwrote {args.out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
