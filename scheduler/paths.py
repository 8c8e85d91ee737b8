"""Skip-aware path scheduling for a fixed node-to-stage allocation.

Given the stages (stage 0 = data nodes), a cost matrix, the path length and the microbatches per
data node, choose a route for every microbatch that obeys the convergence rules (start and end at
its data node, exactly ``path_length`` stages, each at most once, bounded reordering), the load
rule (every non-zero stage gets an equal share of visits, +-1), and memory safety (no route cycle
that can deadlock), and that minimises the simulated iteration time.

Method (instead of the reference's CBS over a time-aware A*, which re-plans every agent at every
search node and stops on heuristic thresholds):

1. **Construction.** Microbatches are taken in dispatch order, interleaved across data nodes.
   For each, every allowed stage order whose stages still have quota is scored by an exact
   shortest path over the stage replicas (a layered dynamic programme on round-trip cost: hops
   both ways plus forward + backward compute), where each node's compute is inflated by
   ``load_weight x`` the work already placed on it. ``load_weight = 0`` with even per-node caps
   is collision-blind ("SkipPipe without TC2"); positive weights spread load.
   Where the local search is cut short by its task budget, one more start gives every data node
   replicas of its own (:func:`replica_set_routes`), and from it a search step simulates only
   the data nodes its change can reach through shared replicas (:mod:`scheduler.components`).
2. **Collision-aware refinement (TC2).** The best construction (by simulated iteration time)
   is improved by a seeded local search whose objective is the event simulation itself
   (:mod:`scheduler.simulator`): change a replica, exchange a stage between two microbatches,
   reorder a route, or swap two microbatches' dispatch order. Every move keeps all constraints,
   so the search can stop at any point with a valid schedule.

Determinism: the search is bounded by work, not time: the construction is a fixed set of
greedy passes and the local search takes :func:`iteration_budget` steps (derived from the
problem size) unless ``max_iterations`` says otherwise, so the result depends only on the
inputs and ``seed``. ``budget_s`` is a wall-clock safety cap on a stalled or overloaded machine:
when it cuts the search the result is still valid but depends on machine speed, and
:func:`schedule_paths_report` says so (``budget_hit``).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from scheduler.components import Sharing
from scheduler.cost import CostMatrix
from scheduler.errors import ScheduleError
from scheduler.replica_sets import improve_sets
from scheduler.robust import PredictedSpread, RobustConfig, cost_scenarios, most_robust
from scheduler.routes import RouteLimits, allowed_sequences
from scheduler.schedule import PathEntry, Schedule
from scheduler.simulator import simulate_routes
from scheduler.stage_orders import StageOrders
from scheduler.validate import deadlock_risk, validate_schedule

__all__ = [
    "PathReport",
    "schedule_paths",
    "schedule_paths_report",
    "search_paths",
    "PathSearch",
    "iteration_budget",
    "construct_routes",
    "collision_blind_routes",
    "blind_makespan",
    "normalise_request",
    "stage_quotas",
    "routes_to_schedule",
]

Routes = dict[int, list[tuple[int, ...]]]


@dataclass(frozen=True)
class PathReport:
    """How a path search went: simulated iteration time of the best construction and of the
    result, local-search iterations done, whether the wall-clock cap ``budget_s`` stopped it
    before ``iteration_budget`` (its work budget), and its wall time."""

    initial_time_s: float
    final_time_s: float
    iterations: int
    budget_hit: bool
    wall_s: float
    iteration_budget: int = 0
    #: the result's iteration time under the robustness scenarios (None: not judged)
    spread: PredictedSpread | None = None


def normalise_request(
    stages: Sequence[Sequence[int]],
    cost: CostMatrix,
    path_length: int,
    microbatches_per_data_node: int | Mapping[int, int] | Sequence[int],
    memory: int,
) -> tuple[tuple[tuple[int, ...], ...], dict[int, int]]:
    """Check a scheduling request and return ``(stages, microbatches per data node)``.

    Raises ScheduleError for empty stages, unknown or repeated node ids, a path length outside
    ``1..len(stages)``, memory < 1, or no microbatches at all.
    """
    st = tuple(tuple(int(v) for v in s) for s in stages)
    if not st:
        raise ScheduleError("stages", "need at least one stage")
    seen: set[int] = set()
    for s, nodes in enumerate(st):
        if not nodes:
            raise ScheduleError("stages", f"stage {s} has no nodes (fewer nodes than stages need?)")
        for v in nodes:
            if not 0 <= v < cost.n_nodes:
                raise ScheduleError("stages", f"node {v} of stage {s} is not in the cost matrix (0..{cost.n_nodes - 1})")
            if v in seen:
                raise ScheduleError("stages", f"node {v} is in two stages")
            seen.add(v)
    if not 1 <= path_length <= len(st):
        raise ScheduleError("path-length", f"path_length {path_length} must be in 1..{len(st)} (the number of stages)")
    if memory < 1:
        raise ScheduleError("memory", f"memory must be >= 1, got {memory}")
    if isinstance(microbatches_per_data_node, int):
        counts = {d: microbatches_per_data_node for d in st[0]}
    elif isinstance(microbatches_per_data_node, Mapping):
        counts = {d: int(microbatches_per_data_node.get(d, 0)) for d in st[0]}
        extra = set(microbatches_per_data_node) - set(st[0])
        if extra:
            raise ScheduleError("microbatch-count", f"nodes {sorted(extra)} are not data nodes")
    else:
        if len(microbatches_per_data_node) != len(st[0]):
            raise ScheduleError("microbatch-count", f"{len(microbatches_per_data_node)} counts for {len(st[0])} data nodes")
        counts = {d: int(c) for d, c in zip(st[0], microbatches_per_data_node)}
    if any(c < 0 for c in counts.values()):
        raise ScheduleError("microbatch-count", "microbatch counts must be >= 0")
    if sum(counts.values()) < 1:
        raise ScheduleError("microbatch-count", "no microbatches to schedule")
    return st, counts


def stage_quotas(stages: Sequence[Sequence[int]], total_microbatches: int, path_length: int) -> list[int]:
    """Visits each stage must get: stage 0 every microbatch; the ``(L-1) x total`` other visits
    split evenly, the remainder going to the stages with the most replicas (then lowest index),
    which absorb an extra visit best."""
    S = len(stages)
    q = [total_microbatches] + [0] * (S - 1)
    if S == 1:
        return q
    V = (path_length - 1) * total_microbatches
    base, rem = divmod(V, S - 1)
    order = sorted(range(1, S), key=lambda s: (-len(stages[s]), s))
    for s in range(1, S):
        q[s] = base
    for s in order[:rem]:
        q[s] += 1
    return q


def _slots(counts: Mapping[int, int], data_nodes: Sequence[int], lanes: int | None) -> list[tuple[int, int, int]]:
    """Units to route, as ``(data node, first microbatch index, weight)``, interleaved across
    data nodes.

    ``lanes=None``: one unit per microbatch. ``lanes=m``: data node d's microbatches are split
    round-robin into ``min(m, c_d)`` lanes (microbatch i in lane ``i mod m``) and each lane gets
    one route, so with dispatch in index order about one microbatch per lane is in flight: the
    reference's "agents", which let a static per-node lane count stand in for memory (TC1).
    """
    per_d: dict[int, list[tuple[int, int]]] = {}
    for d in data_nodes:
        c = counts[d]
        if lanes is None:
            per_d[d] = [(i, 1) for i in range(c)]
        else:
            k = min(lanes, c)
            per_d[d] = [(j, c // k + (1 if j < c % k else 0)) for j in range(k)] if k else []
    out = []
    for k in range(max((len(v) for v in per_d.values()), default=0)):
        for d in data_nodes:
            if k < len(per_d[d]):
                out.append((d, per_d[d][k][0], per_d[d][k][1]))
    return out


def _expand(counts: Mapping[int, int], data_nodes: Sequence[int], slots, slot_routes, lanes: int | None) -> "Routes":
    """Per-microbatch routes in dispatch order from per-unit routes (see :func:`_slots`)."""
    by_first = {(d, i): r for (d, i, _), r in zip(slots, slot_routes)}
    out: Routes = {}
    for d in data_nodes:
        c = counts[d]
        k = c if lanes is None else min(lanes, c)
        out[d] = [by_first[(d, i % k)] for i in range(c)] if k else []
    return out


class _Problem:
    """Precomputed arrays shared by construction and search."""

    def __init__(self, stages, cost: CostMatrix, path_length: int, memory: int, limits: RouteLimits, max_sequences: int,
                 link_busy_s: Sequence[Sequence[float]] | None = None):
        self.stages = stages
        self.cost = cost
        self.L = path_length
        self.memory = memory
        self.limits = limits
        #: seconds one transfer occupies each link (None: links unshared); the search simulates with it
        self.link_busy_s = link_busy_s
        self.S = len(stages)
        self.stage_of = {v: s for s, nodes in enumerate(stages) for v in nodes}
        self.seqs = allowed_sequences(self.S, path_length, limits, max_sequences)
        if not self.seqs:
            raise ScheduleError("max-jump", f"no stage order of length {path_length} satisfies {limits}")
        reachable = {s for q in self.seqs for s in q}
        missing = [s for s in range(1, self.S) if s not in reachable] if path_length > 1 else []
        if missing:
            raise ScheduleError(
                "stage-balance", f"stages {missing} appear in no allowed route (raise max_jump or path_length); they cannot get their share"
            )
        self.seq_set = set(self.seqs)
        self.by_stageset: dict[frozenset, list[tuple[int, ...]]] = {}
        for q in self.seqs:
            self.by_stageset.setdefault(frozenset(q), []).append(q)
        link = np.asarray(cost.link_s, dtype=float)
        self.W = link + link.T  # a hop is crossed forward one way and backward the other
        comp = np.asarray(cost.compute_s, dtype=float)
        self.work = comp * (1.0 + cost.backward_ratio)
        self.R = [np.asarray(s, dtype=int) for s in stages]
        #: scoring of stage orders by their cheapest replicas (on replica classes)
        self.orders = StageOrders(stages, self.W, self.seqs)
        #: which stages each allowed order visits (orders x stages), for the quota checks
        self.seq_member = np.zeros((len(self.seqs), self.S), dtype=bool)
        for i, q in enumerate(self.seqs):
            self.seq_member[i, list(q)] = True

    def has_swap(self, route: Sequence[int]) -> bool:
        highest = 0
        for v in route[1:]:
            s = self.stage_of[v]
            if s < highest:
                return True
            highest = s
        return False


class _HopGraph:
    """Multiset of route hops between non-data nodes, to keep the hop graph acyclic while
    routes are built (an acyclic hop graph can never deadlock on memory, whatever the loads)."""

    def __init__(self) -> None:
        self.succ: dict[int, dict[int, int]] = {}

    def add(self, route: Sequence[int]) -> None:
        for u, v in zip(route[1:], route[2:]):
            e = self.succ.setdefault(u, {})
            e[v] = e.get(v, 0) + 1

    def _reaches(self, src: int, dst: int, extra: dict[int, set[int]]) -> bool:
        stack, seen = [src], {src}
        while stack:
            u = stack.pop()
            if u == dst:
                return True
            for w in list(self.succ.get(u, ())) + list(extra.get(u, ())):
                if w not in seen:
                    seen.add(w)
                    stack.append(w)
        return False

    def would_cycle(self, route: Sequence[int]) -> bool:
        extra: dict[int, set[int]] = {}
        for u, v in zip(route[1:], route[2:]):
            if self._reaches(v, u, extra):
                return True
            extra.setdefault(u, set()).add(v)
        return False


def construct_routes(
    pb: _Problem,
    counts: Mapping[int, int],
    load_weight: float,
    even_node_caps: bool,
    lanes: int | None = None,
    order: Sequence[int] | None = None,
) -> Routes | None:
    """Greedy network-aware construction (step 1 of the module docstring).

    load_weight: how much already-placed work on a node adds to its cost (0: collision-blind).
    even_node_caps: no replica of stage s gets more than ``ceil(quota_s / replicas_s)`` visits.
    lanes: route per lane instead of per microbatch (see :func:`_slots`).
    order: data nodes in the order they pick routes in each round (default: ``stages[0]``).
    Returns per-microbatch routes in dispatch order, or ``None`` if the stage quotas could not be
    met this way (the caller then tries another construction).
    """
    stages = pb.stages
    slots = _slots(counts, stages[0] if order is None else order, lanes)
    total = sum(counts.values())
    quota = stage_quotas(stages, total, pb.L)
    left = quota[:]  # visits still to place per stage
    cap = np.full(pb.cost.n_nodes, np.inf)
    if even_node_caps:
        for s in range(1, pb.S):
            for v in stages[s]:
                cap[v] = math.ceil(quota[s] / len(stages[s]))
    visits = np.zeros(pb.cost.n_nodes)
    load = np.zeros(pb.cost.n_nodes)
    chosen_routes: list[tuple[int, ...]] = []
    hops = _HopGraph()
    remaining = total
    for d, _, w in slots:
        remaining -= w
        nw = pb.work + load_weight * load
        nw = np.where(visits + w > cap, np.inf, nw)
        chosen = None
        costs = pb.orders.costs(d, nw)
        left_a = np.asarray(left)
        fits = ~(pb.seq_member & (left_a < w)).any(axis=1)  # every stage of the order has w visits left
        # strict: no stage would be left with more visits than microbatches remain to place
        over = np.where(pb.seq_member, left_a - w, left_a)[:, 1:] > remaining
        for eligible in (fits & ~over.any(axis=1), fits):
            # cheapest first; equal costs (common: replicas in one location) in the orders' lexicographic order
            for c, i in sorted((costs[i], i) for i in np.flatnonzero(eligible).tolist() if math.isfinite(costs[i])):
                r = pb.orders.best_route(d, pb.seqs[i], nw)[1]
                if not hops.would_cycle(r):
                    chosen = r
                    break
            if chosen is not None:
                break
        if chosen is None:
            return None
        for v in chosen[1:]:
            left[pb.stage_of[v]] -= w
            visits[v] += w
            load[v] += w * pb.work[v]
        hops.add(chosen)
        chosen_routes.append(chosen)
    if any(x != 0 for x in left[1:]):
        return None
    return _expand(counts, stages[0], slots, chosen_routes, lanes)


def replica_set_routes(pb: _Problem, counts: Mapping[int, int], lanes: int | None = 1, *, seed: int = 0,
                       exchange_moves_per_unit: int = 40) -> Routes | None:
    """Every data node its own replicas, the most constrained data node first.

    Each unit of :func:`_slots` (with ``lanes=1``: all of a data node's microbatches) gets one
    route under even per-node caps (no replica of stage ``s`` takes more than
    ``ceil(quota_s / replicas_s)`` visits), so where there are about ``L - 1`` replicas per data
    node every data node gets a set of replicas of its own and its waves queue only behind
    themselves. In one 20-second window all of a location's data nodes start their first waves;
    sharing replicas there makes them queue, and a set of its own costs no waiting but the data
    node's own pipelining (on the geo profile a lone data node on three local replicas simulates
    at 54.4 s against the 50.75 s bound).

    Which data node picks next matters where a location has fewer local replicas than its data
    nodes need: picked in a fixed order, the last ones get whatever is left, often on another
    continent. Here each step serves the unit whose cheapest still-available route (round trip
    plus its data node's own work) is the most expensive, so the data nodes that must go abroad
    take the nearest foreign replicas first and the ones with local choices keep them
    (bottleneck-first greedy). Data nodes no hop tells apart (the same hop times to every replica,
    the same own work, the same weight) share one scoring per step, which keeps a step at one
    :meth:`StageOrders.costs` call per location at 1,000 nodes.

    Where replicas are exactly as many as the units need, the last units still get what is left;
    :func:`scheduler.replica_sets.improve_sets` then exchanges replicas between units, seeded by
    ``seed``, ``exchange_moves_per_unit`` tries per unit (40: on the 1,000-node geo setting 10 gave
    66.6-71.5 s over seeds, 40 gives 66.28 s for seeds 0-2, 160 no better and four times the work).
    Returns per-microbatch routes in dispatch order, or ``None`` if the quotas, caps or the acyclic
    hop rule could not be met (with ``lanes=1``: when a stage's quota is not a sum of whole data
    nodes' visits; the search then does without this start).
    """
    stages = pb.stages
    data = list(stages[0])
    slots = _slots(counts, data, lanes)
    total = sum(counts.values())
    quota = stage_quotas(stages, total, pb.L)
    left = np.asarray(quota)
    cap = np.full(pb.cost.n_nodes, np.inf)
    for s in range(1, pb.S):
        cap[list(stages[s])] = math.ceil(quota[s] / len(stages[s]))
    visits = np.zeros(pb.cost.n_nodes)
    own = np.asarray(pb.cost.compute_s, dtype=float) * (1.0 + pb.cost.loss_ratio + pb.cost.backward_ratio)
    reps = np.asarray([v for s in stages[1:] for v in s], dtype=int)
    _, cls = np.unique(np.c_[pb.W[np.ix_(data, reps)], own[data]], axis=0, return_inverse=True)
    cls_of = dict(zip(data, np.asarray(cls).reshape(-1).tolist()))
    chosen: list[tuple[int, ...] | None] = [None] * len(slots)
    pending = list(range(len(slots)))
    hops = _HopGraph()
    remaining = total
    while pending:
        scored: dict[tuple[int, int], tuple[float, list[tuple[float, int]]]] = {}
        pick = None  # (score, position in pending)
        for k, j in enumerate(pending):
            d, _, w = slots[j]
            key = (cls_of[d], w)
            if key not in scored:
                nw = np.where(visits + w > cap, np.inf, pb.work)
                costs = pb.orders.costs(d, nw)
                fits = ~(pb.seq_member & (left < w)).any(axis=1)
                over = (np.where(pb.seq_member, left - w, left)[:, 1:] > remaining - w).any(axis=1)
                ranked: list[tuple[float, int]] = []
                for eligible in (fits & ~over, fits):
                    ranked = sorted((costs[i], i) for i in np.flatnonzero(eligible).tolist() if math.isfinite(costs[i]))
                    if ranked:
                        break
                if not ranked:
                    return None
                scored[key] = (ranked[0][0] + own[d], ranked)
                if pick is None or scored[key][0] > pick[0]:
                    pick = (scored[key][0], k)
        k = pick[1]
        j = pending.pop(k)
        d, _, w = slots[j]
        nw = np.where(visits + w > cap, np.inf, pb.work)
        route = None
        for _, i in scored[(cls_of[d], w)][1]:
            r = pb.orders.best_route(d, pb.seqs[i], nw)[1]
            if r and not hops.would_cycle(r):
                route = r
                break
        if route is None:
            return None
        remaining -= w
        for v in route[1:]:
            left[pb.stage_of[v]] -= w
            visits[v] += w
        hops.add(route)
        chosen[j] = route
    if (left[1:] != 0).any():
        return None
    if exchange_moves_per_unit > 0:
        units = [(d, w) for d, _, w in slots]
        chosen = improve_sets(units, chosen, pb.W, pb.work, own, pb.stage_of, pb.seq_set,
                              exchange_moves_per_unit * len(units), random.Random(seed))
    return _expand(counts, data, slots, chosen, lanes)


def blind_makespan(pb: _Problem, routes: Routes) -> tuple[float, float]:
    """Collision-blind iteration estimate: every microbatch takes its isolated round trip, a data
    node runs ``min(memory, c_d)`` lanes of them back to back. Returns (max, sum) over lanes."""
    cost = pb.cost
    worst, total = 0.0, 0.0
    for d, rs in routes.items():
        k = min(pb.memory, len(rs))
        lanes = [0.0] * max(k, 1)
        for i, r in enumerate(rs):
            t = sum(pb.work[v] for v in r) + cost.loss_s(d)
            if len(r) > 1:  # every hop of the cycle is crossed once each way
                t += sum(pb.W[u, v] for u, v in zip(r, r[1:] + (r[0],)))
            lanes[i % len(lanes)] += t
        worst = max(worst, max(lanes))
        total += sum(lanes)
    return worst, total


def collision_blind_routes(pb: _Problem, counts: Mapping[int, int], orders: int = 8) -> Routes | None:
    """"SkipPipe without TC2": the reference's non-collision-aware scheduler in spirit. Each lane
    gets a network-optimal route (isolated round-trip cost) under even per-node lane caps (the
    static memory rule, TC1) and the stage quotas; the greedy is run for ``orders`` rotations of
    the data-node order and the result with the best collision-blind makespan is kept."""
    data = list(pb.stages[0])
    best = None
    for k in range(min(orders, len(data))):
        rot = data[k:] + data[:k]
        r = construct_routes(pb, counts, 0.0, True, lanes=pb.memory, order=rot) or construct_routes(
            pb, counts, 0.0, True, order=rot
        )
        if r is None or deadlock_risk(r, pb.memory) is not None:
            continue
        score = blind_makespan(pb, r)
        if best is None or score < best[0]:
            best = (score, r)
    if best is None:
        r = construct_routes(pb, counts, 0.0, False)
        return r if r is not None and deadlock_risk(r, pb.memory) is None else None
    return best[1]


def routes_to_schedule(
    stages, routes: Routes, path_length: int, memory: int, cost: CostMatrix, limits: RouteLimits
) -> Schedule:
    """Pack per-microbatch routes into path entries, merging consecutive equal routes of a data
    node (dispatch order is preserved)."""
    entries: list[PathEntry] = []
    for d in stages[0]:
        run: tuple[int, ...] | None = None
        c = 0
        for r in routes.get(d, []):
            if r == run:
                c += 1
                continue
            if run is not None:
                entries.append(PathEntry(d, run, c))
            run, c = r, 1
        if run is not None:
            entries.append(PathEntry(d, run, c))
    return Schedule(tuple(tuple(s) for s in stages), path_length, memory, tuple(entries), cost, limits)


def _objective(routes: Routes, cost: CostMatrix, memory: int, link_busy_s=None) -> tuple[float, float]:
    res = simulate_routes(routes, cost, memory, link_busy_s=link_busy_s)
    return res.iteration_time_s, sum(res.finish_s.values())


def _critical(routes: Routes, cost: CostMatrix, memory: int, link_busy_s=None) -> int:
    res = simulate_routes(routes, cost, memory, link_busy_s=link_busy_s)
    return max(res.finish_s, key=lambda d: (res.finish_s[d], -d))


def iteration_budget(
    total_microbatches: int,
    path_length: int,
    *,
    iterations_per_microbatch: int = 40,
    base_iterations: int = 300,
    simulated_task_budget: int = 1_500_000,
    min_iterations: int = 100,
) -> int:
    """Local-search steps for a problem of this size: the work budget that bounds the search
    (the wall-clock ``budget_s`` is only a safety cap), so a seed gives the same schedule on any
    machine.

    ``base_iterations + iterations_per_microbatch x microbatches`` (1500 for the 20-node
    setting, where the search levels off), but at most ``simulated_task_budget`` simulated tasks
    in all: each step simulates the whole iteration, ``microbatches x (2 x path_length + 1)``
    tasks, at about 2 us a task on one core (3 s of simulation in all), so that 200 nodes plan
    in well under 10 s and 1,000 nodes in under 60 s; but not fewer than ``min_iterations``
    for that.
    """
    tasks = max(1, total_microbatches * (2 * path_length + 1))
    want = base_iterations + iterations_per_microbatch * total_microbatches
    return min(want, max(min_iterations, simulated_task_budget // tasks))


@dataclass(frozen=True)
class PathSearch:
    """Everything one path search produced: the SkipPipe schedule and its report, and the
    collision-blind schedule ("SkipPipe without TC2") it started from, which comes free."""

    schedule: Schedule
    report: PathReport
    blind: Schedule


def search_paths(
    stages: Sequence[Sequence[int]],
    cost: CostMatrix,
    path_length: int,
    microbatches_per_data_node: int | Mapping[int, int] | Sequence[int],
    memory: int,
    seed: int = 0,
    budget_s: float = 60.0,
    *,
    limits: RouteLimits = RouteLimits(),
    collision_aware: bool = True,
    max_iterations: int | None = None,
    iterations_per_microbatch: int = 40,
    base_iterations: int = 300,
    simulated_task_budget: int = 1_500_000,
    min_iterations: int = 100,
    load_weights: Sequence[float] = (0.25, 0.5, 1.0, 2.0),
    max_sequences: int = 20000,
    blind_orders: int = 8,
    anneal_temperature: float = 0.0,
    robust: RobustConfig | None = RobustConfig(),
    link_busy_s: Sequence[Sequence[float]] | None = None,
    robust_snapshots: int = 4,
    robust_task_budget: int = 300_000,
    near_replicas: int | None = 6,
    interferer_share: float = 0.1,
    replica_sets: bool = True,
) -> PathSearch:
    """:func:`schedule_paths_report`, also returning the collision-blind schedule."""
    t0 = time.perf_counter()
    st, counts = normalise_request(stages, cost, path_length, microbatches_per_data_node, memory)
    pb = _Problem(st, cost, path_length, memory, limits, max_sequences, link_busy_s)
    blind = collision_blind_routes(pb, counts, blind_orders)
    candidates: list[Routes] = [blind] if blind is not None else []
    total = sum(counts.values())
    want = base_iterations + iterations_per_microbatch * total
    iters = max_iterations if max_iterations is not None else iteration_budget(
        total, path_length, iterations_per_microbatch=iterations_per_microbatch, base_iterations=base_iterations,
        simulated_task_budget=simulated_task_budget, min_iterations=min_iterations,
    )
    # where the task cap cuts the search short of its levelling-off budget, a start that needs
    # little searching, and whose steps simulate only a few data nodes, pays
    capped = replica_sets and max_iterations is None and iters < want
    if collision_aware:
        for w in load_weights:
            for lanes in (None, memory):
                r = construct_routes(pb, counts, w, False, lanes=lanes)
                if r is not None:
                    candidates.append(r)
        if capped:
            r = replica_set_routes(pb, counts, seed=seed)
            if r is not None:
                candidates.append(r)
    candidates = [r for r in candidates if deadlock_risk(r, memory) is None]
    if not candidates:
        fallback = _random_balanced(pb, counts, random.Random(seed)) or _random_balanced(pb, counts, random.Random(seed), lanes=memory)
        if fallback is None:
            raise ScheduleError(
                "stage-balance", "could not find routes giving every non-zero stage an equal share under these limits"
            )
        candidates = [fallback]
    blind_sched = routes_to_schedule(st, candidates[0], path_length, memory, cost, limits)
    validate_schedule(blind_sched, microbatches_per_data_node=counts)
    if not collision_aware:
        t = simulate_routes(candidates[0], cost, memory, link_busy_s=link_busy_s).iteration_time_s
        return PathSearch(blind_sched, PathReport(t, t, 0, False, time.perf_counter() - t0, 0), blind_sched)
    scored = [(_objective(r, cost, memory, link_busy_s), i) for i, r in enumerate(candidates)]
    (cur_obj, bi) = min(scored)
    cur = {d: list(rs) for d, rs in candidates[bi].items()}
    initial = cur_obj[0]
    rng = random.Random(seed)
    snapshots: list[Routes] = []
    done, hit, iters = _local_search(pb, cur, cur_obj, iters, rng, t0 + budget_s, anneal_temperature,
                              snapshots=snapshots, keep_snapshots=robust_snapshots if robust is not None else 0,
                              near_replicas=near_replicas, interferer_share=interferer_share,
                              task_budget=iters * total * (2 * path_length + 1) if capped else None,
                              component_steps=want)
    spread = None
    if robust is not None:
        # near-best alternatives: the last improvements of the search, then the best constructions
        pool: list[Routes] = [cur] + [r for r in reversed(snapshots) if r != cur]
        pool += [candidates[i] for _, i in sorted(scored)[:2] if candidates[i] not in pool]
        per_plan = max(1, total * (2 * path_length + 1)) * (robust.samples + 2)  # simulated tasks to judge one
        pool = pool[: max(1, robust_task_budget // per_plan)]
        k, spread = most_robust(pool, cost, memory, cost_scenarios(cost, link_busy_s, robust, seed), robust)
        cur = {d: list(rs) for d, rs in pool[k].items()}
    final = _objective(cur, cost, memory, link_busy_s)[0]
    sched = routes_to_schedule(st, cur, path_length, memory, cost, limits)
    validate_schedule(sched, microbatches_per_data_node=counts)
    return PathSearch(sched, PathReport(initial, final, done, hit, time.perf_counter() - t0, iters, spread), blind_sched)


def schedule_paths_report(
    stages: Sequence[Sequence[int]],
    cost: CostMatrix,
    path_length: int,
    microbatches_per_data_node: int | Mapping[int, int] | Sequence[int],
    memory: int,
    seed: int = 0,
    budget_s: float = 60.0,
    **options,
) -> tuple[Schedule, PathReport]:
    """:func:`schedule_paths` plus a :class:`PathReport`.

    max_iterations: local-search steps (the work budget); default :func:`iteration_budget` of
        the problem size, tuned by ``iterations_per_microbatch``, ``base_iterations``,
        ``simulated_task_budget`` and ``min_iterations`` (see there).
    budget_s: wall-clock safety cap on the whole search. Not reached, the result depends only
        on the inputs and ``seed``; reached, the search stops early with a valid schedule and
        the report says ``budget_hit``.
    load_weights: penalties tried by the construction when ``collision_aware`` (each gives one
        starting point; the best simulated one is refined).
    max_sequences: cap on enumerated stage orders (exponential in the path length).
    blind_orders: data-node orders tried by the collision-blind construction.
    anneal_temperature: simulated-annealing start temperature as a fraction of the starting
        iteration time (0: plain descent).
    robust: scenarios the finished search and its near-best alternatives are judged under
        (:mod:`scheduler.robust`); the best mean wins and the report carries its spread.
        None: take the search's nominal best as it is.
    link_busy_s: seconds one transfer occupies each directed link, so the search and the scenarios
        queue transfers on shared links as the emulation and real links do (None: unshared, the
        reference's model).
    robust_snapshots: how many of the search's last improvements are judged besides its result.
    near_replicas: a local-search move that picks a replica for a route position picks among
        this many that are cheapest there (hops to the neighbours plus own work); None: any
        replica. 6 covers a stage's replicas in the route's own location and the next nearest on
        the 200-node geo setting (2.5 per stage and location; at 1,000 nodes the 12.5 local ones,
        all tied, are all in reach); on its seeds 0-2 it gave 64.6 s against 65.5 s with any
        replica (4: 64.3 s, 10: 65.3 s, both with the interferer moves).
    interferer_share: fraction of the local-search steps that move another data node's
        microbatch off a replica the critical data node's routes use. 0.1: on the 200-node geo
        setting (seeds 0-2) it gave 63.8 s against 64.6 s without; 0.15 and 0.2 did worse.
    robust_task_budget: simulated tasks the judging may take (a fifth of the search's default
        ``simulated_task_budget``): at 1,000 nodes only the result and one alternative are judged.
    replica_sets: where ``simulated_task_budget`` cuts the local search below
        ``base_iterations + iterations_per_microbatch x microbatches`` steps, also start from
        :func:`replica_set_routes` (every data node its own replicas); from such a start a step
        simulates only the data nodes its change can affect (:mod:`scheduler.components`), so the
        same task budget buys more steps. On the geo setting: 200 nodes 63.1 -> 61.5 s, 1,000 nodes
        63.6 s instead of 70.1 s on the same allocation; 20 nodes are not cut and keep their plan.
    """
    out = search_paths(stages, cost, path_length, microbatches_per_data_node, memory, seed, budget_s, **options)
    return out.schedule, out.report


def schedule_paths(
    stages: Sequence[Sequence[int]],
    cost: CostMatrix,
    path_length: int,
    microbatches_per_data_node: int | Mapping[int, int] | Sequence[int],
    memory: int,
    seed: int = 0,
    budget_s: float = 60.0,
    **options,
) -> Schedule:
    """Routes for every microbatch over a FIXED allocation; always valid or ScheduleError.

    stages: node ids per stage, ``stages[0]`` the data nodes (sizes may differ; a stage may have
        one replica). cost: compute and link times (``cost.n_nodes`` covers every id).
    path_length: stages each microbatch visits, stage 0 included (skip ratio
        ``1 - path_length / len(stages)``; ``== len(stages)`` means no skipping).
    microbatches_per_data_node: one count for all data nodes, a mapping, or a sequence aligned
        with ``stages[0]``; totals need not divide evenly.
    memory: in-flight microbatches per node. seed: all randomness. budget_s: wall-clock safety
        cap (see module docstring on determinism). options: see :func:`schedule_paths_report`.
    """
    return schedule_paths_report(stages, cost, path_length, microbatches_per_data_node, memory, seed, budget_s, **options)[0]


def _random_balanced(
    pb: _Problem, counts: Mapping[int, int], rng: random.Random, tries: int = 50, lanes: int | None = None
) -> Routes | None:
    """Network-blind routes meeting the quotas: random admissible stage orders, the least-visited
    replica of each stage (random tie-break), no hop cycles. Used by the random-skip baseline
    and as a last resort here; ``None`` if ``tries`` attempts all failed."""
    stages = pb.stages
    slots = _slots(counts, stages[0], lanes)
    total = sum(counts.values())
    quota = stage_quotas(stages, total, pb.L)
    for _ in range(tries):
        left = quota[:]
        visits = {v: 0 for v in pb.stage_of}
        chosen: list[tuple[int, ...]] = []
        hops = _HopGraph()
        ok = True
        rem = total
        for d, _, w in slots:
            rem -= w
            adm = [
                q
                for q in pb.seqs
                if all(left[s] >= w for s in q) and all(left[s] - (w if s in q else 0) <= rem for s in range(1, pb.S))
            ]
            if not adm:
                ok = False
                break
            rng.shuffle(adm)
            low = [min(visits[v] for v in nodes) for nodes in stages]  # least visits per stage
            adm.sort(key=lambda q: sum(low[s] for s in q))
            route = None
            for seq in adm:
                r = [d]
                for s in seq:
                    r.append(rng.choice([v for v in stages[s] if visits[v] == low[s]]))
                if not hops.would_cycle(r):
                    route = tuple(r)
                    break
            if route is None:
                ok = False
                break
            for v in route[1:]:
                visits[v] += w
                left[pb.stage_of[v]] -= w
            hops.add(route)
            chosen.append(route)
        if ok and all(x == 0 for x in left[1:]):
            routes = _expand(counts, stages[0], slots, chosen, lanes)
            if deadlock_risk(routes, pb.memory) is None:
                return routes
    return None


def _near_replica(pb: _Problem, rng: random.Random, route: Sequence[int], pos: int, stage: int, near: int | None,
                  exclude: int | None = None) -> int:
    """A replica of ``stage`` for position ``pos`` of ``route``: uniformly among the ``near`` ones
    whose hops from the previous node and to the next (the data node after the last position)
    plus their own work cost least (and every replica tied with the last of them), ``exclude``
    left out. With many replicas per stage spread over many locations, a uniformly drawn one is
    almost always far away and the move is wasted."""
    reps = pb.stages[stage]
    if near is None or near >= len(reps):
        pool = [x for x in reps if x != exclude]
        return rng.choice(pool) if pool else reps[0]
    R = pb.R[stage]
    nxt = route[pos + 1] if pos + 1 < len(route) else route[0]
    c = pb.W[route[pos - 1], R] + pb.W[R, nxt] + pb.work[R]
    if exclude is not None:
        c = np.where(R == exclude, np.inf, c)
    cut = np.partition(c, near - 1)[near - 1]
    pool = R[c <= cut] if math.isfinite(cut) else R[np.isfinite(c)]  # ties with the last one count: equals stay in reach
    return int(pool[rng.randrange(len(pool))]) if len(pool) else int(R[0])


def _local_search(
    pb: _Problem,
    cur: Routes,
    cur_obj: tuple[float, float],
    iterations: int,
    rng: random.Random,
    deadline: float,
    temperature: float = 0.0,
    *,
    snapshots: list | None = None,
    keep_snapshots: int = 0,
    near_replicas: int | None = None,
    interferer_share: float = 0.0,
    task_budget: int | None = None,
    component_steps: int = 0,
    step_floor_tasks: int = 300,
    component_share: float = 0.5,
) -> tuple[int, bool, int]:
    """Simulation-guided local search, in place on ``cur``. Returns (iterations done, budget hit,
    the step cap it ran under: ``iterations``, or ``component_steps`` when it simulated components).

    Accepts a move when the simulated iteration time does not get worse and the sum of data-node
    finish times does not either (the second term lets non-critical data nodes improve, which
    frees the nodes the critical one needs). With ``temperature > 0`` a worse move is also
    accepted with probability ``exp(-increase / T)``, ``T`` falling linearly from
    ``temperature x`` the starting time to 0 (simulated annealing); the best schedule seen is
    what ``cur`` holds at the end. ``snapshots`` receives copies of the ``keep_snapshots`` best
    schedules the search held before its final one (the newest last). ``near_replicas``: a move
    that picks a replica picks among the ones nearest the route (:func:`_near_replica`); None: any.
    ``interferer_share``: fraction of the steps that move another data node's microbatch off a
    replica the critical data node uses (queueing there is what keeps it late).

    ``task_budget``: when given, and no component of replica sharing (:mod:`scheduler.components`)
    holds more than ``component_share`` of the data nodes (half: beyond that a step saves too
    little to be worth the bookkeeping), a step simulates only the component its change can
    affect, and the search runs up to ``component_steps`` steps until the tasks it simulated reach
    ``task_budget`` (the same work budget the full simulations spend), each step counting at least
    ``step_floor_tasks`` for its own bookkeeping (so that a step that simulates nothing still
    costs; 300: on the 1,000-node geo setting, with the allocation before its proportional start,
    50, 100, 150 and 300 all end at 63.64 s, 300 in
    2,655 steps against 3,691 at 150, which keeps that plan under 10 s on 2 cores). Only without shared links
    (``pb.link_busy_s`` None): the simulator checks a busy matrix, O(nodes^2), on every call.
    """
    cost, memory = pb.cost, pb.memory
    mbs = [(d, i) for d in sorted(cur) for i in range(len(cur[d]))]
    if not mbs:
        return 0, False, iterations
    critical = _critical(cur, cost, memory, pb.link_busy_s)
    n_swapping = sum(pb.has_swap(r) for d in cur for r in cur[d])
    multi = [s for s in range(1, pb.S) if len(pb.stages[s]) > 1]
    best_obj, best = cur_obj, {d: list(rs) for d, rs in cur.items()}
    t_start = temperature * cur_obj[0]

    def finish(done: int, hit: bool) -> tuple[int, bool, int]:
        for d in cur:
            cur[d][:] = best[d]
        return done, hit, iterations

    # components: simulate only the data nodes a change can affect (see scheduler.components), when
    # the routes share replicas little enough for that to pay; then the work budget is in tasks
    sharing = None
    if task_budget is not None and len(cur) > 1 and pb.link_busy_s is None:
        sh = Sharing(cur)
        if sh.largest(cur) <= component_share * len(cur):
            sharing = sh
            iterations = component_steps
            res0 = simulate_routes(cur, cost, memory, link_busy_s=pb.link_busy_s)
            fin = dict(res0.finish_s)
    tasks_per_mb = 2 * pb.L + 1
    tasks_used = 0
    done = 0
    for done in range(1, iterations + 1):
        if time.perf_counter() > deadline:
            return finish(done - 1, True)
        if sharing is not None:
            if tasks_used >= task_budget:
                return finish(done - 1, False)
            tasks_used += step_floor_tasks
        # pick a microbatch, half the time one of the data node that finishes last, and
        # sometimes one that shares a replica with it (to move it away from that replica)
        forced_pos = 0
        pick = rng.random()
        if pick < 0.5 and cur[critical]:
            d1, i1 = critical, rng.randrange(len(cur[critical]))
        elif pick < 0.5 + interferer_share and cur[critical] and pb.L > 1:
            rc = cur[critical][rng.randrange(len(cur[critical]))]
            v0 = rc[rng.randrange(1, pb.L)]
            near_d = cur if sharing is None else [d for d in cur if d in sharing.users.get(v0, ())]
            users = [(d, i, r.index(v0)) for d in near_d if d != critical for i, r in enumerate(cur[d]) if v0 in r[1:]]
            if not users:
                continue
            d1, i1, forced_pos = users[rng.randrange(len(users))]
        else:
            d1, i1 = mbs[rng.randrange(len(mbs))]
        r1 = cur[d1][i1]
        changes: list[tuple[int, int, tuple[int, ...]]] = []
        kind = 0.0 if forced_pos else rng.random()
        if pb.L < 2:
            kind = 0.95
        if kind < 0.4:  # another replica at one position
            if not multi:
                continue
            pos = forced_pos or rng.randrange(1, pb.L)
            s = pb.stage_of[r1[pos]]
            if len(pb.stages[s]) < 2:
                continue
            v = _near_replica(pb, rng, r1, pos, s, near_replicas, exclude=r1[pos])
            changes.append((d1, i1, r1[:pos] + (v,) + r1[pos + 1 :]))
        elif kind < 0.7:  # exchange a stage with another microbatch (keeps stage loads)
            d2, i2 = mbs[rng.randrange(len(mbs))]
            r2 = cur[d2][i2]
            s1 = [pb.stage_of[v] for v in r1[1:]]
            s2 = [pb.stage_of[v] for v in r2[1:]]
            only1 = [p for p, s in enumerate(s1) if s not in s2]
            only2 = [p for p, s in enumerate(s2) if s not in s1]
            if not only1 or not only2:
                continue
            p1, p2 = rng.choice(only1), rng.choice(only2)
            n1 = list(s1)
            n2 = list(s2)
            n1[p1], n2[p2] = s2[p2], s1[p1]
            if tuple(n1) not in pb.seq_set or tuple(n2) not in pb.seq_set:
                continue
            new1 = r1[: p1 + 1] + (r2[p2 + 1],) + r1[p1 + 2 :]
            new2 = r2[: p2 + 1] + (r1[p1 + 1],) + r2[p2 + 2 :]
            v1 = _near_replica(pb, rng, new1, p1 + 1, s2[p2], near_replicas)
            v2 = _near_replica(pb, rng, new2, p2 + 1, s1[p1], near_replicas)
            changes.append((d1, i1, new1[: p1 + 1] + (v1,) + new1[p1 + 2 :]))
            changes.append((d2, i2, new2[: p2 + 1] + (v2,) + new2[p2 + 2 :]))
        elif kind < 0.85:  # reorder the same stages
            s1 = tuple(pb.stage_of[v] for v in r1[1:])
            alts = [q for q in pb.by_stageset.get(frozenset(s1), []) if q != s1]
            if not alts:
                continue
            q = rng.choice(alts)
            node_of = {pb.stage_of[v]: v for v in r1[1:]}
            changes.append((d1, i1, (r1[0],) + tuple(node_of[s] for s in q)))
        else:  # swap dispatch order within a data node
            if len(cur[d1]) < 2:
                continue
            i2 = rng.randrange(len(cur[d1]))
            if cur[d1][i2] == r1:
                continue
            changes.append((d1, i1, cur[d1][i2]))
            changes.append((d1, i2, r1))
        if len(changes) == 2 and changes[0][:2] == changes[1][:2]:
            continue
        old = [(d, i, cur[d][i]) for d, i, _ in changes]
        if sharing is not None:
            seeds = {d for d, _, _ in changes}
            before = sharing.component(cur, seeds)
            for d, i, r in old:
                sharing.remove(d, r)
        for d, i, r in changes:
            cur[d][i] = r
        new_swapping = n_swapping + sum(pb.has_swap(r) for _, _, r in changes) - sum(pb.has_swap(r) for _, _, r in old)
        if sharing is not None:
            for d, i, r in changes:
                sharing.add(d, r)
            part = sharing.component(cur, before)
            sub = {d: cur[d] for d in sorted(part)}
            # a new hop cycle can only run through a changed route, so inside this component
            ok = new_swapping == 0 or deadlock_risk(sub, memory) is None
        else:
            ok = new_swapping == 0 or deadlock_risk(cur, memory) is None
        if ok:
            if sharing is not None:
                tasks_used += tasks_per_mb * sum(len(rs) for rs in sub.values())
                res = simulate_routes(sub, cost, memory, link_busy_s=pb.link_busy_s)
                new_fin = dict(fin)
                new_fin.update(res.finish_s)
                obj = (max(new_fin.values()), sum(new_fin.values()))
            else:
                res = simulate_routes(cur, cost, memory, link_busy_s=pb.link_busy_s)
                obj = (res.iteration_time_s, sum(res.finish_s.values()))
            accept = obj[0] <= cur_obj[0] + 1e-9 and (obj[0] < cur_obj[0] - 1e-9 or obj[1] <= cur_obj[1] + 1e-9)
            if not accept and t_start > 0 and math.isfinite(obj[0]):
                T = t_start * (1.0 - done / iterations)
                accept = T > 0 and rng.random() < math.exp(-(obj[0] - cur_obj[0]) / T)
            if accept:
                cur_obj = obj
                n_swapping = new_swapping
                if sharing is not None:
                    fin = new_fin
                    critical = max(fin, key=lambda d: (fin[d], -d))
                else:
                    critical = max(res.finish_s, key=lambda d: (res.finish_s[d], -d))
                if obj < best_obj:
                    if snapshots is not None and keep_snapshots > 0:
                        snapshots.append(best)
                        del snapshots[:-keep_snapshots]
                    best_obj = obj
                    best = {d: list(rs) for d, rs in cur.items()}
                continue
        if sharing is not None:
            for d, i, r in changes:
                sharing.remove(d, r)
            for d, i, r in old:
                sharing.add(d, r)
        for d, i, r in old:
            cur[d][i] = r
    return finish(done, False)
