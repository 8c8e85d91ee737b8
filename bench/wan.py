"""Live WAN benchmark: full pipeline vs random skip vs SkipPipe on 20 emulated geo-distributed nodes.

Why: the scheduler's claim (SkipPipe iterations ~1/3 of a full pipeline's on the geo-distributed
profile) is a simulator result; this measures it on the real training runtime, with every
data-plane message delayed as the profile's links would delay it (:mod:`node.link_emulation`) and
every compute step padded to the profile's GPU speed, and prints the simulator's prediction for
the very same schedule and cost matrix next to the measurement.

Setup (one invocation, back to back, same swarm, same model, same data):

* 20 nodes, stage sizes 5,3,3,3,3,3, path length 4 of 6, 6 microbatches of 8 sequences per data
  node, memory 3; node ``i`` sits at location ``i mod 12`` of the profile (round-robin).
* The swarm is the **in-process harness** (:class:`node.commands.up.LocalSwarm`: one real
  hivemind P2P + DHT per node, all in this process), not 20 daemons: 20 daemons overload 2 cores
  (joining alone took ~50 s) and their CPU contention would swamp the emulated times.
* Model: tiny (6 stages x 1 layer, d_model 64, context 64, fp32 activations of 8 x 64 x 64 x 4 =
  128 KiB). It stands in for the paper's setting (4 layers per stage, d_model 1024, context 1024:
  32 MiB activations) replayed ``1 / time_scale`` times faster:
  - compute: ``0.055 s/sample/layer x (4 / 1 layers) x time_scale`` per sample per tiny layer;
  - latency: profile latency x ``time_scale``; per-hop overhead ``0.35 s x time_scale`` (the cost
    model's fixed per-message cost, emulated as extra latency);
  - bandwidth: profile bandwidth x ``(128 KiB / 32 MiB) / time_scale``, so a tiny activation takes
    as long (scaled) as a paper-sized one.
* The cost matrix the schedules are made for and the simulator is run on is built from exactly
  these emulated quantities (:func:`scheduler.cost.build_cost` with the scaled profile and the
  tiny model's shape), so prediction and emulation describe the same system.
* Schedules over one allocation (:func:`scheduler.allocation.allocate`): full pipeline
  (:func:`scheduler.baselines.full_pipeline`), random skip (:func:`scheduler.baselines.random_skip`),
  SkipPipe (:func:`scheduler.paths.schedule_paths`). The swarm switches schedule epochs between
  runs (same allocation, so every node keeps its stage).

Measured "iteration time" = the microbatch phase of an iteration (first forward to the last
backward, as every node learns it from the data nodes' ``IterationDone``; the minimum over nodes),
which is what the simulator predicts; the DP all-reduce and the DHT norm exchange are not modelled
by the simulator and are reported separately (``full_iteration_s``).

Run: ``python bench/wan.py`` (about 5-8 minutes on 2 busy cores); ``--time-scale``, ``--iterations``,
``--warmup``. Writes ``bench/results/wan.json`` and ``bench/results/wan.png``.
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
from dataclasses import replace
from typing import Dict, List, Sequence

_HERE = pathlib.Path(__file__).resolve().parent
_ROOT = _HERE.parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _HERE]  # bench/scheduler.py etc.
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import node.compat  # noqa: E402,F401  (before hivemind)
from node.plotting import load_pyplot  # noqa: E402

__all__ = ["main", "scaled_profile", "build_setting"]

logger = logging.getLogger(__name__)

DEFAULT_PROFILE = "/work/shared/profiles/geo-distributed-12.json"
#: The paper's (reference) model shape the tiny model stands in for.
PAPER_LAYERS_PER_STAGE = 4
PAPER_D_MODEL = 1024
PAPER_SEQ_LEN = 1024
#: The cost model's per-hop overhead in the paper's setting (scheduler.cost.CostParams).
PAPER_HOP_OVERHEAD_S = 0.35
TINY_SEQ_LEN = 64
BYTES_PER_ELEMENT = 4
RUN_ID = "wan"


def scaled_profile(profile, latency_scale: float, bandwidth_scale: float, compute_s_per_sample_per_layer: float):
    """The profile as the emulation replays it (a new LinkProfile; the original is untouched)."""
    from scheduler.cost import Link

    def scale(link):
        return Link(link.latency_ms * latency_scale, link.bandwidth_GiBps * bandwidth_scale)

    return replace(profile, name=f"{profile.name}-scaled", links={k: scale(v) for k, v in profile.links.items()},
                   same_location=scale(profile.same_location),
                   default_compute_s_per_sample_per_layer=compute_s_per_sample_per_layer,
                   compute_s_per_sample_per_layer={})


def build_setting(args) -> dict:
    """Scaled profile, node locations, cost matrix, allocation and the three schedules."""
    from node.model import model_config
    from scheduler.allocation import allocate
    from scheduler.baselines import full_pipeline, random_skip
    from scheduler.cost import CostParams, LinkProfile, ModelShape, activation_bytes, build_cost, nodes_round_robin
    from scheduler.paths import schedule_paths_report
    from scheduler.simulator import simulate

    mcfg = model_config("tiny")
    profile = LinkProfile.load(args.profile)
    base_compute = profile.compute_for(profile.locations[0])
    tiny = ModelShape(layers_per_stage=mcfg.layers_per_stage, d_model=mcfg.d_model, seq_len=TINY_SEQ_LEN,
                      samples_per_microbatch=args.samples, bytes_per_element=BYTES_PER_ELEMENT)
    paper = ModelShape(layers_per_stage=PAPER_LAYERS_PER_STAGE, d_model=PAPER_D_MODEL, seq_len=PAPER_SEQ_LEN,
                       samples_per_microbatch=args.samples, bytes_per_element=BYTES_PER_ELEMENT)
    ts = args.time_scale
    compute = base_compute * PAPER_LAYERS_PER_STAGE / mcfg.layers_per_stage * ts
    bandwidth_scale = activation_bytes(tiny) / activation_bytes(paper) / ts
    hop = PAPER_HOP_OVERHEAD_S * ts
    emu_profile = scaled_profile(profile, ts, bandwidth_scale, compute)
    nodes = nodes_round_robin(emu_profile, args.nodes, args.memory)
    cost = build_cost(nodes, emu_profile, tiny, CostParams(hop_overhead_s=hop))
    stage_sizes = [int(x) for x in args.stage_sizes.split(",")]
    alloc = allocate(cost, stage_sizes, seed=args.seed, budget_s=args.alloc_budget_s)
    stages = alloc.stages
    skippipe, report = schedule_paths_report(stages, cost, args.path_length, args.microbatches, args.memory,
                                             seed=args.seed, budget_s=args.budget_s)
    if alloc.budget_hit or report.budget_hit:
        logger.warning("a scheduler budget cut a search short: the schedules depend on machine speed")
    schedules = {
        "full pipeline": full_pipeline(stages, cost, args.microbatches, args.memory),
        "random skip": random_skip(stages, cost, args.path_length, args.microbatches, args.memory, seed=args.seed),
        "SkipPipe": skippipe,
    }
    predicted = {k: simulate(s, cost).iteration_time_s for k, s in schedules.items()}
    return {"model": mcfg, "profile": profile, "emu_profile": emu_profile, "locations": [n.location for n in nodes],
            "cost": cost, "stages": [list(s) for s in stages], "schedules": schedules, "predicted": predicted,
            "compute_s_per_sample_per_layer": compute, "latency_scale": ts, "bandwidth_scale": bandwidth_scale,
            "hop_overhead_s": hop, "activation_bytes": activation_bytes(tiny),
            "deterministic": not (alloc.budget_hit or report.budget_hit)}


async def run_live(args, setting: dict) -> Dict[str, dict]:
    """One in-process swarm; each schedule for ``warmup + iterations`` iterations, back to back."""
    from node.commands.up import LocalSwarm
    from node.data import DataConfig, load_splits
    from node.link_emulation import Emulation
    from node.trainer import TrainerConfig
    from protocol import ScheduleEpoch

    data_cfg = DataConfig(corpus="shakespeare", microbatch_size=args.samples, seq_len=TINY_SEQ_LEN, seed=args.seed)
    splits = load_splits(data_cfg)
    config = TrainerConfig(run_id=RUN_ID, model=setting["model"], data=data_cfg, seed=args.seed,
                           memory_deadlock_grace_s=args.deadlock_grace_s, iteration_timeout_s=args.iteration_timeout_s)
    locs = setting["locations"]

    def emulation_for(i: int, members: Sequence[str]) -> Emulation:
        return Emulation.for_node(profile=setting["emu_profile"], location=locs[i],
                                  peer_locations={members[j]: locs[j] for j in range(len(members))},
                                  compute_s_per_sample_per_layer=setting["compute_s_per_sample_per_layer"],
                                  hop_overhead_s=setting["hop_overhead_s"])

    names = list(setting["schedules"])
    first = setting["schedules"][names[0]].to_json()
    per_run = args.warmup + args.iterations
    results: Dict[str, dict] = {}
    t0 = time.perf_counter()
    async with LocalSwarm(first, config, splits, emulation_for=emulation_for) as swarm:
        startup_s = time.perf_counter() - t0
        print(f"  in-process swarm of {swarm.n_nodes} nodes ready in {startup_s:.0f} s", flush=True)
        for k, name in enumerate(names):
            if k > 0:
                e = swarm.epoch
                swarm.epoch = ScheduleEpoch(e.run_id, k, e.coordinator, time.time(), e.members,
                                            setting["schedules"][name].to_json(), b"")
            start = swarm.nodes[0].current_iteration
            t_run = time.perf_counter()
            await swarm.train(start + per_run)
            its = range(start + args.warmup, start + per_run)
            mb = [min(h.microbatch_s for n in swarm.nodes for h in n.history if h.iteration == i) for i in its]
            full = [swarm.nodes[0].history[i].seconds for i in its]
            overcommits = sum(n.overcommits for n in swarm.nodes)
            results[name] = {"iterations_s": mb, "mean_s": statistics.fmean(mb), "full_iteration_s": full,
                             "mean_full_iteration_s": statistics.fmean(full), "overcommits": overcommits,
                             "wall_s": time.perf_counter() - t_run}
            print(f"  {name}: iterations {', '.join(f'{x:.2f}' for x in mb)} s (microbatch phase); "
                  f"with averaging + norm exchange {statistics.fmean(full):.2f} s", flush=True)
        results["_startup_s"] = {"value": startup_s}
    return results


def plot(path: pathlib.Path, names: List[str], measured: List[float], predicted: List[float], title: str) -> bool:
    plt = load_pyplot("chart")
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(names))
    width = 0.38
    ax.bar([x - width / 2 for x in xs], measured, width, label="measured (live, emulated WAN)")
    ax.bar([x + width / 2 for x in xs], predicted, width, label="simulator prediction")
    for x, m, p in zip(xs, measured, predicted):
        ax.text(x - width / 2, m, f"{m:.2f}", ha="center", va="bottom", fontsize=8)
        ax.text(x + width / 2, p, f"{p:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names)
    ax.set_ylabel("iteration time (s)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default=DEFAULT_PROFILE)
    p.add_argument("--nodes", type=int, default=20)
    p.add_argument("--stage-sizes", default="5,3,3,3,3,3")
    p.add_argument("--path-length", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=6, help="per data node per iteration")
    p.add_argument("--samples", type=int, default=8, help="sequences per microbatch")
    p.add_argument("--memory", type=int, default=3)
    p.add_argument("--time-scale", type=float, default=0.05,
                   help="emulated seconds per paper-setting second (default %(default)s: 20x faster)")
    p.add_argument("--warmup", type=int, default=1, help="iterations per schedule not measured")
    p.add_argument("--iterations", type=int, default=2, help="measured iterations per schedule")
    p.add_argument("--seed", type=int, default=0)
    # generous caps: the searches stop at their iteration bounds first, so the schedules are a function of
    # the seed only (docs/scheduler.md, Determinism); a cap that hits is reported
    p.add_argument("--alloc-budget-s", type=float, default=60.0, help="allocation search cap (seconds)")
    p.add_argument("--budget-s", type=float, default=60.0, help="path scheduler cap (seconds)")
    p.add_argument("--deadlock-grace-s", type=float, default=30.0)
    p.add_argument("--iteration-timeout-s", type=float, default=300.0)
    p.add_argument("--out", default=str(_ROOT / "bench" / "results"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    setting = build_setting(args)
    names = list(setting["schedules"])
    print(f"wan: {args.nodes} nodes (stage sizes {args.stage_sizes}, path length {args.path_length}) on "
          f"{setting['profile'].name}, locations round-robin; tiny model, {args.microbatches} microbatches x "
          f"{args.samples} x {TINY_SEQ_LEN} tokens per data node; memory {args.memory}")
    print(f"  time scale {args.time_scale:g} (paper setting 4 layers x d 1024 x ctx 1024 replayed "
          f"{1 / args.time_scale:.0f}x faster): compute {setting['compute_s_per_sample_per_layer']:.4f} s/sample/layer, "
          f"latency x{setting['latency_scale']:g}, bandwidth x{setting['bandwidth_scale']:.4f}, "
          f"hop overhead {setting['hop_overhead_s']:.4f} s, activation {setting['activation_bytes']} B")
    print(f"  allocation: {setting['stages']} (deterministic searches: {setting['deterministic']})")
    print("  swarm: in-process harness (real hivemind P2P + DHT per node, one Python process), not daemons",
          flush=True)
    live = asyncio.run(run_live(args, setting))
    startup = live.pop("_startup_s")["value"]
    rows = []
    print(f"{'schedule':<16}{'measured s/it':>14}{'predicted':>11}{'error':>9}{'vs full':>9}{'+avg/norm s/it':>16}")
    full_m, full_p = live[names[0]]["mean_s"], setting["predicted"][names[0]]
    for name in names:
        m, p = live[name]["mean_s"], setting["predicted"][name]
        err = (m - p) / p * 100
        rows.append({"schedule": name, "measured_s": m, "predicted_s": p, "error_pct": err,
                     "measured_vs_full": m / full_m, "predicted_vs_full": p / full_p, **live[name]})
        print(f"{name:<16}{m:>14.2f}{p:>11.2f}{err:>+8.1f}%{m / full_m:>9.3f}{live[name]['mean_full_iteration_s']:>16.2f}")
    sk = rows[-1]
    print(f"SkipPipe / full: measured {sk['measured_vs_full']:.3f}, predicted {sk['predicted_vs_full']:.3f} "
          f"(targets: measured <= 0.50, prediction within 15%: {abs(sk['error_pct']):.1f}%)")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "setting": {k: v for k, v in vars(args).items()},
        "harness": "in-process LocalSwarm (real hivemind P2P + DHT per node, one process)",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg": os.getloadavg()},
        "compute_s_per_sample_per_layer": setting["compute_s_per_sample_per_layer"],
        "bandwidth_scale": setting["bandwidth_scale"], "latency_scale": setting["latency_scale"],
        "hop_overhead_s": setting["hop_overhead_s"], "activation_bytes": setting["activation_bytes"],
        "locations": setting["locations"], "stages": setting["stages"], "startup_s": startup,
        "deterministic_schedules": setting["deterministic"],
        "schedules": {k: s.to_json() for k, s in setting["schedules"].items()}, "results": rows,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    (out / "wan.json").write_text(json.dumps(result, indent=1, default=str))
    plotted = plot(out / "wan.png", names, [r["measured_s"] for r in rows], [r["predicted_s"] for r in rows],
                   f"20 nodes, geo-distributed profile (time x{args.time_scale:g}), in-process swarm")
    print(f"wrote {out / 'wan.json'}" + (f" and {out / 'wan.png'}" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
