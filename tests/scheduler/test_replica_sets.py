"""Replica sets of their own per data node, the exchanges that repair them, and the components
of replica sharing that let the local search simulate a few data nodes instead of all."""

from __future__ import annotations

import random

import numpy as np

from scheduler.components import Sharing
from scheduler.cost import CostMatrix
from scheduler.paths import _Problem, iteration_budget, normalise_request, replica_set_routes, search_paths
from scheduler.replica_sets import improve_sets, round_trip_s
from scheduler.routes import RouteLimits, allowed_sequences
from scheduler.simulator import simulate_routes
from scheduler.validate import validate_schedule

from .conftest import uniform_cost


def _three_locations() -> tuple[CostMatrix, tuple[tuple[int, ...], ...]]:
    """Locations A (data nodes 1, 2; replica 3), B (data node 0; replica 4), C (replica 5); A-B
    and B-C are near, A-C far. Data node 0 comes first, so a greedy in stage order gives B's
    replica to it, and A's second data node has only C's replica left."""
    where = {0: "B", 1: "A", 2: "A", 3: "A", 4: "B", 5: "C"}
    far = {frozenset("AB"): 1.0, frozenset("BC"): 1.0, frozenset("AC"): 10.0}
    link = tuple(tuple(0.0 if u == v else (0.1 if where[u] == where[v] else far[frozenset(where[u] + where[v])])
                       for v in range(6)) for u in range(6))
    return CostMatrix((1.0,) * 6, link), ((0, 1, 2), (3, 4, 5))


def test_exchanges_send_the_data_node_that_can_go_near_abroad_not_the_far_one():
    cost, stages = _three_locations()
    st, counts = normalise_request(stages, cost, 2, 4, 2)
    pb = _Problem(st, cost, 2, 2, RouteLimits(), 20000)
    routes = replica_set_routes(pb, counts, seed=0)
    # each data node on a replica of its own, and nobody crossing the far A-C link
    assert sorted(rs[0][1] for rs in routes.values()) == [3, 4, 5]
    assert all(len(set(rs)) == 1 for rs in routes.values())
    assert routes[0][0] == (0, 5) and {routes[1][0][1], routes[2][0][1]} == {3, 4}
    # without the exchanges the greedy leaves data node 2 on C's replica (the A-C link both ways)
    greedy = replica_set_routes(pb, counts, seed=0, exchange_moves_per_unit=0)
    assert greedy[2][0] == (2, 5)


def _random_problem(rng: random.Random, n_data=6, per_stage=4, stages=4):
    n = n_data + per_stage * (stages - 1)
    loc = [rng.randrange(3) for _ in range(n)]
    hop = [[0.0, 0.5, 3.0], [0.5, 0.0, 2.0], [3.0, 2.0, 0.0]]
    link = tuple(tuple(0.0 if u == v else 0.1 + hop[loc[u]][loc[v]] for v in range(n)) for u in range(n))
    cost = CostMatrix(tuple(rng.choice([1.0, 1.5]) for _ in range(n)), link)
    st = [tuple(range(n_data))] + [tuple(range(n_data + k * per_stage, n_data + (k + 1) * per_stage))
                                   for k in range(stages - 1)]
    return cost, tuple(st)


def test_exchanges_keep_every_replicas_visits_and_never_lengthen_the_longest_round_trip():
    rng = random.Random(3)
    for _ in range(20):
        cost, stages = _random_problem(rng)
        L = 3
        seqs = set(allowed_sequences(len(stages), L, RouteLimits(), 1000))
        W = np.asarray(cost.link_s) + np.asarray(cost.link_s).T
        work = np.asarray(cost.compute_s) * (1 + cost.backward_ratio)
        own = np.asarray(cost.compute_s) * (1 + cost.backward_ratio + cost.loss_ratio)
        stage_of = {v: s for s, nodes in enumerate(stages) for v in nodes}
        units = [(d, 2) for d in stages[0]]
        routes = []
        for d in stages[0]:
            q = rng.choice(sorted(seqs))
            routes.append((d,) + tuple(rng.choice(stages[s]) for s in q))
        out = improve_sets(units, routes, W, work, own, stage_of, seqs, 200, random.Random(0))
        visits = lambda rs: sorted(v for r in rs for v in r[1:])  # noqa: E731
        assert visits(out) == visits(routes)
        assert [r[0] for r in out] == [r[0] for r in routes]
        assert all(tuple(stage_of[v] for v in r[1:]) in seqs for r in out)
        rt = lambda rs: max(round_trip_s(r, W, work, own[r[0]]) for r in rs)  # noqa: E731
        assert rt(out) <= rt(routes) + 1e-9


def test_a_component_simulated_alone_finishes_as_in_the_whole_iteration():
    """The local search simulates only the data nodes that share replicas with a changed route,
    transitively; each must get the finish time the whole simulation gives it."""
    rng = random.Random(11)
    checked_shared = 0
    for trial in range(30):
        cost = uniform_cost(20, 1.0, 1.0) if trial % 2 else CostMatrix(
            tuple(rng.choice([0.5, 1.0, 2.0]) for _ in range(20)),
            tuple(tuple(0.0 if u == v else rng.choice([0.2, 0.5, 1.0]) for v in range(20)) for u in range(20)))
        routes = {d: [tuple([d] + rng.sample(range(8, 20), 2)) for _ in range(rng.randint(1, 4))] for d in range(8)}
        whole = simulate_routes(routes, cost, 2)
        sharing = Sharing(routes)
        left = set(routes)
        while left:
            comp = sharing.component(routes, [min(left)])
            left -= comp
            checked_shared += len(comp) > 1
            alone = simulate_routes({d: routes[d] for d in sorted(comp)}, cost, 2)
            assert alone.finish_s == {d: whole.finish_s[d] for d in comp}
    assert checked_shared > 0  # some components really hold several data nodes


def test_sharing_follows_route_changes():
    routes = {0: [(0, 5, 6)], 1: [(1, 6, 7)], 2: [(2, 8, 9)]}
    sh = Sharing(routes)
    assert sh.component(routes, [0]) == {0, 1}
    sh.remove(1, routes[1][0])
    routes[1][0] = (1, 8, 7)
    sh.add(1, routes[1][0])
    assert sh.component(routes, [0]) == {0}
    assert sh.component(routes, [1]) == {1, 2}
    assert sh.largest(routes) == 2


def test_a_search_cut_short_by_its_task_budget_starts_from_replica_sets_and_stays_valid():
    """With a task budget far below the steps the problem asks for, the search adds the replica-set
    start and simulates components; the result is valid, and no worse than its start."""
    rng = random.Random(2)  # an instance where the replica-set start is the best one
    cost, stages = _random_problem(rng, n_data=24, per_stage=16, stages=4)  # 4 visits a replica: sets fit
    found = search_paths(stages, cost, 3, 4, 2, seed=0, simulated_task_budget=20_000)
    rep = found.report
    full_steps = iteration_budget(96, 3, simulated_task_budget=20_000)  # whole-iteration simulations
    assert rep.iterations > full_steps  # component steps are cheaper, so more of them fit
    validate_schedule(found.schedule, microbatches_per_data_node={d: 4 for d in stages[0]})
    assert rep.final_time_s <= rep.initial_time_s + 1e-9
    assert simulate_routes(found.schedule.dispatch_order(), cost, 2).iteration_time_s == rep.final_time_s
