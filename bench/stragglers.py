"""Straggler benchmark: what one slow stage replica costs a training swarm, with and without the features
that route around it.

Why: volunteer machines are uneven, and SkipPipe's promise is that the schedule routes around what is
slow instead of waiting for it. This measures that promise on real daemons, side by side in one run.

Setup: the ``skippipe up`` shape (its :data:`node.cli.up_runners.UP_SPEC`: the tiny model on Shakespeare, 2
data nodes, replicas 2,2,1,1,1 of stages 1-5, paths of 4 of 6 stages, 4 microbatches per data node, 2 in
flight per node, one torch thread per daemon): 9 ``skippipe node run --train`` daemons on 127.0.0.1
(:class:`node.launch.process_swarm.ProcessSwarm`, started from the run's ``TrainSpec.to_argv()``, followed by
:class:`node.launch.watch.TrainingWatch`). Every daemon pads its compute to ``--compute-s`` seconds per
sample per layer (:mod:`node.dataplane.emulation`, ``--compute-s-per-sample-per-layer``), so a step takes a
known time whatever else runs on the box; the slow replica pads to ``--slowdown`` times that. Three fresh
swarms, one after another:

1. ``no_straggler``: every daemon at ``--compute-s``;
2. ``slow_replica``: the last replica of ``--slow-stage`` (default stage 1, one of two replicas) at
   ``--slowdown`` x ``--compute-s``, the straggler features on (the defaults);
3. ``slow_replica_features_off``: the same, with each feature in :data:`FEATURE_OFF_SWITCHES` that this
   ``node run`` offers turned off (observed deadlines: ``--deadlines model``, hedging: ``--hedging off``,
   re-planning from measured compute: ``--replan off``; the results say which were available).

Reported per configuration over the measured iterations (after ``--warmup``): mean, median, p95 and max
seconds per iteration (data node 0's ``IterationStats.seconds``, step included), microbatches dropped (its
``dropped``, counted over all data nodes), hedges sent (both data nodes' ``recovery.hedges.sent`` over the
whole run, warm-up included; 0 where the daemons do not report hedges), the epochs issued (the swarm's
latest schedule epoch number at the end; epochs are numbered 1, 2, ... per swarm) and those trained on, and
the microbatches each replica of a stage with several replicas ran per epoch (its ``local_visits`` summed
over the run, warm-up included) next to what the last epoch plans for it per iteration: with re-planning on,
the slow replica's share drops once its measured compute reaches the coordinator.
``slow_replica_ratio`` = mean iteration of configuration 2 / configuration 1 (target: at most 1.3).

All daemons share this machine's cores: an idle box gives the figures, a loaded one only says it works.

Run: ``python bench/stragglers.py`` (6 + 30 iterations per configuration; about 10-15 minutes on 2 idle
cores); ``--quick`` for a smoke run (1 + 3 iterations). Writes ``bench/results/stragglers.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

try:
    from node.ops.bench_cli import (BenchError, add_swarm_run_arguments, bench_workdir, resolve_run_length, run_bench,
                                    run_record)
except ImportError as _e:  # not the project's venv: one line, not a traceback
    print(f"error: cannot import the node package ({_e}); run with the project's venv: "
          ".venv/bin/python bench/stragglers.py (bash scripts/setup.sh creates it)", file=sys.stderr)
    sys.exit(2)

_ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS_DIR = _ROOT / "bench" / "results"

__all__ = ["main", "parse_args", "percentile", "summarize", "slow_node_index", "CONFIGS", "FEATURE_OFF_SWITCHES"]

#: The three configurations, in the order they run: (name, slow replica present, straggler features on).
CONFIGS: Tuple[Tuple[str, bool, bool], ...] = (
    ("no_straggler", False, True),
    ("slow_replica", True, True),
    ("slow_replica_features_off", True, False),
)

# ----------------------------------------------------------------------------------------------------------------
# The ONE place that says how the straggler features are turned off for the control configuration.
#: Per feature, the ``node run`` arguments that turn it off, in order of preference: the first whose flag
#: ``node run`` declares (and whose value is one of its choices) is passed to every daemon of the control run;
#: a feature with none declared stays as it is, and the results list it under ``features_not_switchable``.
#: Observed deadlines are switched through the run's spec (``TrainSpec.deadlines``), the others by flag.
FEATURE_OFF_SWITCHES: Tuple[Tuple[str, Tuple[Tuple[str, ...], ...]], ...] = (
    ("observed deadlines", (("--deadlines", "model"),)),
    ("hedging", (("--hedging", "off"), ("--no-hedging",), ("--no-hedge",), ("--hedge", "off"))),
    ("re-planning", (("--replan", "off"), ("--no-replan",), ("--rebalance", "off"), ("--no-rebalance",))),
)
# ----------------------------------------------------------------------------------------------------------------

#: Compute seconds per sample per layer every daemon is padded to: a tiny-model forward of a microbatch of 8
#: then takes 0.08 s and a backward 0.12 s, above the real work of a tiny stage even on a loaded 2-core box
#: (so the slow replica really is ``--slowdown`` times slower) and small enough that an iteration stays ~seconds.
DEFAULT_COMPUTE_S = 0.01
#: How much slower the slow replica computes (the issue's "one replica 4x slower").
DEFAULT_SLOWDOWN = 4.0
#: The target: mean iteration with the slow replica (features on) at most this many times the one without.
TARGET_RATIO = 1.3
#: Seconds between polls of the swarm (TrainingWatch asks the data nodes each time, the rest every 5 s).
POLL_S = 0.5
#: Iterations of a node's ``training`` history read at the end (the replicas' microbatches per epoch): more than
#: any run of this bench trains.
MAX_HISTORY = 10_000
#: Seconds an iteration may take before a daemon stops as stalled: a 4x slow replica on a loaded box with the
#: cost-model deadlines only can take a minute or more per iteration.
ITERATION_TIMEOUT_S = 240.0


# ---------------------------------------------------------------------------------------------- pure parts
def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, linear between the closest ranks (numpy's default)."""
    xs = sorted(float(v) for v in values)
    if not xs:
        raise ValueError("no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in 0..100, got {q}")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(history: Sequence[dict], first: int, count: int) -> dict:
    """Figures of the iterations ``first .. first + count - 1`` of a data node's ``training`` RPC history."""
    rows = sorted((h for h in history if first <= int(h["iteration"]) < first + count), key=lambda h: h["iteration"])
    if not rows:
        raise ValueError(f"no iterations {first}..{first + count - 1} in the history")
    secs = [float(h["seconds"]) for h in rows]
    return {
        "iterations": [rows[0]["iteration"], rows[-1]["iteration"]], "n": len(rows),
        "mean_s": statistics.fmean(secs), "median_s": statistics.median(secs), "p95_s": percentile(secs, 95),
        "max_s": max(secs), "min_s": min(secs),
        "dropped": sum(int(h.get("dropped") or 0) for h in rows),
        "retried": sum(int(h.get("retried") or 0) for h in rows),
        "microbatches": sum(int(h.get("microbatches") or 0) for h in rows),
        "epochs_trained": sorted({h.get("epoch") for h in rows}, key=str),
        "compute_overrun_s": statistics.fmean(float(h.get("compute_overrun_s") or 0.0) for h in rows),
        "mean_loss": statistics.fmean(float(h["loss"]) for h in rows),
        "seconds": [round(s, 3) for s in secs],
    }


def hedges_sent(states: Sequence[Optional[dict]]) -> Optional[int]:
    """Hedges the data nodes sent (their ``recovery.hedges.sent``), or None when none reports hedges."""
    counts = [((st or {}).get("recovery") or {}).get("hedges") for st in states]
    counts = [int(c.get("sent") or 0) for c in counts if isinstance(c, dict)]
    return sum(counts) if counts else None


def slow_node_index(stage_sizes: Sequence[int], stage: int) -> int:
    """Node index of the last replica of ``stage`` in :class:`ProcessSwarm`'s layout (stage by stage)."""
    if not 1 <= stage < len(stage_sizes):
        raise BenchError(f"--slow-stage must be in 1..{len(stage_sizes) - 1} (stage 0 holds the data nodes)")
    if stage_sizes[stage] < 2:
        raise BenchError(f"stage {stage} has {stage_sizes[stage]} replica; a straggler needs a stage with a second "
                         "replica to route around it (stages 1 and 2 have two in the skippipe up shape)")
    return sum(stage_sizes[: stage + 1]) - 1


def replica_shares(states: Dict[int, Optional[dict]], stages: Sequence[int], schedule: Optional[dict]) -> List[dict]:
    """Per node of a stage with several replicas: its stage, the microbatches it ran per epoch (``local_visits``
    of its ``training`` history, by the epoch each iteration trained on) and what ``schedule`` (the swarm's last
    epoch, the ``schedule`` RPC's answer) routes through it per iteration."""
    counts: Dict[int, int] = {}
    for s in stages:
        counts[s] = counts.get(s, 0) + 1
    planned: Dict[str, int] = {}
    planned_known = bool(schedule and schedule.get("schedule"))
    if planned_known:
        members = list(schedule.get("members") or [])
        for path in schedule["schedule"].get("paths", []):
            for v in set(path.get("route", [])):
                if 0 <= v < len(members):
                    planned[members[v]] = planned.get(members[v], 0) + int(path.get("microbatches", 1))
    out = []
    for i, state in sorted(states.items()):
        if counts.get(stages[i], 0) < 2 or stages[i] == 0:
            continue
        per_epoch: Dict[str, int] = {}
        for h in (state or {}).get("history") or []:
            key = str(h.get("epoch"))
            per_epoch[key] = per_epoch.get(key, 0) + int(h.get("local_visits") or 0)
        peer = (state or {}).get("peer_id")
        out.append({"node": i, "stage": stages[i], "microbatches_per_epoch": per_epoch,
                    # a replica the last epoch routes nothing through gets 0 (None: no schedule or peer known)
                    "last_epoch_planned_per_iteration": planned.get(peer, 0) if peer and planned_known else None})
    return out


def off_switches(node_run_parser: argparse.ArgumentParser) -> Dict[str, Optional[Tuple[str, ...]]]:
    """Per feature of :data:`FEATURE_OFF_SWITCHES`, the arguments this ``node run`` takes to turn it off
    (None: it has no switch for it)."""
    actions = {opt: a for a in node_run_parser._actions for opt in a.option_strings}
    found: Dict[str, Optional[Tuple[str, ...]]] = {}
    for feature, spellings in FEATURE_OFF_SWITCHES:
        found[feature] = None
        for argv in spellings:
            action = actions.get(argv[0])
            if action is None:
                continue
            if len(argv) > 1 and action.choices is not None and argv[1] not in action.choices:
                continue
            if (len(argv) > 1) != (action.nargs != 0):  # a value for a switch that takes none, or the reverse
                continue
            found[feature] = tuple(argv)
            break
    return found


# ---------------------------------------------------------------------------------------------- one swarm
def _node_run_parser() -> argparse.ArgumentParser:
    from node.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["node"]
    return next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)).choices["run"]


def run_config(args, name: str, slow: bool, features: bool, switches, base: pathlib.Path) -> dict:
    """One fresh swarm of the ``skippipe up`` shape; train ``warmup + iterations``; measure; stop every daemon."""
    from node.cli.up_runners import UP_SPEC
    from node.errors import UserError
    from node.launch.process_swarm import ProcessSwarm, training_state
    from node.launch.watch import TrainingWatch
    from node.net.rpc import call_http

    n_nodes = sum(args.sizes)
    deadlines = "observed" if features or switches["observed deadlines"] is None else "model"
    spec = dataclasses.replace(UP_SPEC, iterations=args.warmup + args.iterations, min_members=n_nodes,
                               run_id=f"stragglers-{name}".replace("_", "-"), checkpoint_every=0,
                               iteration_timeout=ITERATION_TIMEOUT_S, agreement_timeout=float(args.start_timeout),
                               deadlines=deadlines)
    if features:  # node run plans with the start-up benchmark unless asked: the features-on runs ask
        flag_switches = [("--replan", "on")] if switches["re-planning"] is not None else []
    else:
        flag_switches = [a for f, a in switches.items() if a is not None and f != "observed deadlines"]

    def node_args(i: int) -> List[str]:
        compute = args.compute_s * (args.slowdown if slow and i == args.slow_node else 1.0)
        out = ["--node-name", f"node{i}", "--compute-s-per-sample-per-layer", repr(compute)]
        return out + [x for argv in flag_switches for x in argv]

    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    swarm = ProcessSwarm(n_nodes, args.sizes, base_dir=base / name, spec=spec, extra_args=node_args, env=env)
    t0 = time.perf_counter()
    leftover: List[int] = []
    ready_s = None
    try:
        swarm.start(timeout=args.start_timeout)
        ready_s = time.perf_counter() - t0
        print(f"  {name}: {n_nodes} daemons ready in {ready_s:.0f} s (logs in {base / name})", flush=True)

        def progress(h: dict) -> None:
            print(f"    {name}: iteration {h['iteration']}  {h['seconds']:.2f} s  loss {h['loss']:.3f}  dropped "
                  f"{h.get('dropped', 0)}  epoch {h.get('epoch')}", flush=True)

        watch = TrainingWatch(swarm, float(args.start_timeout), args.stall_timeout, logs=str(base / name),
                              on_iteration=progress)
        while not watch.poll():
            time.sleep(POLL_S)
        data_nodes = [n for n in swarm.nodes if n.stage == 0 and n.alive]
        finals = [training_state(n, limit=1) for n in data_nodes]
        schedules = [call_http(n.rpc_url, "schedule", {}, timeout=10.0) or {} for n in data_nodes]
        epochs = [s.get("epoch") for s in schedules]
        every = {i: training_state(n, limit=MAX_HISTORY) for i, n in enumerate(swarm.nodes)}
        shares = replica_shares(every, [n.stage for n in swarm.nodes],
                                max(schedules, key=lambda s: s.get("epoch") or 0, default=None))
    except UserError as e:  # the launcher's or the watch's: a daemon that would not start, a stall, an error
        raise BenchError(f"{name}: {e}") from None
    finally:
        leftover = swarm.stop_shielded()
    first = int(watch.first or 0) + args.warmup
    stats = summarize(watch.history, first, args.iterations)
    sent = hedges_sent(finals)
    return {**stats, "slow_node": args.slow_node if slow else None, "features_on": features, "deadlines": deadlines,
            "feature_off_flags": flag_switches, "hedges_sent": sent or 0, "hedges_reported": sent is not None,
            "epochs_issued": max((e for e in epochs if e is not None), default=None), "replica_microbatches": shares,
            "dead_nodes": sorted(watch.deaths.dead), "daemons_ready_s": ready_s,
            "wall_s": time.perf_counter() - t0, "leftover_processes": len(leftover)}


# ---------------------------------------------------------------------------------------------- report
def format_table(results: Dict[str, dict]) -> str:
    from node.ops.tables import text_table

    rows = [["configuration", "iterations", "mean s/it", "median", "p95", "max", "dropped", "hedges sent",
             "epochs issued", "compute overrun s/it"]]
    for name, r in results.items():
        rows.append([name, str(r["n"]), f"{r['mean_s']:.2f}", f"{r['median_s']:.2f}", f"{r['p95_s']:.2f}",
                     f"{r['max_s']:.2f}", str(r["dropped"]),
                     str(r["hedges_sent"]) if r["hedges_reported"] else "n/a", str(r["epochs_issued"]),
                     f"{r['compute_overrun_s']:.2f}"])
    return text_table(rows)


def format_shares(results: Dict[str, dict]) -> str:
    """The microbatches each replica of a replicated stage ran, per epoch, and what the last epoch plans for it."""
    from node.ops.tables import text_table

    rows = [["configuration", "node", "stage", "microbatches run per epoch", "last epoch plans /it"]]
    for name, r in results.items():
        for share in r.get("replica_microbatches") or []:
            slow = " (slow)" if share["node"] == r.get("slow_node") else ""
            per_epoch = ", ".join(f"epoch {e}: {n}" for e, n in sorted(share["microbatches_per_epoch"].items()))
            rows.append([name, f"node{share['node']}{slow}", str(share["stage"]), per_epoch or "-",
                         str(share["last_epoch_planned_per_iteration"])])
    return text_table(rows)


def ratio(results: Dict[str, dict], name: str) -> Optional[float]:
    base = results.get("no_straggler")
    other = results.get(name)
    if not base or not other or base["mean_s"] <= 0:
        return None
    return other["mean_s"] / base["mean_s"]


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/stragglers.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=None, help="measured iterations per configuration (default 30; "
                   "3 with --quick)")
    p.add_argument("--warmup", type=int, default=None, help="iterations before the measured ones (default 6; 1 with "
                   "--quick): the first iteration opens every stream, the observed deadlines need samples and a re-plan "
                   "needs the replicas' measured compute (8 steps each) and its minimum interval after the first epoch")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 warm-up and 3 measured iterations each")
    p.add_argument("--compute-s", type=float, default=DEFAULT_COMPUTE_S,
                   help="every daemon's --compute-s-per-sample-per-layer (default %(default)s)")
    p.add_argument("--slowdown", type=float, default=DEFAULT_SLOWDOWN,
                   help="the slow replica computes this many times slower (default %(default)s)")
    p.add_argument("--slow-stage", type=int, default=1,
                   help="the slow replica is the last replica of this stage (default %(default)s)")
    add_swarm_run_arguments(p, RESULTS_DIR)
    args = p.parse_args(argv)
    resolve_run_length(p, args, iterations=30, warmup=6)
    if not args.compute_s > 0 or not args.slowdown >= 1:
        p.error("--compute-s must be > 0 and --slowdown >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_bench(lambda: _main(args), "every daemon was stopped")


def _main(args) -> int:
    try:
        import node.compat  # noqa: F401  the daemons' own imports (torch, hivemind)
        from node.cli.up_runners import DEFAULT_DATA_NODES, DEFAULT_REPLICAS
    except ImportError as e:
        raise BenchError(f"cannot import the node package ({e}); run with the project's venv: "
                         ".venv/bin/python bench/stragglers.py (bash scripts/setup.sh creates it)") from None
    args.sizes = [DEFAULT_DATA_NODES] + [int(x) for x in DEFAULT_REPLICAS.split(",")]
    args.slow_node = slow_node_index(args.sizes, args.slow_stage)
    switches = off_switches(_node_run_parser())
    started, load_start = time.strftime("%Y-%m-%d %H:%M:%S %Z"), os.getloadavg()
    print(f"stragglers: {sum(args.sizes)} daemons, stage sizes {args.sizes} (skippipe up), compute padded to "
          f"{args.compute_s:g} s/sample/layer, slow replica node {args.slow_node} (stage {args.slow_stage}) "
          f"{args.slowdown:g}x; {args.warmup} + {args.iterations} iterations per configuration; {os.cpu_count()} "
          f"CPUs, load {load_start[0]:.1f}", flush=True)
    print("  features off in the control: " + ", ".join(
        f"{f} ({' '.join(a)})" if a else f"{f} (no switch in this node run: stays on)" for f, a in switches.items()),
        flush=True)

    results: Dict[str, dict] = {}
    with bench_workdir(args.workdir, "skippipe-stragglers-") as base:
        for name, slow, features in CONFIGS:
            results[name] = run_config(args, name, slow, features, switches, base)
    slow_ratio, off_ratio = ratio(results, "slow_replica"), ratio(results, "slow_replica_features_off")
    print()
    print(format_table(results))
    print()
    print(format_shares(results))
    print(f"\nslow_replica_ratio (mean with the slow replica / without, features on): {slow_ratio:.2f} "
          f"(target <= {TARGET_RATIO}: {'met' if slow_ratio <= TARGET_RATIO else 'NOT met'}); features off: "
          f"{off_ratio:.2f}")
    result = {
        **run_record(args, started, load_start, "all daemons on these cores, loopback"),
        "iteration_time": "data node 0's IterationStats.seconds (wall time per iteration, step included)",
        "slow_replica_ratio": slow_ratio, "features_off_ratio": off_ratio, "target_ratio": TARGET_RATIO,
        "feature_off_switches": {f: list(a) if a else None for f, a in switches.items()},
        "features_not_switchable": [f for f, a in switches.items() if a is None],
        "configs": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "stragglers.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {path}")
    return 1 if any(r["leftover_processes"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
