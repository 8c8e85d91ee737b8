"""Schedules for local swarms: balanced paths by hand, or the SkipPipe path scheduler on a loopback cost model.

The in-process harness and ``skippipe up`` need a schedule without a coordinator: a hand-built
one (:func:`build_schedule`) whose paths are easy to reason about in tests, or the real path
scheduler's (:func:`scheduler_schedule`) on a cost model where every node and link is alike.
"""

from __future__ import annotations

import itertools
from typing import Dict, Sequence

from node.errors import UserError

__all__ = ["build_schedule", "scheduler_schedule"]


def build_schedule(n_stages: int, data_nodes: int, replicas: Sequence[int], path_length: int,
                   microbatches: int, memory: int, reorder: bool = False) -> dict:
    """A schedule JSON (docs/CONTRACTS.md) with balanced paths, built by hand.

    Node ids: ``0..data_nodes-1`` are the data nodes, then stage 1's replicas, stage 2's, ...
    Microbatch ``g`` (counted over all data nodes) visits the ``g``-th combination (cyclically) of
    ``path_length - 1`` of the stages ``1..n_stages-1`` in increasing order, each stage at its
    replicas in round-robin; with ``reorder`` every fourth path swaps its last two stages.
    """
    if len(replicas) != n_stages - 1:
        raise UserError(f"need replica counts for stages 1..{n_stages - 1}, got {len(replicas)}")
    if not 1 <= path_length <= n_stages:
        raise UserError(f"path length must be in 1..{n_stages}, got {path_length}")
    if data_nodes < 1 or min(replicas, default=1) < 1 or microbatches < 1 or memory < 1:
        raise UserError("data nodes, replicas, microbatches and memory must be positive")
    stages = [list(range(data_nodes))]
    nxt = data_nodes
    for r in replicas:
        stages.append(list(range(nxt, nxt + r)))
        nxt += r
    combos = list(itertools.combinations(range(1, n_stages), path_length - 1))
    use_count: Dict[int, int] = {s: 0 for s in range(1, n_stages)}
    paths = []
    g = 0
    for j in range(microbatches):
        for d in range(data_nodes):
            order = list(combos[g % len(combos)])
            if reorder and g % 4 == 3 and len(order) >= 2:
                order[-1], order[-2] = order[-2], order[-1]
            route = [d]
            for s in order:
                route.append(stages[s][use_count[s] % len(stages[s])])
                use_count[s] += 1
            paths.append({"data_node": d, "route": route, "microbatches": 1})
            g += 1
    paths.sort(key=lambda p: p["data_node"])  # stable: microbatch order per data node kept
    n = nxt
    return {"stages": stages, "path_length": path_length, "memory": memory, "paths": paths,
            "cost": {"compute_s": [0.0] * n, "link_s": [[0.0] * n for _ in range(n)]}}


#: Loopback cost model handed to the SkipPipe path scheduler by ``skippipe up``: all nodes equal,
#: every link equal (seconds per microbatch); only the relative sizes matter to the search.
LOOPBACK_COMPUTE_S = 0.01
LOOPBACK_LINK_S = 0.002
SCHEDULER_BUDGET_S = 2.0


def scheduler_schedule(builtin: dict, path_length: int, microbatches: int, memory: int, seed: int = 0) -> dict:
    """Same allocation as ``builtin``, paths from :func:`scheduler.paths.schedule_paths`."""
    from scheduler.cost import CostMatrix
    from scheduler.paths import schedule_paths

    n = sum(len(s) for s in builtin["stages"])
    cost = CostMatrix(tuple([LOOPBACK_COMPUTE_S] * n),
                      tuple(tuple(0.0 if i == j else LOOPBACK_LINK_S for j in range(n)) for i in range(n)))
    try:
        sched = schedule_paths(builtin["stages"], cost, path_length, microbatches, memory, seed=seed,
                               budget_s=SCHEDULER_BUDGET_S)
    except Exception as e:  # ScheduleError names the violated constraint
        raise UserError(f"the path scheduler found no schedule: {e}")
    return sched.to_json()
