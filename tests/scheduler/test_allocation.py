import numpy as np
import pytest

from scheduler.allocation import allocate, allocation_cost
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
