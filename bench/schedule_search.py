"""Scheduler benchmark: the reference's 20-node geo-distributed setting and scaled versions.

For each setting prints the simulated iteration time of the four variants (full pipeline,
random skip, SkipPipe without TC2, SkipPipe), the SkipPipe / full ratio, SkipPipe's gap to the
lower bound (scheduler/bounds.py), the scheduler wall and CPU time (allocation + SkipPipe path
search) against its target, plus how long one simulation of the iteration takes.

    python bench/schedule_search.py [--nodes 20,40,100,200] [--seed 0] [--profile NETWORK_PROFILE] [--wall-cap-s 300]

Targets: SkipPipe / full <= 0.40 at 20 nodes; scheduling <= 2 s at 20 nodes, <= 10 s at 200
nodes and <= 10 s at 1,000 nodes on 2 idle cores. The searches are bounded by work (deterministic
per seed); the wall-clock cap (WALL_CAP_S) is only a safety net, and a `*` marks a hit cap.
Stage sizes scale as [N/4, 3N/20 x 5] (20 -> 5,3,3,3,3,3); path length 4 of 6 stages (33%
skip), 6 microbatches x 8 samples per data node, memory 3.
"""

from __future__ import annotations

import argparse
import sys
import time

from scheduler.allocation import allocate
from scheduler.compare import compare_variants
from scheduler.cost import LinkProfile, build_cost, nodes_round_robin
from scheduler.simulator import simulate

DEFAULT_PROFILE = "/work/shared/profiles/geo-distributed-12.json"
#: Scheduling time targets (allocation + paths) per node count, in seconds; reported, not enforced.
BUDGET_S = {20: 2.0, 40: 6.0, 100: 25.0, 200: 10.0, 1000: 10.0}
#: Wall-clock safety cap of each search (the searches are bounded by work; see docs/scheduler.md).
WALL_CAP_S = 300.0


def stage_sizes(n: int) -> list[int]:
    per = (3 * n) // 20
    return [n - 5 * per] + [per] * 5


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="20,40,100,200")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default=DEFAULT_PROFILE)
    ap.add_argument("--wall-cap-s", type=float, default=WALL_CAP_S,
                    help="wall-clock safety cap of each search (raise it on a loaded box, where the cap would "
                         "otherwise stop a search before its work budget and make the result depend on speed)")
    args = ap.parse_args()
    profile = LinkProfile.load(args.profile)
    print(f"profile {profile.name}; path length 4 of 6 stages, 6 microbatches x 8 samples per data node, memory 3, seed {args.seed}")
    header = (f"{'nodes':>5} {'stage sizes':<22}{'full':>9}{'random':>9}{'no TC2':>9}{'SkipPipe':>9}{'SP/full':>9}"
              f"{'gap':>8}{'sched s':>9}{'cpu s':>7}{'target':>8}{'iters':>7}{'sim ms':>8}")
    print(header)
    for n in (int(x) for x in args.nodes.split(",")):
        sizes = stage_sizes(n)
        cost = build_cost(nodes_round_robin(profile, n), profile)
        budget = BUDGET_S.get(n, 0.06 * n)
        t0, c0 = time.perf_counter(), time.process_time()
        alloc = allocate(cost, sizes, args.seed, args.wall_cap_s)
        t_alloc = time.perf_counter() - t0
        cmp = compare_variants(alloc.stages, cost, 4, 6, 3, args.seed, args.wall_cap_s)
        sched_s = t_alloc + cmp.variants["skippipe"].wall_s
        cpu_s = time.process_time() - c0  # all of compare: includes the baselines and the bound
        sp = cmp.variants["skippipe"].schedule
        reps = 20
        t0 = time.perf_counter()
        for _ in range(reps):
            simulate(sp, record_timelines=True)
        sim_ms = (time.perf_counter() - t0) / reps * 1000
        capped = "*" if cmp.report.budget_hit or alloc.budget_hit else ""
        print(
            f"{n:>5} {','.join(map(str, sizes)):<22}{cmp.time_s('full_pipeline'):>9.1f}{cmp.time_s('random_skip'):>9.1f}"
            f"{cmp.time_s('skippipe_no_tc2'):>9.1f}{cmp.time_s('skippipe'):>9.1f}{cmp.ratio('skippipe'):>9.3f}"
            f"{cmp.gap('skippipe'):>+8.1%}{sched_s:>9.2f}{cpu_s:>7.1f}{budget:>7.0f}{capped:1}{cmp.report.iterations:>7}"
            f"{sim_ms:>8.2f}",
            flush=True,
        )
    print("times in simulated seconds per iteration; gap = SkipPipe / lower bound - 1; sched s = allocation + SkipPipe")
    print("path search wall time; cpu s = CPU time of allocation + all variants + bound; target = sched s target;")
    print("* = the wall-clock cap stopped a search before its work budget; sim ms = one simulation of the SkipPipe iteration")
    return 0


if __name__ == "__main__":
    sys.exit(main())
