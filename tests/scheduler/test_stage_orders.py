"""Stage-order scoring on replica classes against a brute force over every replica choice."""

import itertools

import numpy as np

from scheduler.paths import _Problem
from scheduler.routes import RouteLimits

from .conftest import uniform_cost


def _fold(d, route, W, nw):
    """A route's cost added up left to right, as the layered programme adds it."""
    c = W[d, route[0]] + nw[route[0]]
    for x, y in zip(route, route[1:]):
        c = c + W[x, y] + nw[y]
    return c + W[route[-1], d]


def test_every_order_costs_what_the_cheapest_replica_choice_costs(geo_profile):
    from scheduler.cost import build_cost, nodes_round_robin

    # node i in location i mod 12; stage k holds nodes k, k+4, ...: 4 tied replicas in each of 3 locations
    cost = build_cost(nodes_round_robin(geo_profile, 48), geo_profile)
    stages = tuple(tuple(range(k, 48, 4)) for k in range(4))
    pb = _Problem(stages, cost, 4, 3, RouteLimits(), 20000)
    assert all(len(pb.orders.start[s]) == 3 for s in (1, 2, 3))
    rng = np.random.default_rng(0)
    for trial in range(4):
        nw = pb.work * (1.0 + rng.integers(0, 3, 48))
        if trial % 2:
            nw[rng.random(48) < 0.3] = np.inf
        for d in stages[0][:2]:
            costs = pb.orders.costs(d, nw)
            for seq, c in zip(pb.seqs, costs):
                brute = min(_fold(d, r, pb.W, nw) for r in itertools.product(*(stages[s] for s in seq)))
                assert c == brute
                got, route = pb.orders.best_route(d, seq, nw)
                assert got == brute
                if np.isfinite(brute):
                    assert _fold(d, route[1:], pb.W, nw) == brute
                    assert [pb.stage_of[v] for v in route[1:]] == list(seq)


def test_equal_costs_go_to_the_first_replica_of_each_stage():
    pb = _Problem(((0,), (1, 2, 3), (4, 5, 6), (7, 8, 9)), uniform_cost(10, 1.0, 1.0), 4, 3, RouteLimits(), 20000)
    nw = np.asarray(pb.work, dtype=float)
    assert pb.orders.best_route(0, (1, 2, 3), nw) == (3 * 2.5 + 4 * 2.0, (0, 1, 4, 7))  # work 1 + 1.5 a replica, hops 1 s each way
    nw[1] = nw[4] = np.inf  # unusable replicas are passed over
    assert pb.orders.best_route(0, (1, 2, 3), nw)[1] == (0, 2, 5, 7)
