"""Lower bounds on the simulated iteration time of any valid schedule of a problem.

A *problem* is what :func:`scheduler.paths.schedule_paths` is given: the stages (stage 0 = data
nodes), the cost matrix, the path length ``L``, the microbatches per data node, the memory and
the route limits. :func:`iteration_lower_bound` returns a time that no valid schedule of that
problem can beat in :func:`scheduler.simulator.simulate` (with or without ``link_busy_s`` and
``task_gap_s``: both only delay tasks). It is the maximum of three arguments, each a relaxation
of the simulator's rules:

1. **Memory-slot round trips** (per data node ``d`` with ``c`` microbatches). A microbatch holds
   one of ``d``'s ``memory`` slots from its forward at ``d`` to its backward at ``d``: at least
   ``RT(d)``, the cheapest allowed round trip (forward and backward compute on the route, loss,
   every hop crossed once each way). At most ``memory`` such intervals overlap, so they form
   ``w <= min(memory, c)`` chains of back-to-back intervals; one chain holds ``ceil(c / w)``
   of them: ``T >= ceil(c / w) x RT(d)``. Moreover the chains start with forwards at ``d``,
   which run one at a time (the ``i``-th start is ``>= i x forward``), and end with backwards
   at ``d``, likewise (the ``i``-th last end is ``<= T - i x backward``); summing the chains,
   ``w x T >= c x RT(d) + (forward + backward) x w (w - 1) / 2``. The bound is the smaller, over
   ``w``, of the larger of the two.

   **Waves** refine this where ``c > memory``: ``d`` is one machine, and a new microbatch can only
   start once an old one's backward at ``d`` has run. Number ``d``'s microbatches by forward start
   ``s_1 <= ... <= s_c`` (``m = memory``, ``f``, ``b``, ``l``: forward, backward, loss at ``d``).
   (a) Forwards run one at a time: ``s_j >= s_{j-1} + f``. (b) Each microbatch's backward at ``d``
   ends at least ``RT(d)`` after its forward starts, so the ``i``-th earliest backward end is
   ``e_i >= s_i + RT(d)`` (the ``i`` earliest ends belong to ``i`` distinct microbatches, the
   ``i``-th of which started no earlier than ``s_i``). (c) Forward ``j > m`` needs a free slot, so
   ``j - m`` backwards have ended by ``s_j``: ``s_j >= e_{j-m}``. Now take ``i <= j - m`` and the
   window ``[s_i + RT(d) - b, s_j)``. At most ``i - 1`` of the ``j - m`` backwards ended by ``s_j``
   belong to microbatches started before ``s_i``; the others, ``j - m - i + 1`` of them, start
   no earlier than ``s_i + RT(d) - b`` (by (b)), so lie in the window. Each forward ``x`` with
   ``i + m <= x < j`` starts at ``s_x >= e_{x-m}``; among the ``x - m`` earliest ends at least one
   belongs to a microbatch started at or after ``s_i``, so ``s_x >= s_i + RT(d)``: the window
   holds those ``j - m - i`` forwards too. ``d`` runs one task at a time, hence
   ``s_j >= s_i + RT(d) + (j - m - i) x (b + f)``. Lower bounds ``lb_j`` on ``s_j`` follow by
   recursion from ``lb_1 = 0`` (with (a)), and ``T >= lb_c + RT(d)``. The same window ending at
   ``T`` instead holds every backward of the microbatches ``x >= i`` and the forward and loss of
   every ``x >= i + m``: ``T >= lb_i + RT(d) - b + (c - i + 1) b + max(0, c - i - m + 1)(f + l)``.
   The argument takes the largest of the chain and wave values.
2. **Data-node work** (per data node). ``d`` computes ``c x (forward + loss + backward)``. Before
   its first loss it can only run forwards, at most ``k = min(memory, c)`` of them (no slot is
   freed before a backward), and the first loss cannot start before ``A(d)``, the cheapest
   forward half of a route (forwards and hops out and back home); after its last loss it can
   only run the ``<= k`` backwards still in flight, and the last one cannot end before
   ``Bc(d) + backward``, the cheapest backward chain home. So
   ``T >= c x work + max(0, A(d) - k x forward) + max(0, Bc(d) + backward - k x backward)``.
3. **Stage work** (per non-zero stage ``s``). Every valid schedule gives ``s`` at least
   ``q = floor((L - 1) x total / (S - 1))`` visits (stage balance, +-1). A visit costs replica
   ``v`` its forward + backward ``w_v``; all of ``v``'s tasks lie between ``h_v`` (the fastest
   forward of a data node with microbatches plus the fastest hop into ``v``) and ``T - t_v`` (the fastest hop out of
   ``v`` plus the fastest data-node backward). The best spread of ``q`` visits over the
   replicas ends no earlier than the ``q``-th smallest of ``h_v + t_v + j x w_v`` (``j >= 1``),
   which is therefore a bound.

``RT``, ``A`` and ``Bc`` are exact minima over every stage order the limits allow (a layered
shortest cycle per order, as in the construction of :mod:`scheduler.paths`). If the orders are
too many to enumerate (more than ``max_sequences``) they are relaxed to closed walks of ``L - 1``
hops over any non-zero-stage nodes, which is still a lower bound.

The bound is tight when one argument describes the whole schedule: one microbatch on one route
(``RT``), or a single data node doing all the work (path length 1). It ignores collisions
between data nodes and the stage orders' effect on pipelining, so on the 20-node geo setting it
sits some way below the best schedule found (see ``docs/scheduler.md``).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from scheduler.cost import CostMatrix
from scheduler.routes import RouteLimits, allowed_sequences

__all__ = ["LowerBound", "iteration_lower_bound", "min_cycles"]

#: Largest ``data nodes x replicas x replicas`` block one min-plus step materialises (floats);
#: 4M floats = 32 MB, so the bound stays cheap in memory at 1,000 nodes.
_BLOCK = 4_000_000


@dataclass(frozen=True)
class LowerBound:
    """value_s: the bound. argument: which of the three arguments gives it (``"round-trips"``,
    ``"data-node-work"``, ``"stage-work"``). where: the data node (first two) or stage (third)
    it binds at. detail: one human-readable line. by_argument: the best value of each argument.
    relaxed_orders: the stage orders were relaxed to walks (too many to enumerate)."""

    value_s: float
    argument: str
    where: int
    detail: str
    by_argument: Mapping[str, float] = field(default_factory=dict)
    relaxed_orders: bool = False

    def gap(self, time_s: float) -> float:
        """Relative distance of an iteration time above the bound, ``time / bound - 1``."""
        if self.value_s <= 0:
            return 0.0 if time_s <= 0 else math.inf
        return time_s / self.value_s - 1.0

    def to_json(self) -> dict:
        return {
            "value_s": self.value_s,
            "argument": self.argument,
            "where": self.where,
            "detail": self.detail,
            "by_argument": dict(self.by_argument),
            "relaxed_orders": self.relaxed_orders,
        }


def _min_plus(c: np.ndarray, M: np.ndarray) -> np.ndarray:
    """``out[d, y] = min_x c[d, x] + M[x, y]``, in row blocks of at most ``_BLOCK`` floats."""
    D, X = c.shape
    Y = M.shape[1]
    rows = max(1, _BLOCK // max(1, X * Y))
    out = np.empty((D, Y))
    for i in range(0, D, rows):
        out[i : i + rows] = (c[i : i + rows, :, None] + M[None, :, :]).min(axis=1)
    return out


def min_cycles(
    data_nodes: Sequence[int],
    groups: Sequence[Sequence[int]],
    orders: Sequence[Sequence[int]],
    edge: np.ndarray,
    node_weight: np.ndarray,
) -> np.ndarray:
    """For every data node ``d``, the cheapest cycle ``d -> x_1 -> ... -> x_k -> d`` where
    ``x_i`` is in ``groups[order[i]]`` for some ``order`` in ``orders``: the sum of
    ``edge[u, v]`` over its hops plus ``node_weight[x_i]`` over the ``x_i``. An empty order
    costs 0 (the route ``(d,)``). Exact layered dynamic programme, prefixes shared."""
    D = np.asarray(data_nodes, dtype=int)
    best = np.full(len(D), math.inf)
    memo: dict[tuple[int, ...], np.ndarray] = {}

    def prefix(p: tuple[int, ...]) -> np.ndarray:
        if p in memo:
            return memo[p]
        g = np.asarray(groups[p[-1]], dtype=int)
        if len(p) == 1:
            c = edge[np.ix_(D, g)] + node_weight[g][None, :]
        else:
            prev = np.asarray(groups[p[-2]], dtype=int)
            c = _min_plus(prefix(p[:-1]), edge[np.ix_(prev, g)]) + node_weight[g][None, :]
        memo[p] = c
        return c

    for q in orders:
        q = tuple(q)
        if not q:
            best = np.minimum(best, 0.0)
            continue
        last = np.asarray(groups[q[-1]], dtype=int)
        c = prefix(q) + edge[np.ix_(last, D)].T
        best = np.minimum(best, c.min(axis=1))
    return best


def iteration_lower_bound(
    stages: Sequence[Sequence[int]],
    cost: CostMatrix,
    path_length: int,
    microbatches_per_data_node: Mapping[int, int],
    memory: int,
    *,
    limits: RouteLimits = RouteLimits(),
    max_sequences: int = 20000,
) -> LowerBound:
    """A time no valid schedule of this problem beats in the simulator (module docstring).

    ``microbatches_per_data_node`` maps every data node to its count (as returned by
    :func:`scheduler.paths.normalise_request`). ``max_sequences``: stage orders enumerated
    before falling back to the walk relaxation.
    """
    st = [tuple(int(v) for v in s) for s in stages]
    S = len(st)
    F = np.asarray(cost.compute_s, dtype=float)
    br, lr = cost.backward_ratio, cost.loss_ratio
    link = np.asarray(cost.link_s, dtype=float)
    data = [d for d in st[0] if microbatches_per_data_node.get(d, 0) > 0]
    counts = {d: int(microbatches_per_data_node[d]) for d in data}
    total = sum(counts.values())
    k = path_length - 1

    seqs = allowed_sequences(S, path_length, limits, max_sequences + 1) if k > 0 else [()]
    relaxed = len(seqs) > max_sequences
    if relaxed:
        groups: list[Sequence[int]] = [tuple(v for s in st[1:] for v in s)]
        orders: list[tuple[int, ...]] = [tuple([0] * k)]
        node_link = link.copy()  # a walk may not stay on a node: forbid self-hops
        np.fill_diagonal(node_link, math.inf)
        link_fw, link_rt = node_link, node_link + node_link.T
    else:
        groups, orders = st, [tuple(q) for q in seqs]
        link_fw, link_rt = link, link + link.T

    candidates: list[tuple[float, str, int, str]] = []
    best_of: dict[str, float] = {"round-trips": 0.0, "data-node-work": 0.0, "stage-work": 0.0}
    if data:
        fwd = F  # forward per visit
        bwd = F * br
        rt = min_cycles(data, groups, orders, link_rt, fwd + bwd)
        a = min_cycles(data, groups, orders, link_fw, fwd)
        bc = min_cycles(data, groups, orders, link_fw.T, bwd)
        for i, d in enumerate(data):
            c = counts[d]
            kk = min(memory, c)
            own = F[d] * (1.0 + lr + br)
            rt_d = own + rt[i]
            chains = min(  # over the number w of slot chains the schedule needs
                max(math.ceil(c / w) * rt_d, c * rt_d / w + (F[d] + bwd[d]) * (w - 1) / 2) for w in range(1, kk + 1)
            )
            waves = _wave_bound(c, memory, rt_d, float(F[d]), float(bwd[d]), float(F[d] * lr))
            v1 = max(chains, waves)
            how = "one machine starting a wave only as the last one's backwards end" if waves > chains else "memory slots"
            candidates.append((v1, "round-trips", d,
                               f"data node {d}: {c} microbatches of at least {rt_d:.2f} s (its best round trip) "
                               f"in {memory} memory slots ({how})"))
            idle_head = max(0.0, F[d] + a[i] - kk * F[d])
            idle_tail = max(0.0, bc[i] + bwd[d] - kk * bwd[d])
            v2 = c * own + idle_head + idle_tail
            candidates.append((v2, "data-node-work", d,
                               f"data node {d}: {c} x {own:.2f} s of its own work + {idle_head:.2f} s forced idle "
                               f"before its first loss + {idle_tail:.2f} s after its last"))
    if S > 1 and k > 0 and total > 0:
        q = (k * total) // (S - 1)
        min_F_data = min(float(F[d]) for d in data)  # the data nodes that have microbatches
        min_B_data = min_F_data * br
        for s in range(1, S):
            if q == 0:
                break
            others = np.asarray([v for t, nodes in enumerate(st) if t != s for v in nodes], dtype=int)
            reps = np.asarray(st[s], dtype=int)
            head = min_F_data + link[np.ix_(others, reps)].min(axis=0)
            tail = min_B_data + link[np.ix_(reps, others)].min(axis=1)
            work = F[reps] * (1.0 + br)
            v3 = _qth_smallest_finish(head + tail, work, q)
            candidates.append((v3, "stage-work", s,
                               f"stage {s}: {q} visits of {work.max():.2f} s or less over {len(reps)} replicas, "
                               f"plus the fastest way in and out"))
    if not candidates:
        return LowerBound(0.0, "none", -1, "nothing to schedule", best_of, relaxed)
    for v, arg, _, _ in candidates:
        best_of[arg] = max(best_of[arg], float(v))
    # the largest value; ties to the first argument kind, then the lowest node / stage
    order = {"round-trips": 0, "data-node-work": 1, "stage-work": 2}
    v, arg, where, detail = min(candidates, key=lambda x: (-x[0], order[x[1]], x[2]))
    return LowerBound(float(v), arg, int(where), detail, best_of, relaxed)


def _wave_bound(c: int, m: int, rt: float, f: float, b: float, l: float) -> float:
    """The waves refinement of the round-trip argument (module docstring, argument 1): ``c``
    microbatches of one data node with ``m`` memory slots, best round trip ``rt``, and its own
    forward ``f``, backward ``b`` and loss ``l``. ``lb[j]`` bounds the ``j``-th forward start."""
    if c <= 0:
        return 0.0
    lb = [0.0] * (c + 1)  # 1-based
    for j in range(2, c + 1):
        v = lb[j - 1] + f
        for i in range(1, j - m + 1):
            v = max(v, lb[i] + rt + (j - m - i) * (b + f))
        lb[j] = v
    best = lb[c] + rt
    for i in range(1, c + 1):
        best = max(best, lb[i] + rt - b + (c - i + 1) * b + max(0, c - i - m + 1) * (f + l))
    return best


def _qth_smallest_finish(offset: np.ndarray, work: np.ndarray, q: int) -> float:
    """The ``q``-th smallest of ``offset[v] + j x work[v]`` over replicas ``v`` and ``j >= 1``:
    the earliest time by which ``q`` unit jobs can be finished when replica ``v`` becomes free
    at ``offset[v]`` (here: never earlier than its head plus tail) and takes ``work[v]`` each."""
    zero = [float(o) for o, w in zip(offset, work) if w <= 0]
    if zero:  # a replica with no work takes any number of visits at its offset
        pos = [(float(o), float(w)) for o, w in zip(offset, work) if w > 0]
        return min(min(zero), _qth_smallest_finish(np.asarray([o for o, _ in pos]), np.asarray([w for _, w in pos]), q)) if pos else min(zero)
    heap = [(float(o + w), i) for i, (o, w) in enumerate(zip(offset, work))]
    heapq.heapify(heap)
    t = 0.0
    for _ in range(q):
        t, i = heapq.heappop(heap)
        heapq.heappush(heap, (t + float(work[i]), i))
    return t
