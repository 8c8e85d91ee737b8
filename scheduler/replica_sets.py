"""Exchange replicas between data nodes' replica sets to shorten the longest round trip.

:func:`scheduler.paths.replica_set_routes` gives every routing unit (with one lane: all of a data
node's microbatches) a route of its own under even per-node caps. Where replicas are exactly as
many as the units need (the 1:3 ratio of the benchmark's stage sizes with path length 4), a
greedy must give its last units whatever is left, often on another continent, and one such unit
sets the iteration time. :func:`improve_sets` repairs that without simulating: it exchanges
replicas between two units of equal weight (the replicas of one stage, or a replica of a stage
only one of them visits for one of a stage only the other visits) or their whole routes, and
re-orders each changed route to its cheapest allowed stage order. Both units keep their weight
on every stage and every replica keeps its visits, so stage quotas and caps hold. A move is kept
when the longer of the two round trips gets shorter, or stays and their sum of squares falls, so
the longest round trip of all never grows. The work is a fixed number of tried moves; the random
choices come from the caller's seeded generator, so the result is a function of the inputs.
"""

from __future__ import annotations

import itertools
import random
from typing import Mapping, Sequence

import numpy as np

__all__ = ["improve_sets", "round_trip_s"]

#: Seconds by which a round trip must shrink to count as shorter (costs are sums of the same terms; float noise only).
_EPS_S = 1e-9


def round_trip_s(route: Sequence[int], W: np.ndarray, work: np.ndarray, own_s: float) -> float:
    """Isolated round trip of ``route`` (data node first): its data node's own work, every
    replica's forward + backward, every hop of the cycle once each way (``W = link + link.T``)."""
    t = own_s + sum(float(work[v]) for v in route[1:])
    for u, v in zip(route, route[1:] + route[:1]):
        t += float(W[u, v])
    return t if len(route) > 1 else own_s


def improve_sets(
    units: Sequence[tuple[int, int]],
    routes: list[tuple[int, ...]],
    W: np.ndarray,
    work: np.ndarray,
    own: np.ndarray,
    stage_of: Mapping[int, int],
    allowed: set[tuple[int, ...]],
    moves: int,
    rng: random.Random,
    *,
    worst_share: float = 0.2,
    near_share: float = 0.3,
    near: int = 12,
    whole_share: float = 0.3,
    random_whole_share: float = 0.2,
) -> list[tuple[int, ...]]:
    """Improved copy of ``routes`` (one per unit ``(data node, weight)``, in the same order).

    moves: exchanges tried (the work budget). worst_share: fraction of them that start from the
    unit with the longest round trip (the one that sets the iteration time); the others start
    from a random unit, which makes room that the worst one can take later. near_share: fraction
    that pull one of the ``near`` replicas closest to the unit's data node (and every replica tied
    with the last of them) out of the route holding it, swapping one replica, or with probability
    ``whole_share`` the two whole routes; the rest exchange with a random unit. On the 1,000-node
    geo setting (seeds 0-2) ``worst_share`` 0.2 with ``near_share`` 0.3 gave 66.28 s for every
    seed, 0.5 with any ``near_share`` 66.3-77.3 s (the worst unit's moves all fail, and the
    others never make room); ``near`` 12 is a stage's replicas in one location there (12.5);
    ``whole_share`` 0 gave the same, 0.3 lets a data node on a far set take a near one in one move.
    random_whole_share: fraction of the exchanges with a random unit that swap whole routes (the
    rest swap one replica); a fifth, not tuned: the exchanges with a random unit mostly make room.
    """
    out = list(routes)
    n = len(out)
    if n < 2 or moves <= 0:
        return out

    def best_order(d: int, reps: Sequence[int]) -> tuple[float, tuple[int, ...]] | None:
        best = None
        for perm in itertools.permutations(reps):
            if tuple(stage_of[v] for v in perm) not in allowed:
                continue
            r = (d,) + tuple(perm)
            t = round_trip_s(r, W, work, float(own[d]))
            if best is None or t < best[0] - _EPS_S:
                best = (t, r)
        return best

    rt = np.asarray([round_trip_s(r, W, work, float(own[d])) for r, (d, _) in zip(out, units)])
    by_weight: dict[int, list[int]] = {}
    for i, (_, w) in enumerate(units):
        by_weight.setdefault(w, []).append(i)
    holders: dict[int, list[int]] = {}  # replica -> the units whose route visits it
    for i, r in enumerate(out):
        for v in r[1:]:
            holders.setdefault(v, []).append(i)
    by_stage: dict[int, np.ndarray] = {}
    for v in holders:
        by_stage.setdefault(stage_of[v], []).append(v)
    by_stage = {s: np.asarray(sorted(vs), dtype=int) for s, vs in by_stage.items()}
    stages = sorted(by_stage)
    for _ in range(moves):
        a = int(rt.argmax()) if rng.random() < worst_share else rng.randrange(n)
        ra = out[a][1:]
        targeted = rng.random() < near_share
        if targeted:  # pull one of the replicas nearest a's data node into its route
            s = stages[rng.randrange(len(stages))]
            reps = by_stage[s]
            da = units[a][0]
            hop = W[da, reps]
            cut = np.partition(hop, min(near, len(reps)) - 1)[min(near, len(reps)) - 1]
            near_reps = reps[hop <= cut]  # ties with the last one count: a location's replicas stay together
            v = int(near_reps[rng.randrange(len(near_reps))])
            b = holders[v][rng.randrange(len(holders[v]))]
            if b == a or units[b][1] != units[a][1]:
                continue
            rb = out[b][1:]
            sa = {stage_of[x]: x for x in ra}
            sb = {stage_of[x]: x for x in rb}
            if rng.random() < whole_share:  # take the holder's whole route, give it ours
                na, nb = rb, ra
            else:
                if s in sa:
                    t = s
                else:
                    give = [x for x in sa if x not in sb]
                    if not give:
                        continue
                    t = rng.choice(give)
                if sa[t] == v:
                    continue
                na = tuple(v if x == sa[t] else x for x in ra)
                nb = tuple(sa[t] if x == v else x for x in rb)
        else:
            peers = by_weight[units[a][1]]
            if len(peers) < 2:
                continue
            b = peers[rng.randrange(len(peers))]
            if b == a:
                continue
            rb = out[b][1:]
        if targeted:
            pass
        elif rng.random() < random_whole_share:  # whole routes
            na, nb = rb, ra
        else:
            sa = {stage_of[v]: v for v in ra}
            sb = {stage_of[v]: v for v in rb}
            s = rng.choice(list(sa))
            if s in sb:
                t = s
            else:
                only_b = [x for x in sb if x not in sa]
                if not only_b:
                    continue
                t = rng.choice(only_b)
            na = tuple(sb[t] if v == sa[s] else v for v in ra)
            nb = tuple(sa[s] if v == sb[t] else v for v in rb)
        da, db = units[a][0], units[b][0]
        ga, gb = best_order(da, na), best_order(db, nb)
        if ga is None or gb is None:
            continue
        old = (max(rt[a], rt[b]), rt[a] ** 2 + rt[b] ** 2)
        new = (max(ga[0], gb[0]), ga[0] ** 2 + gb[0] ** 2)
        if new[0] < old[0] - _EPS_S or (new[0] <= old[0] + _EPS_S and new[1] < old[1] - _EPS_S):
            for i, g in ((a, ga), (b, gb)):
                for v in out[i][1:]:
                    holders[v].remove(i)
                for v in g[1][1:]:
                    holders[v].append(i)
                out[i], rt[i] = g[1], g[0]
    return out

