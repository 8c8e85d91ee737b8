"""Baselines, run in the same simulator as the optimiser.

* :func:`full_pipeline` - DT-FM style: fixed aligned pipelines through every stage over the same
  allocation and the same global batch (the reference's ``baseline`` / "DT-FM*").
* :func:`random_skip` - skipping with every SkipPipe constraint (path length, reordering
  limits, stage balance, memory safety) but network-blind: random stage orders and the least
  used replica (the reference's ``random`` / "DT-FM skip").
"""

from __future__ import annotations

import random
from typing import Mapping, Sequence

import numpy as np
from scipy.optimize import linear_sum_assignment

from scheduler.cost import CostMatrix
from scheduler.errors import ScheduleError
from scheduler.paths import _Problem, _random_balanced, normalise_request, routes_to_schedule
from scheduler.routes import RouteLimits
from scheduler.schedule import PathEntry, Schedule
from scheduler.validate import validate_schedule

__all__ = ["aligned_pipelines", "full_pipeline", "random_skip"]


def aligned_pipelines(stages: Sequence[Sequence[int]], cost: CostMatrix) -> list[tuple[int, ...]]:
    """As many disjoint full pipelines as the smallest stage allows, one node per stage each.

    Stage by stage, the replicas of the next stage are matched to the current pipeline tails by a
    minimum-cost assignment on round-trip hop time (the last stage also pays the hop home), so
    the pipelines use the fastest links available (DT-FM aligns its pipelines the same way).
    """
    link = np.asarray(cost.link_s, dtype=float)
    W = link + link.T
    P = min(len(s) for s in stages)
    S = len(stages)
    if S == 1:
        return [(d,) for d in list(stages[0])[:P]]
    heads = np.asarray(stages[0])
    nxt = np.asarray(stages[1])
    sub = W[np.ix_(heads, nxt)] + (W[np.ix_(nxt, heads)].T if S == 2 else 0.0)
    rows, cols = linear_sum_assignment(sub)
    order = np.argsort(sub[rows, cols], kind="stable")[:P]
    pipes = [[int(heads[rows[k]]), int(nxt[cols[k]])] for k in order]
    for s in range(2, S):
        cand = np.asarray(stages[s])
        tails = np.asarray([p[-1] for p in pipes])
        sub = W[np.ix_(tails, cand)]
        if s == S - 1:
            sub = sub + W[np.ix_(cand, np.asarray([p[0] for p in pipes]))].T
        rows, cols = linear_sum_assignment(sub)
        for r, c in zip(rows, cols):
            pipes[r].append(int(cand[c]))
    pipes.sort()
    return [tuple(p) for p in pipes]


def full_pipeline(
    stages: Sequence[Sequence[int]],
    cost: CostMatrix,
    microbatches_per_data_node: int | Mapping[int, int] | Sequence[int],
    memory: int,
) -> Schedule:
    """Every microbatch through all stages on fixed aligned pipelines (no skipping).

    Only as many data nodes as there are pipelines take part; the global batch (the sum of
    ``microbatches_per_data_node``) is split over them as evenly as possible, so the work per
    iteration equals the skipping schedules' (the reference's ``baseline-sends``).
    """
    st, counts = normalise_request(stages, cost, len(stages), microbatches_per_data_node, memory)
    pipes = aligned_pipelines(st, cost)
    total = sum(counts.values())
    base, rem = divmod(total, len(pipes))
    entries = []
    for k, p in enumerate(pipes):
        c = base + (1 if k < rem else 0)
        if c:
            entries.append(PathEntry(p[0], p, c))
    sched = Schedule(st, len(st), memory, tuple(entries), cost, RouteLimits())
    validate_schedule(sched)
    return sched


def random_skip(
    stages: Sequence[Sequence[int]],
    cost: CostMatrix,
    path_length: int,
    microbatches_per_data_node: int | Mapping[int, int] | Sequence[int],
    memory: int,
    seed: int = 0,
    *,
    limits: RouteLimits = RouteLimits(),
    tries: int = 50,
) -> Schedule:
    """Network-blind skipping under the same constraints as :func:`scheduler.paths.schedule_paths`."""
    st, counts = normalise_request(stages, cost, path_length, microbatches_per_data_node, memory)
    pb = _Problem(st, cost, path_length, memory, limits, 20000)
    routes = _random_balanced(pb, counts, random.Random(seed), tries, lanes=memory) or _random_balanced(
        pb, counts, random.Random(seed), tries
    )
    if routes is None:
        raise ScheduleError("stage-balance", f"no balanced random routes found in {tries} tries")
    sched = routes_to_schedule(st, routes, path_length, memory, cost, limits)
    validate_schedule(sched, microbatches_per_data_node=counts)
    return sched
