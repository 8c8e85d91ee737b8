"""Convergence of SkipPipe training vs the full pipeline, for the same tokens.

Why: skipping a third of the stages per microbatch makes iterations cheaper, but only pays off
if the model still converges about as well per token. This trains the same model twice in one
process (:mod:`node.eval.path_training`, the paper's "simulate-training" setup):

* **full**: every microbatch visits all 6 stages in order;
* **skip**: paths of 4 of the 6 stages (skip ratio k = 1/3) from
  :func:`scheduler.paths.schedule_paths` on 5 data nodes x [3,3,3,3,3] stage replicas,

with the same data nodes, the same microbatches (same windows of the corpus), the same initial
weights and the same optimiser, so the routes are the only difference. The full model (all
stages, in order) is evaluated on the held-out split every ``--eval-every`` iterations.

Outputs: ``bench/results/convergence.json`` (curves, final losses, gap in %),
``bench/results/convergence.png`` (both validation curves), and the final checkpoints under
``--checkpoints`` (default ``runs/convergence/{full,skip}``), which ``bench/omission.py`` and
``skippipe eval`` read.

Both runs always get the same tokens, the same learning-rate schedule, the same seed and the same
metric (the full model's validation loss after the last iteration); the "final loss gap" is
``skip / full - 1`` of those two losses. Next to it, when ``bench/results/wan.json`` exists, the
same final skip loss is set against the full run's loss after the same *emulated WAN time*
(``equal_time`` in the json; a derived figure, see :func:`equal_time_gaps`). The defaults (constant lr 3e-3, no warm-up) are the best
setting measured for the full pipeline. A cosine decay widened the gap at this budget. A constant
5e-3 closed the gap only by making the full run worse. The figures and the settings tried are in
``docs/evaluation.md``.

**Wire formats** (``--wire int8`` or ``--wire bf16,int8``): instead of full vs skip, train the skip
variant once per wire format, the fp32 wire first, each with the activations and gradients of every
hop quantized by that format's codec (:class:`node.eval.path_training.PathTrainer` ``wire=``, the
codec code the swarm's data plane uses), and report each format's final validation loss against the
fp32 wire's at equal tokens: ``bench/results/convergence_wire.json``.
Treatments of the skip run (``--train-branch-scale``, ``--stage-lr``, ``--anneal-start``; the
full run is never changed by them, so ``--baseline`` can reuse a stored one) and the full-pipeline
control ``--full-branch-scale`` with ``--full-only``: see :class:`_Treatment` and
``docs/evaluation.md`` ("Treatments of skip training").

Run: ``python bench/convergence.py`` (tiny model, 200 iterations; about 5 CPU-minutes, 10-40
minutes of wall time on 2 shared cores depending on their load);
longer: ``python bench/convergence.py --model small --iterations 2000``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing
import os
import pathlib
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import List, Optional, Sequence


import torch

from node.train.data import DataConfig, TokenSplits, load_splits, validation_batches
from node.spec import DEFAULT_MICROBATCH_SIZE
from node.train.model import model_config
from node.ops.plotting import load_pyplot
from node.eval.path_training import PathTrainer, full_pipeline_schedule
from node.train.reference import evaluate_loss
from node.train.runtime import OptimConfig
from scheduler.cost import CostMatrix
from scheduler.paths import schedule_paths_report
from scheduler.schedule import Schedule

__all__ = ["BenchConfig", "RunResult", "skip_schedule", "train_run", "run_variants", "loss_at_iteration",
           "equal_time_gaps", "wan_time_ratios", "main", "RESULTS_DIR", "DEFAULT_CHECKPOINTS"]

logger = logging.getLogger(__name__)

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "bench" / "results"
DEFAULT_CHECKPOINTS = ROOT / "runs" / "convergence"
#: The paper's HEAD configuration: 5 data nodes, 3 replicas of each of the other 5 stages,
#: paths of 4 stages (k = 1 - 4/6 = 1/3), 6 microbatches per data node, 3 memory slots.
DATA_NODES = 5
REPLICAS = (3, 3, 3, 3, 3)
PATH_LENGTH = 4
MICROBATCHES = 6
MEMORY = 3
#: A uniform cost model: only the stage orders matter for convergence, not the replicas chosen.
COMPUTE_S = 1.0
LINK_S = 0.5
#: Wall-clock cap of the path search (it reaches its iteration count well before this).
SCHEDULE_BUDGET_S = 10.0


@dataclass
class BenchConfig:
    model: str = "tiny"
    corpus: str = "sotu"
    iterations: int = 200
    eval_every: int = 10
    val_batches: int = 16
    microbatch_size: int = DEFAULT_MICROBATCH_SIZE
    seq_len: Optional[int] = None  # default: the model's context
    lr: float = 3e-3
    lr_schedule: str = "constant"  # or "cosine": linear warm-up, then cosine decay to min_lr_ratio x lr
    warmup_iterations: int = 0
    min_lr_ratio: float = 0.1
    seed: int = 0
    threads: int = 1  # one thread is faster than two on cores shared with other work
    #: the skip run takes the full pipeline every this many iterations (0 = never). The authors' later
    #: training script does this with 10 (notes §4.2); it lowers the mean skip ratio (1/3 -> 0.3 at 10)
    full_every: int = 0
    #: processes to train the two variants in: 2 runs them side by side, one per core (each run is
    #: deterministic on its own, so the figures do not depend on this)
    jobs: int = 1
    #: torch device of both runs ("cpu", "cuda", "cuda:1"): a GPU makes --model small affordable
    device: str = "cpu"
    #: wire format every hop's activation and gradient goes through (fp32 = exact)
    wire: str = "fp32"
    # ---- treatments of the skip run (none changes the full run; see _Treatment)
    #: residual-branch scaling of the skip run: none, visit (p in training and at inference) or
    #: inverse (1/p in training, 1 at inference), p = the stage's visit share
    train_branch_scale: str = "none"
    #: per-stage learning rate of the skip run: none, or inverse-visit (lr / p, p = visit share)
    stage_lr: str = "none"
    #: from this fraction of the run on, the skip run takes the full pipeline on a growing share of
    #: iterations (0 at the start fraction, all at the end); None = never
    anneal_start: Optional[float] = None
    #: control for --train-branch-scale inverse: the FULL run's residual branches of stages 1..
    #: scaled by this in training and at inference (1.0 = plain); the skip run is untouched
    full_branch_scale: float = 1.0


@dataclass
class RunResult:
    name: str
    iterations: List[int] = field(default_factory=list)  # iterations completed at each evaluation
    tokens: List[int] = field(default_factory=list)
    val_loss: List[float] = field(default_factory=list)
    train_loss: List[float] = field(default_factory=list)  # mean over the iterations since the last evaluation
    layer_visits_per_iteration: float = 0.0  # mean stage visits (stage 0 included) per iteration
    seconds: float = 0.0
    checkpoint: Optional[str] = None
    #: final validation loss run at full depth with each non-zero stage's residual branches scaled by
    #: the fraction of microbatches that visited it (the stochastic-depth inference rule); None if 1.0
    depth_scaled_val_loss: Optional[float] = None
    branch_scale: float = 1.0
    #: the skip-run treatments in force (empty for none), see :class:`_Treatment`
    treatment: dict = field(default_factory=dict)


def skip_schedule(n_stages: int, seed: int) -> Schedule:
    """SkipPipe paths for the paper's 20-node setting on a uniform cost model."""
    if n_stages != len(REPLICAS) + 1:
        raise SystemExit(f"the benchmark's allocation needs a {len(REPLICAS) + 1}-stage model, got {n_stages}")
    stages = [list(range(DATA_NODES))]
    nxt = DATA_NODES
    for r in REPLICAS:
        stages.append(list(range(nxt, nxt + r)))
        nxt += r
    cost = CostMatrix(tuple([COMPUTE_S] * nxt),
                      tuple(tuple(0.0 if i == j else LINK_S for j in range(nxt)) for i in range(nxt)))
    sched, report = schedule_paths_report(stages, cost, PATH_LENGTH, MICROBATCHES, MEMORY, seed=seed,
                                          budget_s=SCHEDULE_BUDGET_S)
    logger.info("skip schedule: %d path entries, simulated %.1f s (%d search steps)", len(sched.paths),
                report.final_time_s, report.iterations)
    return sched


def lr_at(cfg: BenchConfig, it: int) -> float:
    """Learning rate of (1-based) iteration ``it``: the same schedule for both variants."""
    if cfg.warmup_iterations > 0 and it <= cfg.warmup_iterations:
        return cfg.lr * it / cfg.warmup_iterations
    if cfg.lr_schedule == "constant":
        return cfg.lr
    span = max(1, cfg.iterations - cfg.warmup_iterations)
    progress = min(1.0, (it - cfg.warmup_iterations) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def train_run(name: str, schedule, cfg: BenchConfig, data: DataConfig, splits: TokenSplits,
              checkpoints: pathlib.Path, log=print, full_schedule=None) -> RunResult:
    """Train one variant, evaluating the full model every ``eval_every`` iterations.

    With ``full_schedule`` and ``cfg.full_every`` > 0, every ``full_every``-th iteration follows
    ``full_schedule`` instead (same data nodes and microbatches, so the same tokens)."""
    from node.eval.path_training import stage_routes

    mcfg = model_config(cfg.model)
    trainer = PathTrainer(mcfg, OptimConfig(lr=cfg.lr), data, splits, schedule, seed=cfg.seed,
                          device=cfg.device, wire=cfg.wire)
    own_routes = trainer.routes
    full_routes = stage_routes(full_schedule) if full_schedule is not None and cfg.full_every > 0 else None
    if full_routes is not None and set(full_routes) != set(own_routes):
        raise SystemExit("the full-pipeline schedule has other data nodes than the skip schedule")
    visits = [0] * mcfg.n_stages
    microbatches = 0
    val = validation_batches(splits, data, cfg.val_batches)
    treat = _Treatment(cfg, trainer, own_routes)
    evaluate = treat.evaluate
    out = RunResult(name)
    out.iterations.append(0)
    out.tokens.append(0)
    out.val_loss.append(evaluate(val))
    out.train_loss.append(float("nan"))
    tokens, since = 0, []
    t0 = time.perf_counter()
    for it in range(1, cfg.iterations + 1):
        lr = lr_at(cfg, it)
        for opt, mult in zip(trainer.optimizers, treat.lr_multipliers):
            for group in opt.param_groups:
                group["lr"] = lr * mult
        if full_routes is not None:
            trainer.routes = full_routes if it % cfg.full_every == 0 else own_routes
        if treat.anneal_routes is not None:
            trainer.routes = treat.anneal_routes(it)
        treat.before_iteration(trainer.routes is own_routes)
        res = trainer.train_iteration()
        visits = [a + b for a, b in zip(visits, res.visits)]
        microbatches += res.visits[0]
        tokens += res.tokens
        since.append(res.loss)
        if it % cfg.eval_every == 0 or it == cfg.iterations:
            out.iterations.append(it)
            out.tokens.append(tokens)
            out.val_loss.append(evaluate(val))
            out.train_loss.append(sum(since) / len(since))
            since = []
            log(f"  {name:4s} it {it:5d}  tokens {tokens:9d}  train {out.train_loss[-1]:.4f}  "
                f"val {out.val_loss[-1]:.4f}  ({time.perf_counter() - t0:.0f}s)")
    out.seconds = time.perf_counter() - t0
    out.layer_visits_per_iteration = sum(visits) / cfg.iterations
    share = min(visits[1:]) / max(microbatches, 1) if len(visits) > 1 else 1.0
    out.treatment = treat.describe()
    if share < 1.0 and not treat.scales_branches:
        out.branch_scale = share
        mods = trainer.modules()
        for m in mods[1:]:
            m.branch_scale = share
        out.depth_scaled_val_loss = evaluate_loss(mods, val)
        for m in mods[1:]:
            m.branch_scale = 1.0
    treat.restore()
    trainer.save_checkpoint(checkpoints, name, extra_meta={"schedule_kind": name, "bench": "convergence",
                                                             "path_length": _as_path_length(schedule),
                                                             **({"treatment": out.treatment} if out.treatment else {}),
                                                             **_branch_scaling_meta(cfg, treat)})
    out.checkpoint = str(checkpoints / name)
    return out


def _branch_scaling_meta(cfg: BenchConfig, treat) -> dict:
    """Checkpoint meta saying the run trained as the swarm's ``--branch-scaling inverse`` does, so that
    ``skippipe eval`` and bench/omission.py run it with stages missing as such (node.eval.omission)."""
    inverse = cfg.train_branch_scale == "inverse" and any(p < 1.0 for p in treat.shares)
    return {"branch_scaling": "inverse"} if inverse else {}


class _Treatment:
    """The skip-run treatments of one run (--train-branch-scale, --stage-lr, --anneal-start).

    Each reads the run's own routes only: a run whose routes visit every stage (the full pipeline)
    has visit shares of 1, so all three leave it exactly as it is."""

    def __init__(self, cfg: BenchConfig, trainer: PathTrainer, own_routes):
        from node.eval.path_training import branch_scales_for, stage_visit_shares

        self.cfg, self.trainer, self.own_routes = cfg, trainer, own_routes
        n = len(trainer.stages)
        self.shares = stage_visit_shares(own_routes, n)
        self.train_scales, self.eval_scales = branch_scales_for(cfg.train_branch_scale, self.shares)
        self.scales_branches = cfg.train_branch_scale != "none" and any(p < 1.0 for p in self.shares)
        if cfg.full_branch_scale != 1.0 and all(p == 1.0 for p in self.shares):  # the full run's control
            self.train_scales = self.eval_scales = [1.0] + [cfg.full_branch_scale] * (n - 1)
            self.scales_branches = True
        if cfg.stage_lr == "none":
            self.lr_multipliers = [1.0] * n
        elif cfg.stage_lr == "inverse-visit":
            self.lr_multipliers = [1.0 / p if p > 0 else 1.0 for p in self.shares]
        else:
            raise SystemExit(f"unknown --stage-lr {cfg.stage_lr!r}")
        self.anneal_routes = None
        if cfg.anneal_start is not None and any(p < 1.0 for p in self.shares):
            self._full = {d: [tuple(range(1, n))] * len(rs) for d, rs in own_routes.items()}
            self._acc = 0.0
            self.anneal_routes = self._anneal
        self.full_iterations = 0

    def _anneal(self, it: int):
        """Full routes on a share of iterations that grows linearly from 0 (at ``anneal_start`` x
        the run) to 1 (at its end), spread evenly by an accumulator (deterministic)."""
        start = self.cfg.anneal_start * self.cfg.iterations
        span = max(1.0, self.cfg.iterations - start)
        self._acc += min(1.0, max(0.0, (it - start) / span))
        if self._acc >= 1.0 - 1e-9:
            self._acc -= 1.0
            self.full_iterations += 1
            return self._full
        return self.own_routes

    def before_iteration(self, own: bool) -> None:
        from node.eval.path_training import set_branch_scales

        if self.scales_branches:
            # a full-pipeline iteration (--full-every, --anneal-start) runs the model as inference does
            set_branch_scales(self.trainer.stages, self.train_scales if own else self.eval_scales)

    def evaluate(self, val) -> float:
        from node.eval.path_training import set_branch_scales

        if not self.scales_branches:
            return evaluate_loss(self.trainer.modules(), val)
        before = [m.branch_scale for m in self.trainer.stages]
        set_branch_scales(self.trainer.stages, self.eval_scales)
        try:
            return evaluate_loss(self.trainer.modules(), val)
        finally:
            set_branch_scales(self.trainer.stages, before)

    def restore(self) -> None:
        from node.eval.path_training import set_branch_scales

        set_branch_scales(self.trainer.stages, [1.0] * len(self.trainer.stages))

    def describe(self) -> dict:
        out = {}
        if self.scales_branches:
            out["train_branch_scale"] = {"mode": self.cfg.train_branch_scale if any(p < 1.0 for p in self.shares)
                                         else f"constant {self.cfg.full_branch_scale:g} (--full-branch-scale)", "visit_shares": self.shares,
                                         "train_scales": self.train_scales, "inference_scales": self.eval_scales}
        if self.cfg.stage_lr != "none" and any(m != 1.0 for m in self.lr_multipliers):
            out["stage_lr"] = {"mode": self.cfg.stage_lr, "lr_multipliers": self.lr_multipliers}
        if self.anneal_routes is not None:
            out["anneal"] = {"start": self.cfg.anneal_start, "full_iterations": self.full_iterations}
        return out


def _train_variant(name: str, schedule, cfg: BenchConfig, data: DataConfig, checkpoints: pathlib.Path,
                   full_schedule=None) -> RunResult:
    """One variant in a worker process: loads its own copy of the data (deterministic)."""
    torch.set_num_threads(cfg.threads)
    return train_run(name, schedule, cfg, data, load_splits(data), checkpoints,
                     log=lambda line: print(line, flush=True), full_schedule=full_schedule)


def _train_wire(name: str, schedule, cfg: BenchConfig, data: DataConfig, checkpoints: pathlib.Path) -> RunResult:
    torch.set_num_threads(cfg.threads)
    return train_run(name, schedule, cfg, data, load_splits(data), checkpoints,
                     log=lambda line: print(line, flush=True))


def run_wire_variants(cfg: BenchConfig, skip, data: DataConfig, wires: Sequence[str],
                      checkpoints: pathlib.Path) -> List[RunResult]:
    """The skip variant once per wire format (``skip-fp32`` first), ``cfg.jobs`` at a time."""
    from concurrent.futures import ProcessPoolExecutor

    todo = [(f"skip-{w}", replace(cfg, wire=w)) for w in ["fp32", *[w for w in wires if w != "fp32"]]]
    if cfg.jobs < 2:
        return [_train_wire(name, skip, c, data, checkpoints) for name, c in todo]
    with ProcessPoolExecutor(max_workers=min(cfg.jobs, len(todo)),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_train_wire, name, skip, c, data, checkpoints) for name, c in todo]
        return [f.result() for f in futures]


def wire_result(cfg: BenchConfig, data: DataConfig, runs: Sequence[RunResult]) -> dict:
    """Final validation loss of each wire format and its change against the fp32 wire, in %."""
    base = runs[0]
    assert base.name == "skip-fp32"
    return {
        "config": asdict(cfg), "seq_len": data.seq_len, "tokens_per_run": base.tokens[-1],
        "runs": {r.name: asdict(r) for r in runs},
        "final_val_loss": {r.name.removeprefix("skip-"): r.val_loss[-1] for r in runs},
        "val_loss_change_pct_vs_fp32": {r.name.removeprefix("skip-"): (r.val_loss[-1] / base.val_loss[-1] - 1) * 100
                                        for r in runs[1:]},
        "equal_tokens": all(r.tokens == base.tokens for r in runs),
    }


def run_variants(cfg: BenchConfig, full, skip, data: DataConfig, splits: Optional[TokenSplits],
                 checkpoints: pathlib.Path) -> List[RunResult]:
    """Train ``full`` then ``skip``; with ``cfg.jobs >= 2``, both at once in two spawned processes."""
    if cfg.jobs < 2:
        splits = splits if splits is not None else load_splits(data)
        return [train_run("full", full, cfg, data, splits, checkpoints),
                train_run("skip", skip, cfg, data, splits, checkpoints, full_schedule=full)]
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_train_variant, "full", full, cfg, data, checkpoints),
                   pool.submit(_train_variant, "skip", skip, cfg, data, checkpoints, full)]
        return [f.result() for f in futures]


def loss_at_iteration(iterations: Sequence[float], losses: Sequence[float], at: float) -> float:
    """Validation loss of a run after ``at`` iterations, linear between its evaluation points.

    Why linear: the curves are evaluated every ``eval_every`` iterations and are smooth on that
    scale; anything fancier would claim more than was measured. ``at`` must lie inside the run."""
    if not iterations or len(iterations) != len(losses):
        raise ValueError("need one loss per evaluated iteration")
    if not iterations[0] <= at <= iterations[-1]:
        raise ValueError(f"iteration {at} is outside the evaluated range {iterations[0]}..{iterations[-1]}")
    for (i0, l0), (i1, l1) in zip(zip(iterations, losses), zip(iterations[1:], losses[1:])):
        if i0 <= at <= i1:
            return l0 if i1 == i0 else l0 + (l1 - l0) * (at - i0) / (i1 - i0)
    return float(losses[-1])


def equal_time_gaps(full_iterations: Sequence[float], full_losses: Sequence[float], skip_iterations: float,
                    skip_loss: float, time_ratios: dict) -> dict:
    """The skip run's final loss against the full run's loss after the same *time*, not the same tokens.

    A skip iteration takes ``ratio`` of a full one (measured by ``bench/wan.py`` on the emulated
    WAN), so in the time of ``skip_iterations`` skip iterations the full pipeline completes
    ``ratio * skip_iterations``. Returns, per named ratio, that iteration, the full run's loss
    there and the gap ``skip / full - 1`` in %. This is a derived figure (two measurements
    combined), reported next to the issue's equal-token gap, never instead of it."""
    out = {}
    for name, ratio in time_ratios.items():
        at = ratio * skip_iterations
        full_loss = loss_at_iteration(full_iterations, full_losses, at)
        out[name] = {"time_ratio": ratio, "full_iteration": at, "full_val_loss": full_loss,
                     "loss_gap_pct": (skip_loss / full_loss - 1.0) * 100.0}
    return out


def wan_time_ratios(path: pathlib.Path) -> dict:
    """SkipPipe / full iteration-time ratios from a ``bench/wan.py`` result, or {} if there is none.

    Two ratios, because ``bench/wan.py`` measures two spans: the microbatch phase (what the
    scheduler optimises and the paper reports) and the whole iteration, which adds the replicas'
    averaging and the optimiser step that skipping does not shorten."""
    try:
        wan = json.loads(path.read_text())
        by_name = {r["schedule"]: r for r in wan["results"]}
        full, skip = by_name["full pipeline"], by_name["SkipPipe"]
        return {"microbatch_phase": skip["mean_s"] / full["mean_s"],
                "whole_iteration": skip["mean_full_iteration_s"] / full["mean_full_iteration_s"]}
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return {}


def _as_path_length(schedule) -> int:
    return int(schedule.path_length if isinstance(schedule, Schedule) else schedule["path_length"])


def _plot(runs: Sequence[RunResult], path: pathlib.Path, title: str) -> bool:
    plt = load_pyplot("plot")
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in runs:
        label = "full pipeline (6/6 stages)" if r.name == "full" else f"SkipPipe (paths of {PATH_LENGTH}/6 stages)"
        ax.plot([t / 1e6 for t in r.tokens], r.val_loss, marker=".", label=label)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("validation loss (nats/token, full model)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    d = BenchConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=d.model, choices=["tiny", "small"], help="model size (default tiny)")
    p.add_argument("--corpus", default=d.corpus, help="corpus (default sotu)")
    p.add_argument("--iterations", type=int, default=d.iterations, help=f"iterations per run (default {d.iterations})")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help=f"default {d.eval_every}")
    p.add_argument("--val-batches", type=int, default=d.val_batches, help=f"default {d.val_batches}")
    p.add_argument("--microbatch-size", type=int, default=d.microbatch_size, help=f"default {d.microbatch_size}")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's context)")
    p.add_argument("--lr", type=float, default=d.lr, help=f"AdamW learning rate (default {d.lr})")
    p.add_argument("--lr-schedule", default=d.lr_schedule, choices=["constant", "cosine"],
                   help=f"learning-rate schedule, the same for both runs (default {d.lr_schedule})")
    p.add_argument("--warmup-iterations", type=int, default=d.warmup_iterations,
                   help=f"linear learning-rate warm-up (default {d.warmup_iterations})")
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio,
                   help=f"cosine floor as a fraction of --lr (default {d.min_lr_ratio})")
    p.add_argument("--seed", type=int, default=d.seed, help="model, data and path-search seed (default 0)")
    p.add_argument("--full-every", type=int, default=d.full_every,
                   help="the skip run follows the full pipeline every N-th iteration, as the authors' later "
                        "training script does with 10 (default 0 = never: pure k = 1/3)")
    p.add_argument("--train-branch-scale", default=d.train_branch_scale, choices=["none", "visit", "inverse"],
                   help="skip run: scale each stage's residual branches by its visit share p in training and "
                        "at full depth (visit), or by 1/p in training and 1 at full depth (inverse: inverted "
                        "stochastic depth); default none")
    p.add_argument("--stage-lr", default=d.stage_lr, choices=["none", "inverse-visit"],
                   help="skip run: each stage's lr divided by its visit share (default none)")
    p.add_argument("--anneal-start", type=float, default=d.anneal_start,
                   help="skip run: from this fraction of the run on, a linearly growing share of iterations "
                        "takes the full pipeline (all of them at the end); default: never")
    p.add_argument("--full-branch-scale", type=float, default=d.full_branch_scale,
                   help="control: the full run's residual branches scaled by this in training and at inference "
                        "(1/0.6 is what --train-branch-scale inverse gives the skip run in training); default 1")
    p.add_argument("--full-only", action="store_true",
                   help="train the full run only (for --full-branch-scale); writes convergence.json with it alone")
    p.add_argument("--baseline", type=pathlib.Path, default=None,
                   help="train the skip run only and take the full run from this convergence.json (it must "
                        "have the same model, data, lr and iteration settings); the treatments above never "
                        "change the full run")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads per run (default 1)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="processes: 2 trains both variants side by side, 1 one after the other; the figures "
                        "are the same either way (default: 2 if the machine has 2 cores or more)")
    p.add_argument("--device", default=d.device,
                   help="torch device for both runs, e.g. cuda (default cpu); the two runs share it with --jobs 2")
    p.add_argument("--wire", default="fp32",
                   help="wire format(s) of every hop, comma-separated from bf16, fp16, int8: trains the skip variant "
                        "once with the fp32 wire and once per format, and reports the validation-loss change at "
                        "equal tokens (default fp32: the usual full vs skip comparison)")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS_DIR, help="results folder (default bench/results)")
    p.add_argument("--checkpoints", type=pathlib.Path, default=DEFAULT_CHECKPOINTS,
                   help="checkpoint root (default runs/convergence)")
    p.add_argument("--wan-results", type=pathlib.Path, default=RESULTS_DIR / "wan.json",
                   help="a bench/wan.py result: its SkipPipe/full iteration-time ratios give the equal-time "
                        "comparison printed after the equal-token gap (default bench/results/wan.json; "
                        "skipped if missing)")
    p.add_argument("--summary-only", action="store_true",
                   help="train nothing: reprint the figures of the convergence.json already in --out "
                        "(adding the equal-time comparison) and rewrite it")
    return p.parse_args(argv)


def _print_summary(result: dict, out: pathlib.Path, checkpoints: Optional[pathlib.Path], plotted: bool) -> None:
    f, s = result["runs"]["full"], result["runs"]["skip"]
    print(f"final validation loss: full {f['val_loss'][-1]:.4f}, skip {s['val_loss'][-1]:.4f}; "
          f"gap {result['final_loss_gap_pct']:+.2f}% in loss, {result['final_perplexity_gap_pct']:+.2f}% in perplexity "
          f"(same tokens)")
    scaled = result.get("skip_depth_scaled")
    if scaled:
        print(f"skip model at full depth with residual branches of stages 1.. scaled by their visit share "
              f"{scaled['branch_scale']:.3f} (stochastic-depth inference rule): {scaled['val_loss']:.4f}, "
              f"gap {scaled['loss_gap_pct']:+.2f}% in loss")
    for name, g in result.get("equal_time", {}).items():
        print(f"same time on the emulated WAN ({name.replace('_', ' ')}: a skip iteration takes "
              f"{g['time_ratio']:.3f} of a full one): full after {g['full_iteration']:.0f} iterations "
              f"{g['full_val_loss']:.4f}, skip {s['val_loss'][-1]:.4f}, gap {g['loss_gap_pct']:+.2f}%")
    print(f"stage compute per iteration, skip / full: {result['stage_compute_ratio_skip_vs_full']:.3f}; "
          f"wall: full {f['seconds']:.0f}s, skip {s['seconds']:.0f}s")
    print(f"wrote {out / 'convergence.json'}" + (f" and {out / 'convergence.png'}" if plotted else "")
          + (f"; checkpoints in {checkpoints}" if checkpoints is not None else ""))


def _add_equal_time(result: dict, wan_results: pathlib.Path) -> None:
    f, s = result["runs"]["full"], result["runs"]["skip"]
    ratios = wan_time_ratios(wan_results)
    result.pop("equal_time", None)
    result.pop("equal_time_source", None)
    if ratios:
        result["equal_time"] = equal_time_gaps(f["iterations"], f["val_loss"], s["iterations"][-1],
                                               s["val_loss"][-1], ratios)
        result["equal_time_source"] = str(wan_results)


#: BenchConfig fields that must match for a stored full run to stand in for a new one
_BASELINE_KEYS = ("model", "corpus", "iterations", "eval_every", "val_batches", "microbatch_size", "seq_len", "lr",
                  "lr_schedule", "warmup_iterations", "min_lr_ratio", "seed", "full_branch_scale")


def _baseline_full(path: pathlib.Path, cfg: BenchConfig) -> RunResult:
    """The full run of an earlier convergence.json with the same training settings (--baseline)."""
    try:
        old = json.loads(path.read_text())
        ocfg, full = old["config"], old["runs"]["full"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--baseline: cannot read a convergence result at {path} ({e.__class__.__name__}: {e})")
    mine = asdict(cfg)
    diff = [k for k in _BASELINE_KEYS if ocfg.get(k, BenchConfig().__dict__[k]) != mine[k]]
    if diff:
        raise SystemExit(f"--baseline {path} was trained with other settings: {', '.join(diff)}")
    known = {f for f in RunResult.__dataclass_fields__}
    return RunResult(**{k: v for k, v in full.items() if k in known})


def _summary_only(args: argparse.Namespace) -> int:
    path = args.out / "convergence.json"
    try:
        result = json.loads(path.read_text())
        result["runs"]["full"]["val_loss"], result["runs"]["skip"]["val_loss"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--summary-only: cannot read a convergence result at {path} ({e.__class__.__name__}: {e})")
    _add_equal_time(result, args.wan_results)
    path.write_text(json.dumps(result, indent=1))
    _print_summary(result, args.out, None, plotted=False)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.summary_only:
        return _summary_only(args)
    cfg = BenchConfig(model=args.model, corpus=args.corpus, iterations=args.iterations, eval_every=args.eval_every,
                      val_batches=args.val_batches, microbatch_size=args.microbatch_size, seq_len=args.seq_len,
                      lr=args.lr, lr_schedule=args.lr_schedule, warmup_iterations=args.warmup_iterations,
                      min_lr_ratio=args.min_lr_ratio, seed=args.seed, threads=args.threads,
                      full_every=args.full_every, jobs=args.jobs, device=args.device,
                      train_branch_scale=args.train_branch_scale, stage_lr=args.stage_lr,
                      anneal_start=args.anneal_start, full_branch_scale=args.full_branch_scale)
    if cfg.anneal_start is not None and not 0.0 <= cfg.anneal_start < 1.0:
        raise SystemExit("--anneal-start must be in [0, 1)")
    if cfg.iterations < 1 or cfg.eval_every < 1:
        raise SystemExit("--iterations and --eval-every must be at least 1")
    if cfg.jobs < 1:
        raise SystemExit("--jobs must be at least 1")
    if cfg.full_every < 0:
        raise SystemExit("--full-every must be 0 (never) or a positive number of iterations")
    try:
        device = torch.device(cfg.device)
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as e:
        raise SystemExit(f"--device {cfg.device!r} is not usable here: {str(e).splitlines()[0] if str(e) else e}")
    torch.set_num_threads(cfg.threads)
    wires = [w.strip() for w in args.wire.split(",") if w.strip()]
    from protocol.compression import WIRE_FORMATS

    if not wires or any(w not in WIRE_FORMATS for w in wires):
        raise SystemExit(f"--wire takes formats from {sorted(WIRE_FORMATS)}, got {args.wire!r}")
    mcfg = model_config(cfg.model)
    data = DataConfig(corpus=cfg.corpus, microbatch_size=cfg.microbatch_size, seq_len=cfg.seq_len or mcfg.context,
                      seed=cfg.seed)
    splits = load_splits(data) if cfg.jobs < 2 else None
    skip = skip_schedule(mcfg.n_stages, cfg.seed)
    if wires != ["fp32"]:
        return _wire_main(cfg, data, skip, wires, args)
    full = full_pipeline_schedule(mcfg.n_stages, DATA_NODES, MICROBATCHES, MEMORY)
    tokens_per_it = DATA_NODES * MICROBATCHES * cfg.microbatch_size * data.seq_len
    print(f"convergence: {cfg.model} on {cfg.corpus}, {cfg.iterations} iterations x {DATA_NODES} data nodes x "
          f"{MICROBATCHES} microbatches x {cfg.microbatch_size} x {data.seq_len} tokens "
          f"= {cfg.iterations * tokens_per_it} tokens per run"
          + (f" (full run from {args.baseline})" if args.baseline is not None
             else " (both variants side by side)" if cfg.jobs >= 2 else ""), flush=True)
    if args.full_only:
        f = train_run("full", full, cfg, data, splits if splits is not None else load_splits(data), args.checkpoints)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "convergence.json").write_text(json.dumps(
            {"config": asdict(cfg), "runs": {"full": asdict(f)}, "final_val_loss": {"full": f.val_loss[-1]}}, indent=1))
        print(f"final validation loss: full {f.val_loss[-1]:.4f} (full run only); wrote {args.out / 'convergence.json'}")
        return 0
    if args.baseline is not None:
        runs = [_baseline_full(args.baseline, cfg),
                train_run("skip", skip, cfg, data, splits if splits is not None else load_splits(data),
                          args.checkpoints, full_schedule=full)]
    else:
        runs = run_variants(cfg, full, skip, data, splits, args.checkpoints)
    f, s = runs
    gap_pct = (s.val_loss[-1] / f.val_loss[-1] - 1.0) * 100.0
    ppl_gap_pct = (math.exp(s.val_loss[-1] - f.val_loss[-1]) - 1.0) * 100.0
    result = {
        "config": asdict(cfg), "seq_len": data.seq_len, "data_nodes": DATA_NODES, "replicas": list(REPLICAS),
        "path_length": PATH_LENGTH, "n_stages": mcfg.n_stages, "microbatches_per_data_node": MICROBATCHES,
        "tokens_per_run": cfg.iterations * tokens_per_it,
        "skip_routes": [p.to_json() for p in skip.paths],
        "runs": {r.name: asdict(r) for r in runs},
        "final_val_loss": {"full": f.val_loss[-1], "skip": s.val_loss[-1]},
        "final_loss_gap_pct": gap_pct, "final_perplexity_gap_pct": ppl_gap_pct,
        "stage_compute_ratio_skip_vs_full": s.layer_visits_per_iteration / f.layer_visits_per_iteration,
    }
    if s.depth_scaled_val_loss is not None:
        result["skip_depth_scaled"] = {"branch_scale": s.branch_scale, "val_loss": s.depth_scaled_val_loss,
                                       "loss_gap_pct": (s.depth_scaled_val_loss / f.val_loss[-1] - 1.0) * 100.0}
    _add_equal_time(result, args.wan_results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "convergence.json").write_text(json.dumps(result, indent=1))
    plotted = _plot(runs, args.out / "convergence.png",
                    f"{cfg.model} on {cfg.corpus}: full pipeline vs SkipPipe (k = 1/3)")
    _print_summary(result, args.out, args.checkpoints, plotted)
    return 0


def _wire_main(cfg: BenchConfig, data: DataConfig, skip, wires: Sequence[str], args: argparse.Namespace) -> int:
    tokens_per_it = DATA_NODES * MICROBATCHES * cfg.microbatch_size * data.seq_len
    print(f"convergence by wire format: {cfg.model} on {cfg.corpus}, skip paths, {cfg.iterations} iterations = "
          f"{cfg.iterations * tokens_per_it} tokens per run; wires fp32 (baseline), "
          f"{', '.join(w for w in wires if w != 'fp32')}", flush=True)
    runs = run_wire_variants(cfg, skip, data, wires, args.checkpoints)
    result = wire_result(cfg, data, runs)
    result["command"] = " ".join(["python", "bench/convergence.py", *sys.argv[1:]])
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result["machine"] = f"{os.cpu_count()} CPUs, torch {torch.__version__}, device {cfg.device}"
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "convergence_wire.json"
    path.write_text(json.dumps(result, indent=1))
    for name, loss in result["final_val_loss"].items():
        change = result["val_loss_change_pct_vs_fp32"].get(name)
        print(f"  wire {name:5s}: final validation loss {loss:.4f}"
              + ("" if change is None else f"  ({change:+.3f}% vs the fp32 wire, same tokens)"))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
