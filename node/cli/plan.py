"""``skippipe plan`` and ``skippipe simulate``: offline scheduling and schedule evaluation.

``plan`` builds a cost model from a location profile, allocates nodes to stages, schedules the
SkipPipe paths and the baselines, and prints their simulated iteration times. ``simulate``
validates and simulates any schedule JSON (see ``docs/scheduler.md``), e.g. hand-written paths.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from node.cli.validate import (MAX_MEMORY_SLOTS, MAX_MICROBATCHES, MAX_STAGES, MAX_PLAN_NODES, MAX_SIMULATED_MICROBATCHES,
                               MAX_PLAN_WORK, plan_work,
                               check_file_size, float_range, int_range)
from node.errors import UserError
from node.spec import DEFAULT_MICROBATCH_SIZE
from scheduler.allocation import allocate
from scheduler.compare import compare_variants
from scheduler.cost import CostParams, LinkProfile, ModelShape, build_cost, link_busy_matrix, nodes_round_robin
from scheduler.errors import ScheduleError
from scheduler.routes import RouteLimits
from scheduler.schedule import load_schedule
from scheduler.simulator import simulate
from scheduler.validate import validate_schedule

__all__ = ["register", "run_plan", "run_simulate"]

#: Default wall-clock safety cap of ``plan`` (allocation + path search). The searches are bounded
#: by work (generations, iterations derived from the problem size); 1,000 nodes take under a
#: minute on 2 idle cores, so 300 s is only reached by a stalled or heavily overloaded machine.
DEFAULT_WALL_CAP_S = 300.0

LABELS = {
    "full_pipeline": "full pipeline (DT-FM)",
    "random_skip": "random skip",
    "skippipe_no_tc2": "SkipPipe without TC2",
    "skippipe": "SkipPipe",
}


def _int_list(text: str) -> list[int]:
    if len(text) > 4096:
        raise argparse.ArgumentTypeError("list too long")
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("expected at least one integer")
    if len(out) > MAX_STAGES or any(x > MAX_PLAN_NODES for x in out):
        raise argparse.ArgumentTypeError(f"at most {MAX_STAGES} entries of at most {MAX_PLAN_NODES}, got {text[:100]!r}")
    return out


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="schedule SkipPipe paths offline and compare with the baselines",
        description="Allocate nodes to stages over a latency/bandwidth profile, schedule skip-aware paths, "
        "and print the simulated iteration time of the full pipeline, random skip, SkipPipe without TC2 "
        "(collision awareness) and SkipPipe.",
    )
    p.add_argument("--profile", required=True, metavar="FILE", help="location profile: a shipped name (geo-distributed-12) or a JSON file (latency ms, bandwidth GiB/s)")
    p.add_argument("--nodes", type=int_range(1, MAX_PLAN_NODES), required=True, help="number of nodes (assigned to locations round-robin)")
    p.add_argument("--stage-sizes", type=_int_list, required=True, metavar="N0,N1,...", help="replicas per stage; stage 0 = data nodes")
    p.add_argument("--path-length", type=int_range(1, MAX_STAGES), required=True, help="stages each microbatch visits, stage 0 included")
    p.add_argument("--microbatches", type=int_range(1, MAX_MICROBATCHES), default=6, help="microbatches per data node per iteration (default 6)")
    p.add_argument("--samples", type=int_range(1, 1 << 16), default=DEFAULT_MICROBATCH_SIZE, help=f"samples per microbatch (default {DEFAULT_MICROBATCH_SIZE})")
    p.add_argument("--layers-per-stage", type=int_range(1, 1 << 12), default=4, help="layers per stage (default 4)")
    p.add_argument("--d-model", type=int_range(1, 1 << 20), default=1024, help="hidden size (default 1024)")
    p.add_argument("--seq-len", type=int_range(1, 1 << 24), default=1024, help="tokens per sample (default 1024)")
    p.add_argument("--bytes-per-element", type=int_range(1, 16), default=4, help="activation bytes per element (default 4, fp32)")
    p.add_argument("--memory", type=int_range(1, MAX_MEMORY_SLOTS), default=3, help="in-flight microbatches per node (default 3)")
    p.add_argument("--hop-overhead-s", type=float_range(0, 3600.0), default=CostParams().hop_overhead_s, help="fixed seconds per transfer (default 0.35)")
    p.add_argument("--max-swaps", type=int_range(0, 64), default=RouteLimits().max_swaps, help="reorderings per route (default 2)")
    p.add_argument("--max-jump", type=int_range(1, MAX_STAGES), default=RouteLimits().max_jump, help="largest forward stage jump (default 4)")
    p.add_argument("--locations", default=None, metavar="A,B,...", help="location of each node instead of round-robin")
    p.add_argument("--seed", type=int_range(0, 2**32 - 1), default=0, help="seed of every random choice (default 0)")
    p.add_argument(
        "--budget-s", type=float_range(0, 1e6, lo_open=True), default=DEFAULT_WALL_CAP_S, metavar="S",
        help="wall-clock safety cap for allocation + path search (default %(default)g). The searches are bounded by "
        "work, so the same inputs and seed give the same schedule; if the cap cuts one short the result depends on "
        "machine speed and the output says so",
    )
    p.add_argument(
        "--json", nargs="?", const="-", default=None, metavar="FILE",
        help="write the SkipPipe schedule plus results as JSON to FILE (or stdout, replacing the table)",
    )
    p.set_defaults(func=run_plan)

    s = subparsers.add_parser(
        "simulate",
        help="validate and simulate a schedule JSON",
        description="Check a schedule (see docs/scheduler.md) against every constraint and print its simulated "
        "iteration time and per-node utilisation. Invalid schedules are rejected naming the violated constraint.",
    )
    s.add_argument("schedule", metavar="SCHEDULE.json")
    s.add_argument("--microbatches", type=int_range(1, MAX_MICROBATCHES), default=None, help="require this many microbatches per data node")
    s.add_argument("--json", action="store_true", help="print the results as JSON")
    s.set_defaults(func=run_simulate)


def _profile_path(name_or_path: str) -> str:
    """A shipped profile's name (``geo-distributed-12``) or a path to a profile JSON."""
    from node.cli.profiles import resolve_profile

    return resolve_profile(name_or_path)


def run_plan(args: argparse.Namespace) -> int:
    try:
        profile_path = _profile_path(args.profile)
        check_file_size(profile_path, "--profile")
        profile = LinkProfile.load(profile_path)
        locations = [x.strip() for x in args.locations.split(",")] if args.locations else None
        nodes = nodes_round_robin(profile, args.nodes, args.memory, locations)
        shape = ModelShape(args.layers_per_stage, args.d_model, args.seq_len, args.samples, args.bytes_per_element)
        for name, value in (("--layers-per-stage", shape.layers_per_stage), ("--samples", shape.samples_per_microbatch),
                            ("--d-model", shape.d_model), ("--seq-len", shape.seq_len), ("--bytes-per-element", shape.bytes_per_element),
                            ("--microbatches", args.microbatches), ("--memory", args.memory)):
            if value < 1:
                raise UserError(f"{name} must be >= 1")
        if args.budget_s <= 0:
            raise UserError("--budget-s must be > 0")
        work = plan_work(args.nodes, args.stage_sizes[0], args.microbatches, args.path_length)
        if work > MAX_PLAN_WORK:
            raise UserError(f"plan too large to search: nodes x data nodes x microbatches x path length^2 = {work} "
                            f"(at most {MAX_PLAN_WORK}); use fewer nodes, data nodes, microbatches or a shorter path")
        cost = build_cost(nodes, profile, shape, CostParams(hop_overhead_s=args.hop_overhead_s))
        limits = RouteLimits(max_swaps=args.max_swaps, max_jump=args.max_jump)
        t0 = time.perf_counter()
        alloc = allocate(cost, args.stage_sizes, args.seed, args.budget_s)
        t_alloc = time.perf_counter() - t0
        cmp = compare_variants(
            alloc.stages, cost, args.path_length, args.microbatches, args.memory, args.seed,
            max(0.0, args.budget_s - t_alloc), limits=limits, link_busy_s=link_busy_matrix(nodes, profile, shape),
        )
    except ScheduleError as e:
        raise UserError(str(e)) from None
    except UnicodeDecodeError:
        raise UserError(f"--profile {args.profile} is not a JSON text file") from None
    t_paths = cmp.variants["skippipe"].wall_s
    S = len(args.stage_sizes)
    hit_in = [name for name, hit in (("allocation", alloc.budget_hit), ("path search", cmp.report.budget_hit)) if hit]
    results = {
        "setting": {
            "profile": profile.name, "nodes": args.nodes, "stage_sizes": args.stage_sizes,
            "path_length": args.path_length, "skip_ratio": 1 - args.path_length / S,
            "microbatches_per_data_node": args.microbatches, "samples_per_microbatch": args.samples,
            "layers_per_stage": args.layers_per_stage, "memory": args.memory, "seed": args.seed,
        },
        "variants": cmp.to_json(),
        "lower_bound": cmp.bound.to_json(),
        "gap_to_bound": cmp.gap("skippipe"),
        # the plan's iteration time when the cost model is off (scheduler/robust.py)
        "predicted_spread": cmp.report.spread.to_json() if cmp.report.spread is not None else None,
        "work": {
            "allocation_generations": alloc.generations, "allocation_generation_budget": alloc.generation_budget,
            "path_iterations": cmp.report.iterations, "path_iteration_budget": cmp.report.iteration_budget,
        },
        # no wall times in the JSON: all of it is a function of the inputs and the seed, unless
        # the cap was hit, which this says (the wall times are printed, to stderr with --json)
        "wall_cap": {"cap_s": args.budget_s, "hit": bool(hit_in), "hit_in": hit_in},
    }
    wall_line = f"scheduler wall time: allocation {t_alloc:.2f} s + paths {t_paths:.2f} s = {t_alloc + t_paths:.2f} s"
    doc = cmp.variants["skippipe"].schedule.to_json()
    doc["results"] = results
    if args.json is not None:
        text = json.dumps(doc, indent=1)
        if args.json == "-":
            print(text)
            print(wall_line, file=sys.stderr)
            return 0
        try:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        except OSError as e:
            raise UserError(f"cannot write {args.json}: {e.strerror or e}") from None
    print(
        f"{args.nodes} nodes on {profile.name}, stages {args.stage_sizes}, path length {args.path_length} of {S} "
        f"(skip ratio {1 - args.path_length / S:.0%}), {args.microbatches} microbatches x {args.samples} samples "
        f"per data node, memory {args.memory}, seed {args.seed}"
    )
    for s, nodes_s in enumerate(alloc.stages):
        print(f"  stage {s}: {list(nodes_s)}")
    print(f"{'variant':<24}{'iteration (s)':>15}{'vs full':>10}{'vs bound':>10}")
    for name in ("full_pipeline", "random_skip", "skippipe_no_tc2", "skippipe"):
        above = "" if name == "full_pipeline" else f"{cmp.gap(name):>+10.1%}"
        print(f"{LABELS[name]:<24}{cmp.time_s(name):>15.2f}{cmp.ratio(name):>10.3f}{above}")
    print(
        f"SkipPipe / full = {cmp.ratio('skippipe'):.3f}, SkipPipe / random skip = {cmp.ratio('skippipe', 'random_skip'):.3f}, "
        f"SkipPipe / no TC2 = {cmp.ratio('skippipe', 'skippipe_no_tc2'):.3f}"
    )
    print(
        f"lower bound on any skipping schedule: {cmp.bound.value_s:.2f} s ({cmp.bound.detail}); "
        f"SkipPipe is {cmp.gap('skippipe'):+.1%} above it"
    )
    if cmp.report.spread is not None:
        sp = cmp.report.spread
        print(f"if the costs are off (compute and links +-25%, shared links): SkipPipe {sp.p10_s:.2f}-{sp.p90_s:.2f} s "
              f"(10th-90th percentile of {sp.scenarios} scenarios), mean {sp.mean_s:.2f} s")
    print(
        f"work: allocation {alloc.generations}/{alloc.generation_budget} generations, "
        f"path search {cmp.report.iterations}/{cmp.report.iteration_budget} iterations"
    )
    print(wall_line)
    if hit_in:
        print(
            f"warning: the wall-clock cap of {args.budget_s:g} s stopped the {' and the '.join(hit_in)} before "
            f"{'its' if len(hit_in) == 1 else 'their'} work budget: this schedule depends on machine speed (raise --budget-s for a reproducible one)"
        )
    if args.json not in (None, "-"):
        print(f"schedule and results written to {args.json}")
    return 0


def run_simulate(args: argparse.Namespace) -> int:
    check_file_size(args.schedule, "schedule")
    try:
        sched = load_schedule(args.schedule)
        total = sum(p.microbatches for p in sched.paths)
        if total > MAX_SIMULATED_MICROBATCHES or len(sched.paths) > MAX_SIMULATED_MICROBATCHES:
            raise UserError(f"invalid schedule {args.schedule}: {total} microbatches in {len(sched.paths)} path entries; "
                            f"at most {MAX_SIMULATED_MICROBATCHES} can be simulated")
        validate_schedule(sched, microbatches_per_data_node=args.microbatches)
    except ScheduleError as e:
        raise UserError(f"invalid schedule {args.schedule}: {e}") from None
    except UnicodeDecodeError:
        raise UserError(f"invalid schedule {args.schedule}: not a JSON text file") from None
    if sched.cost is None:
        raise UserError(f"invalid schedule {args.schedule}: cost: no 'cost' (compute_s, link_s) to simulate with")
    res = simulate(sched)
    T = res.iteration_time_s
    busy = {v: res.busy_s[v] for s in sched.stages for v in s}
    if args.json:
        print(json.dumps({
            "iteration_time_s": T,
            "finish_s": {str(d): t for d, t in res.finish_s.items()},
            "busy_s": {str(v): b for v, b in busy.items()},
            "utilisation": {str(v): (b / T if T > 0 else 0.0) for v, b in busy.items()},
        }, indent=1))
        return 0
    total = sum(p.microbatches for p in sched.paths)
    print(f"valid schedule: {len(sched.stages)} stages, path length {sched.path_length}, memory {sched.memory}, "
          f"{total} microbatches in {len(sched.paths)} path entries")
    print(f"simulated iteration time: {T:.2f} s")
    for s, nodes_s in enumerate(sched.stages):
        cells = ", ".join(f"{v}:{(busy[v] / T if T > 0 else 0):.0%}" for v in nodes_s)
        print(f"  stage {s} busy: {cells}")
    return 0
