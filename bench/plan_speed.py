"""Time the plan (allocation + SkipPipe path search) and fingerprint what it chose.

The setting of ``bench/schedule_search.py`` (geo-distributed-12 profile, stage sizes
``[N/4, 3N/20 x 5]``, path length 4 of 6, 6 microbatches per data node, memory 3): for each node
count, the wall and CPU time (``time.process_time``) of :func:`scheduler.allocation.allocate` and
of :func:`scheduler.paths.search_paths`, and a SHA-256 digest of everything they chose (the
allocation and its score, every microbatch's route in dispatch order, the collision-blind
schedule, the report's times and spread, and the simulated finish time of every data node, floats
as ``repr``). Run it against two checkouts (``PYTHONPATH=<checkout>``) to check that a speed-up
changed no result: the digests must be equal.

    python bench/plan_speed.py [--nodes 20,200,1000] [--seed 0] [--cprofile PREFIX] [--json]
    python bench/plan_speed.py --nodes 20,200,1000 --against /work/main [--rounds 3]

``--cprofile PREFIX`` writes ``PREFIX-<nodes>.prof`` (cProfile of allocation + search).
``--against ROOT`` runs this script alternately on ROOT's ``scheduler`` and on this checkout's,
``--rounds`` times each (a fresh interpreter per run, so neither warms the other's caches), and
prints both side by side: the medians of wall and CPU time, their ratio (this checkout / ROOT), and
whether every digest matched. On a shared box the ratios of CPU times are the figure to read.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

from scheduler.allocation import allocate
from scheduler.cost import LinkProfile, build_cost, nodes_round_robin
from scheduler.paths import search_paths
from scheduler.simulator import simulate

DEFAULT_PROFILE = "/work/shared/profiles/geo-distributed-12.json"
#: Wall-clock safety cap of each search, high so that load on a shared box never cuts a
#: work-bounded search short (which would make the result depend on speed).
WALL_CAP_S = 3000.0
#: The setting of bench/schedule_search.py: path length, stages, microbatches per data node, memory.
PATH_LENGTH, MICROBATCHES, MEMORY = 4, 6, 3


def stage_sizes(n: int) -> list[int]:
    per = (3 * n) // 20
    return [n - 5 * per] + [per] * 5


def fingerprint(alloc, found) -> tuple[str, dict]:
    """Digest of the plan, plus the few figures worth reading."""
    sched, rep = found.schedule, found.report
    sim = simulate(sched)
    parts = {
        "stages": alloc.stages,
        "alloc_score": repr(alloc.score),
        "alloc_generations": alloc.generations,
        "routes": sorted(sched.dispatch_order().items()),
        "blind": sorted(found.blind.dispatch_order().items()),
        "report": (repr(rep.initial_time_s), repr(rep.final_time_s), rep.iterations, rep.iteration_budget, rep.budget_hit,
                   None if rep.spread is None else tuple(repr(x) for x in rep.spread.to_json().values())),
        "sim": (repr(sim.iteration_time_s), sorted((d, repr(t)) for d, t in sim.finish_s.items()),
                tuple(repr(x) for x in sim.busy_s)),
    }
    digest = hashlib.sha256(repr(parts).encode()).hexdigest()[:16]
    return digest, {"iteration_time_s": sim.iteration_time_s, "iterations": rep.iterations,
                    "budget_hit": rep.budget_hit or alloc.budget_hit}


def run(n: int, seed: int, profile: LinkProfile, prof_prefix: str | None) -> dict:
    cost = build_cost(nodes_round_robin(profile, n), profile)
    prof = cProfile.Profile() if prof_prefix else None
    if prof:
        prof.enable()
    w0, c0 = time.perf_counter(), time.process_time()
    alloc = allocate(cost, stage_sizes(n), seed, WALL_CAP_S)
    w1, c1 = time.perf_counter(), time.process_time()
    found = search_paths(alloc.stages, cost, PATH_LENGTH, MICROBATCHES, MEMORY, seed, WALL_CAP_S)
    w2, c2 = time.perf_counter(), time.process_time()
    if prof:
        prof.disable()
        prof.dump_stats(f"{prof_prefix}-{n}.prof")
    digest, info = fingerprint(alloc, found)
    return {"nodes": n, "seed": seed, "digest": digest, **info, "alloc_wall_s": w1 - w0, "alloc_cpu_s": c1 - c0,
            "search_wall_s": w2 - w1, "search_cpu_s": c2 - c1, "plan_wall_s": w2 - w0, "plan_cpu_s": c2 - c0}


def compare(args: argparse.Namespace) -> int:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    roots = {"base": os.path.abspath(args.against), "this": here}
    runs: dict[tuple[str, int], list[dict]] = {}
    for rnd in range(args.rounds):
        for name, root in roots.items():
            cmd = [sys.executable, os.path.abspath(__file__), "--json", "--nodes", args.nodes, "--seed", str(args.seed),
                   "--profile", args.profile]
            out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": root}, check=True, capture_output=True, text=True)
            for line in out.stdout.splitlines():
                r = json.loads(line)
                runs.setdefault((name, r["nodes"]), []).append(r)
                print(f"round {rnd + 1} {name:<4} {r['nodes']:>5} nodes: digest {r['digest']} plan {r['plan_wall_s']:.2f} s wall,"
                      f" {r['plan_cpu_s']:.2f} s CPU", flush=True)
    print(f"base = {roots['base']}, this = {roots['this']}; medians of {args.rounds} runs; ratio = this / base")
    print(f"{'nodes':>5} {'part':<7}{'base wall':>10}{'this wall':>10}{'ratio':>7}{'base cpu':>10}{'this cpu':>10}{'ratio':>7}"
          f"  same plan")
    ok = True
    for n in (int(x) for x in args.nodes.split(",")):
        b, t = runs[("base", n)], runs[("this", n)]
        same = len({r["digest"] for r in b + t}) == 1
        ok &= same
        for part in ("alloc", "search", "plan"):
            med = {k: {m: statistics.median(r[f"{part}_{m}_s"] for r in rs) for m in ("wall", "cpu")} for k, rs in (("b", b), ("t", t))}
            print(f"{n:>5} {part:<7}{med['b']['wall']:>10.2f}{med['t']['wall']:>10.2f}{med['t']['wall'] / med['b']['wall']:>7.3f}"
                  f"{med['b']['cpu']:>10.2f}{med['t']['cpu']:>10.2f}{med['t']['cpu'] / med['b']['cpu']:>7.3f}"
                  f"  {('yes ' + b[0]['digest']) if same else 'NO'}")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="20,200")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default=DEFAULT_PROFILE, help="link profile JSON")
    ap.add_argument("--cprofile", default=None, help="write cProfile stats to PREFIX-<nodes>.prof")
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    ap.add_argument("--against", default=None, help="another checkout to compare with, side by side")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each checkout with --against")
    args = ap.parse_args()
    if args.against:
        return compare(args)
    profile = LinkProfile.load(args.profile)
    if not args.json:
        print(f"{'nodes':>5} {'digest':<17}{'sim s':>9}{'iters':>6}{'alloc s':>9}{'cpu':>7}{'search s':>9}{'cpu':>7}"
              f"{'plan s':>8}{'cpu':>7}")
    for n in (int(x) for x in args.nodes.split(",")):
        r = run(n, args.seed, profile, args.cprofile)
        if args.json:
            print(json.dumps(r), flush=True)
        else:
            print(f"{n:>5} {r['digest']:<17}{r['iteration_time_s']:>9.3f}{r['iterations']:>6}{r['alloc_wall_s']:>9.2f}"
                  f"{r['alloc_cpu_s']:>7.2f}{r['search_wall_s']:>9.2f}{r['search_cpu_s']:>7.2f}{r['plan_wall_s']:>8.2f}"
                  f"{r['plan_cpu_s']:>7.2f}{' (wall cap hit)' if r['budget_hit'] else ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
