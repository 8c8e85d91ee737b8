"""Node-to-stage allocation: which nodes hold which stage (stage 0 = data nodes).

A genetic search with local refinement in the spirit of GCMA (used by DT-FM and the SkipPipe
reference), with the reference's bugs fixed: it is really seeded, the population has a fixed
size (a child replaces the worst member), and every constant is a parameter.

Score of an allocation (lower is better)::

    pp_weight x PP + dp_weight x DP

* PP, the pipeline cost: for each pair of stages that a route can connect (every pair when
  skipping and reordering, ``skip_aware=True``; consecutive stages and last->0 otherwise), the
  mean edge of a capacity-balanced minimum-cost matching between their replicas, where an edge
  costs the round-trip hop time plus the two nodes' mean forward+backward compute. It is low
  when every replica has a fast, lightly shared partner in every other stage; averaged over the
  stage pairs.
* DP, the data-parallel cost: the slowest link inside any stage (the all-reduce bottleneck).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.optimize import linear_sum_assignment

from scheduler.cost import CostMatrix
from scheduler.errors import ScheduleError

__all__ = ["AllocationResult", "allocate", "allocation_cost", "generation_budget", "matching_cells"]


@dataclass(frozen=True)
class AllocationResult:
    """stages: node ids per stage (sorted). score: its allocation cost. generations: done.
    budget_hit: the wall-clock cap ``budget_s`` stopped the search before ``generation_budget``
    (the generations its work budget allowed)."""

    stages: tuple[tuple[int, ...], ...]
    score: float
    generations: int
    budget_hit: bool
    generation_budget: int = 0


class _Scorer:
    """The allocation score. A pair of stages whose replica groups are unchanged keeps its matching
    (a refinement step swaps two nodes, so most pairs of the next score are ones already scored): the
    ``cache_pairs`` most recently used pair results are kept, keyed by both groups' members, so a
    cached pair gives exactly the number a new matching would. A score has up to 15 pairs at 6
    stages; 64 kept already hold the current individual's and the last trials' (at 1,000 nodes 65%
    of the matchings still run, against 76% with 16 kept and 64% with 4,096); 256 leaves room for
    more stages at a few MB."""

    def __init__(self, cost: CostMatrix, n_stages: int, pp_weight: float, dp_weight: float, skip_aware: bool,
                 cache_pairs: int = 256):
        self.cache_pairs = cache_pairs
        self._pairs: OrderedDict[tuple[bytes, bytes], float] = OrderedDict()
        link = np.asarray(cost.link_s, dtype=float)
        work = np.asarray(cost.compute_s, dtype=float) * (1.0 + cost.backward_ratio)
        self.E = link + link.T + (work[:, None] + work[None, :]) / 2.0
        self.link = link
        self.S = n_stages
        self.pp_weight = pp_weight
        self.dp_weight = dp_weight
        if skip_aware:
            self.pairs = [(a, b) for a in range(n_stages) for b in range(a + 1, n_stages)]
        else:
            self.pairs = [(s, s + 1) for s in range(n_stages - 1)] + ([(n_stages - 1, 0)] if n_stages > 2 else [])

    def _pair(self, ga: np.ndarray, gb: np.ndarray) -> float:
        """Mean edge of the capacity-balanced matching between replica groups ``ga`` and ``gb``."""
        key = (ga.tobytes(), gb.tobytes())
        got = self._pairs.get(key)
        if got is not None:
            self._pairs.move_to_end(key)
            return got
        if len(ga) < len(gb):
            ga, gb = gb, ga
        reps = math.ceil(len(ga) / len(gb))
        sub = self.E[np.ix_(ga, np.tile(gb, reps))]
        r, c = linear_sum_assignment(sub)
        got = self._pairs[key] = float(sub[r, c].mean())
        if len(self._pairs) > self.cache_pairs:
            self._pairs.popitem(last=False)
        return got

    def __call__(self, labels: np.ndarray) -> float:
        groups = [np.flatnonzero(labels == s) for s in range(self.S)]
        pp = 0.0
        for a, b in self.pairs:
            pp += self._pair(groups[a], groups[b])
        pp /= max(1, len(self.pairs))
        dp = 0.0
        if self.dp_weight:
            for g in groups:
                if len(g) > 1:
                    dp = max(dp, float(self.link[np.ix_(g, g)].max()))
        return self.pp_weight * pp + self.dp_weight * dp


def matching_cells(stage_sizes: Sequence[int], skip_aware: bool = True) -> int:
    """Cost-matrix cells the assignments of one allocation score take (the score's work: the
    matchings run in about linear time in the cells at these sizes)."""
    S = len(stage_sizes)
    if skip_aware:
        pairs = [(a, b) for a in range(S) for b in range(a + 1, S)]
    else:
        pairs = [(s, s + 1) for s in range(S - 1)] + ([(S - 1, 0)] if S > 2 else [])
    cells = 0
    for a, b in pairs:
        big, small = max(stage_sizes[a], stage_sizes[b]), min(stage_sizes[a], stage_sizes[b])
        cells += big * small * math.ceil(big / small)
    return cells


def generation_budget(
    stage_sizes: Sequence[int],
    generations: int = 120,
    refine_trials: int = 12,
    *,
    cell_budget: int = 250_000_000,
    min_generations: int = 10,
    skip_aware: bool = True,
) -> int:
    """Generations of :func:`allocate` for these stage sizes: ``generations`` (where the
    20-node search levels off), but at most ``cell_budget`` matching cells scored in all (each
    generation scores ``1 + refine_trials`` allocations; 250M cells is about 8 s on one core,
    reached from about 500 nodes on), but not fewer than ``min_generations`` for that. The work
    budget that bounds the search, so that a seed gives the same allocation on any machine."""
    per_generation = max(1, (1 + refine_trials) * matching_cells(stage_sizes, skip_aware))
    return min(generations, max(min_generations, cell_budget // per_generation))


def allocation_cost(
    stages: Sequence[Sequence[int]],
    cost: CostMatrix,
    *,
    pp_weight: float = 1.0,
    dp_weight: float = 0.5,
    skip_aware: bool = True,
) -> float:
    """The score :func:`allocate` minimises, for a given allocation (see module docstring)."""
    labels = np.full(cost.n_nodes, len(stages))
    for s, nodes in enumerate(stages):
        labels[list(nodes)] = s
    return _Scorer(cost, len(stages), pp_weight, dp_weight, skip_aware)(labels)


def allocate(
    cost: CostMatrix,
    stage_sizes: Sequence[int],
    seed: int = 0,
    budget_s: float = 60.0,
    *,
    population: int = 16,
    generations: int = 120,
    cell_budget: int = 250_000_000,
    min_generations: int = 10,
    crossover_points: int = 5,
    refine_trials: int = 12,
    pp_weight: float = 1.0,
    dp_weight: float = 0.5,
    skip_aware: bool = True,
    proportional_start: bool = True,
) -> AllocationResult:
    """Assign ``sum(stage_sizes)`` of the ``cost.n_nodes`` nodes to stages.

    population: individuals kept (random allocations at the start).
    generations: children bred at most; each is two parents' crossover (``crossover_points``
        node labels of one parent copied into the other, then stage sizes repaired) plus
        ``refine_trials`` random node swaps between stages kept when they lower the score
        (local refinement). Large allocations get fewer (:func:`generation_budget` with
        ``cell_budget`` and ``min_generations``): the search is bounded by work.
    pp_weight, dp_weight: the reference scores DP + 2 PP, i.e. dp_weight / pp_weight = 0.5.
    budget_s: wall-clock safety cap. Not reached, the result depends only on the inputs and
        ``seed``; reached, the search stops early and ``budget_hit`` says so.
    Extra nodes (more than the stages need) are left out, chosen by the search too.
    proportional_start: where every location has at least as many nodes as there are stages,
        one of the starting individuals is :func:`_proportional` (every location holds every
        stage in proportion to its size) instead of a random one. The random starts' imbalance
        stays: on the 1,000-node geo setting (32 generations) one location had 33 data nodes and
        50 replicas, another 13 and 70, and its data nodes had to borrow replicas on other
        continents; the start gives a lower score there (71.41 -> 71.30) and at 200 nodes
        (71.42 -> 71.37). Where locations are smaller than that (20 nodes over 12 locations) a
        proportional deal is an arbitrary allocation, and taking the place of a random start it
        made the 20-node result worse (score 8.18 -> 8.27).
    """
    sizes = [int(x) for x in stage_sizes]
    if not sizes or any(x < 1 for x in sizes):
        raise ScheduleError("stage-sizes", f"every stage needs at least one node, got {sizes}")
    need, n = sum(sizes), cost.n_nodes
    if need > n:
        raise ScheduleError("nodes", f"stage sizes {sizes} need {need} nodes but there are only {n}")
    t0 = time.perf_counter()
    S = len(sizes)
    rng = np.random.default_rng(seed)
    score = _Scorer(cost, S, pp_weight, dp_weight, skip_aware)
    template = np.concatenate([np.full(k, s) for s, k in enumerate(sizes)] + [np.full(n - need, S)]).astype(int)
    if S == 1:
        labels = template.copy()
        stages = (tuple(int(v) for v in np.flatnonzero(labels == 0)),)
        return AllocationResult(stages, 0.0, 0, False, 0)
    want = np.bincount(template, minlength=S + 1)

    def refine(x: np.ndarray, fx: float) -> tuple[np.ndarray, float]:
        for _ in range(refine_trials):
            u, v = rng.integers(n, size=2)
            if x[u] == x[v]:
                continue
            x[u], x[v] = x[v], x[u]
            fy = score(x)
            if fy < fx:
                fx = fy
            else:
                x[u], x[v] = x[v], x[u]
        return x, fx

    pop = []
    for _ in range(max(2, population)):
        x = rng.permutation(template)
        pop.append((score(x), x))
    budget = generation_budget(sizes, generations, refine_trials, cell_budget=cell_budget,
                               min_generations=min_generations, skip_aware=skip_aware)
    x = _proportional(cost, template, S) if proportional_start else None
    if x is not None:
        pop[0] = (score(x), x)
    done, hit = 0, False
    for done in range(1, budget + 1):
        if time.perf_counter() - t0 > budget_s:
            hit, done = True, done - 1
            break
        i, j = rng.choice(len(pop), size=2, replace=False)
        child = pop[j][1].copy()
        pos = rng.choice(n, size=min(crossover_points, n), replace=False)
        child[pos] = pop[i][1][pos]
        counts = np.bincount(child, minlength=S + 1)
        for s in range(S + 1):  # repair stage sizes
            while counts[s] > want[s]:
                members = np.flatnonzero(child == s)
                u = members[rng.integers(len(members))]
                short = np.flatnonzero(counts < want)
                t = short[rng.integers(len(short))]
                child[u] = t
                counts[s] -= 1
                counts[t] += 1
        child, fc = refine(child, score(child))
        worst = max(range(len(pop)), key=lambda k: pop[k][0])
        if fc < pop[worst][0] and not any(np.array_equal(child, x) for _, x in pop):
            pop[worst] = (fc, child)
    best_f, best = min(pop, key=lambda p: p[0])
    stages = tuple(tuple(int(v) for v in np.flatnonzero(best == s)) for s in range(S))
    return AllocationResult(stages, best_f, done, hit, budget)


def _proportional(cost: CostMatrix, template: np.ndarray, n_stages: int) -> np.ndarray | None:
    """Labels giving each location (nodes whose link times to every other node are equal: with
    profile costs, the nodes of one location) every label of ``template`` in proportion to its
    count: the nodes, ordered location by location, are dealt the label furthest behind its share
    so far (then the lower label). None where some location has fewer nodes than ``n_stages``."""
    link = np.array(cost.link_s, dtype=float)
    off = link + np.diag(np.full(len(link), np.inf))
    np.fill_diagonal(link, off.min(axis=1))  # a node's own entry as its nearest link: equal rows per location
    compute = np.asarray(cost.compute_s, dtype=float)
    _, location, size = np.unique(np.c_[link, compute], axis=0, return_inverse=True, return_counts=True)
    if size.min() < n_stages:
        return None
    order = np.lexsort((np.arange(len(link)), np.asarray(location).reshape(-1)))
    counts = np.bincount(template)
    given = np.zeros(len(counts))
    n = len(template)
    out = np.empty(n, dtype=int)
    for k, v in enumerate(order):
        label = int(np.argmax((k + 1) * counts / n - given))  # ties: the lowest label
        given[label] += 1
        out[v] = label
    return out
