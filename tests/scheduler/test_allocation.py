import numpy as np
import pytest

from scheduler.allocation import _proportional, allocate, allocation_cost
from scheduler.cost import CostMatrix
from scheduler.errors import ScheduleError


def test_sizes_disjoint_and_deterministic(geo_cost):
    a = allocate(geo_cost, [5, 3, 3, 3, 3, 3], seed=3)
    assert [len(s) for s in a.stages] == [5, 3, 3, 3, 3, 3]
    assert sorted(v for s in a.stages for v in s) == list(range(20))
    assert allocate(geo_cost, [5, 3, 3, 3, 3, 3], seed=3).stages == a.stages
    assert a.score == pytest.approx(allocation_cost(a.stages, geo_cost))


def test_beats_random_allocations(geo_cost):
    a = allocate(geo_cost, [5, 3, 3, 3, 3, 3], seed=0)
    rng = np.random.default_rng(123)
    scores = []
    for _ in range(20):
        p = rng.permutation(20)
        stages = [tuple(p[:5])] + [tuple(p[5 + 3 * k : 8 + 3 * k]) for k in range(5)]
        scores.append(allocation_cost(stages, geo_cost))
    assert a.score < min(scores)


def test_extra_nodes_left_out_and_too_few_rejected(geo_cost):
    a = allocate(geo_cost, [4, 2, 2], seed=0)
    assert sum(len(s) for s in a.stages) == 8
    with pytest.raises(ScheduleError, match="^nodes: .*need 23 nodes but there are only 20"):
        allocate(geo_cost, [5, 3, 3, 3, 3, 3, 3], seed=0)
    with pytest.raises(ScheduleError, match="^stage-sizes"):
        allocate(geo_cost, [5, 0], seed=0)


def test_bounded_by_work_not_by_the_wall_clock(geo_cost):
    # the generations come from the work budget, so any cap that is not reached gives the same result
    a = allocate(geo_cost, [5, 3, 3, 3, 3, 3], seed=1, budget_s=30)
    b = allocate(geo_cost, [5, 3, 3, 3, 3, 3], seed=1, budget_s=1e6)
    assert a == b and not a.budget_hit and a.generations == a.generation_budget == 120
    cut = allocate(geo_cost, [5, 3, 3, 3, 3, 3], seed=1, budget_s=0.0)
    assert cut.budget_hit and cut.generations < cut.generation_budget
    assert [len(s) for s in cut.stages] == [5, 3, 3, 3, 3, 3]


def test_generation_budget_shrinks_with_size():
    from scheduler.allocation import generation_budget, matching_cells

    assert generation_budget([5, 3, 3, 3, 3, 3]) == 120
    big = generation_budget([250] + [150] * 5)  # 1,000 nodes
    assert 10 <= big < 120
    assert big == 250_000_000 // (13 * matching_cells([250] + [150] * 5))
    assert generation_budget([2500] + [1500] * 5) == 10  # never below min_generations
    assert generation_budget([5, 3], generations=4) == 4  # nor above the generations asked for


def _four_locations(per_location: int = 24):
    """Nodes round-robin over four locations: 0.1 s inside one, 2 s between two."""
    n = 4 * per_location
    where = [v % 4 for v in range(n)]
    link = tuple(tuple(0.0 if u == v else (0.1 if where[u] == where[v] else 2.0) for v in range(n)) for u in range(n))
    return CostMatrix((1.0,) * n, link), where


def test_one_start_holds_every_stage_in_every_location_in_proportion():
    """With few generations (large allocations) the random starts' imbalance stays: a location
    with many data nodes and few replicas sends its data nodes to other locations. One start deals
    every location its share of every stage, and the elitist search never ends worse than it."""
    cost, where = _four_locations()
    sizes = [24, 18, 18, 18, 18]
    template = np.concatenate([np.full(k, s) for s, k in enumerate(sizes)])
    labels = _proportional(cost, template, len(sizes))
    for s, k in enumerate(sizes):
        per_location = np.bincount([where[v] for v in np.flatnonzero(labels == s)], minlength=4)
        assert per_location.max() - per_location.min() <= 1 and per_location.sum() == k
    start = allocation_cost([tuple(np.flatnonzero(labels == s)) for s in range(len(sizes))], cost)
    capped = allocate(cost, sizes, 0, cell_budget=1)  # the work budget allows only min_generations
    assert capped.generations < 120
    assert capped.score <= start + 1e-12
    assert _proportional(cost, template, 25) is None  # locations of 24 nodes cannot hold 25 stages
    for s in range(len(sizes)):  # so it still holds every stage in every location
        assert set(where[v] for v in capped.stages[s]) == {0, 1, 2, 3}
