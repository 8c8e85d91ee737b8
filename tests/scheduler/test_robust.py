"""Judging plans under cost-model error (scheduler/robust.py) and the search's use of it."""

from __future__ import annotations

import pytest

from scheduler.cost import CostMatrix
from scheduler.paths import search_paths
from scheduler.robust import RobustConfig, cost_scenarios, most_robust, predicted_spread
from scheduler.simulator import simulate_routes


def _cost(n: int, seed: int = 3) -> CostMatrix:
    import random

    rng = random.Random(seed)
    compute = [rng.uniform(0.5, 2.0) for _ in range(n)]
    link = [[0.0 if u == v else rng.uniform(0.05, 1.5) for v in range(n)] for u in range(n)]
    return CostMatrix(tuple(compute), tuple(map(tuple, link)))


STAGES = ((0, 1), (2, 3), (4, 5), (6, 7))


def test_scenarios_are_deterministic_and_keep_busy_within_link():
    cost = _cost(8)
    busy = [[0.5 * x for x in row] for row in cost.link_s]
    a = cost_scenarios(cost, busy, RobustConfig(samples=4), seed=7)
    b = cost_scenarios(cost, busy, RobustConfig(samples=4), seed=7)
    c = cost_scenarios(cost, busy, RobustConfig(samples=4), seed=8)
    assert len(a) == 5 and a[0].cost is cost
    assert [s.cost.compute_s for s in a] == [s.cost.compute_s for s in b]
    assert [s.cost.compute_s for s in a[1:]] != [s.cost.compute_s for s in c[1:]]
    for s in a[1:]:
        assert s.cost.compute_s != cost.compute_s
        for u in range(8):
            for v in range(8):
                assert 0.0 <= s.link_busy_s[u][v] <= s.cost.link_s[u][v] + 1e-12


def test_spread_brackets_the_scenarios():
    cost = _cost(8)
    found = search_paths(STAGES, cost, 3, 4, 2, seed=0, robust=None)
    routes = {}
    for e in found.schedule.paths:
        routes.setdefault(e.data_node, []).extend([e.route] * e.microbatches)
    scen = cost_scenarios(cost, None, RobustConfig(samples=6), seed=1)
    sp = predicted_spread(routes, cost, 2, scen)
    times = sorted(simulate_routes(routes, s.cost, 2).iteration_time_s for s in scen)
    assert sp.nominal_s == pytest.approx(simulate_routes(routes, cost, 2).iteration_time_s)
    assert sp.scenarios == 7
    assert times[0] <= sp.p10_s <= sp.mean_s * 2 and sp.p10_s <= sp.p90_s <= times[-1]
    assert sp.mean_s == pytest.approx(sum(times) / len(times))


def test_most_robust_takes_the_best_mean_within_the_nominal_tolerance():
    cost = _cost(8)
    pool = []
    for seed in range(6):  # different plans of the same problem: searches cut short from different seeds
        f = search_paths(STAGES, cost, 3, 4, 2, seed=seed, robust=None, max_iterations=5 * seed)
        routes = {}
        for e in f.schedule.paths:
            routes.setdefault(e.data_node, []).extend([e.route] * e.microbatches)
        if routes not in pool:
            pool.append(routes)
    assert len(pool) >= 2
    scen = cost_scenarios(cost, None, RobustConfig(samples=5), seed=2)
    spreads = [predicted_spread(r, cost, 2, scen) for r in pool]
    for tol in (0.0, 0.05, 10.0):
        cfg = RobustConfig(samples=5, tolerance=tol)
        k, sp = most_robust(pool, cost, 2, scen, cfg)
        best_nominal = min(s.nominal_s for s in spreads)
        eligible = [i for i, s in enumerate(spreads) if s.nominal_s <= best_nominal * (1 + tol) + 1e-9]
        assert k in eligible
        assert sp.mean_s == min(spreads[i].mean_s for i in eligible)
    # with an unbounded tolerance the plan with the best mean wins even if it is nominally slower
    k, _ = most_robust(pool, cost, 2, scen, RobustConfig(samples=5, tolerance=10.0))
    assert spreads[k].mean_s == min(s.mean_s for s in spreads)


def test_search_reports_spread_and_never_trades_more_than_the_tolerance():
    cost = _cost(8)
    nominal = search_paths(STAGES, cost, 3, 4, 2, seed=0, robust=None)
    judged = search_paths(STAGES, cost, 3, 4, 2, seed=0)
    again = search_paths(STAGES, cost, 3, 4, 2, seed=0)
    assert nominal.report.spread is None
    sp = judged.report.spread
    assert sp is not None and sp.scenarios == RobustConfig().samples + 1
    assert judged.report.final_time_s <= nominal.report.final_time_s * (1 + RobustConfig().tolerance) + 1e-9
    assert judged.schedule.to_json() == again.schedule.to_json()  # deterministic per seed
    scen = cost_scenarios(cost, None, RobustConfig(), seed=0)
    routes = {}
    for e in nominal.schedule.paths:
        routes.setdefault(e.data_node, []).extend([e.route] * e.microbatches)
    assert sp.mean_s <= predicted_spread(routes, cost, 2, scen).mean_s + 1e-9
