"""Path scheduler: every returned schedule is valid (property test), determinism, edge cases."""

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from scheduler.cost import CostMatrix
from scheduler.errors import ScheduleError
from scheduler.paths import schedule_paths, schedule_paths_report
from scheduler.routes import RouteLimits
from scheduler.simulator import simulate
from scheduler.validate import validate_schedule

from .conftest import GEO_STAGES, uniform_cost


@st.composite
def instances(draw):
    sizes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=5))
    n = sum(sizes)
    ids = draw(st.permutations(range(n)))
    stages, k = [], 0
    for s in sizes:
        stages.append(tuple(ids[k : k + s]))
        k += s
    compute = draw(st.lists(st.floats(0.1, 3.0), min_size=n, max_size=n))
    link = [[0.0 if u == v else draw(st.floats(0.0, 5.0)) for v in range(n)] for u in range(n)]
    L = draw(st.integers(1, len(sizes)))
    counts = draw(st.lists(st.integers(0, 5), min_size=sizes[0], max_size=sizes[0]))
    counts[0] = max(counts[0], 1)
    memory = draw(st.integers(1, 3))
    limits = RouteLimits(draw(st.integers(0, 2)), draw(st.integers(1, 4)), draw(st.integers(1, 2)))
    collision_aware = draw(st.booleans())
    return stages, CostMatrix(tuple(compute), tuple(map(tuple, link))), L, counts, memory, limits, collision_aware


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(), st.integers(0, 3))
def test_every_returned_schedule_is_valid(inst, seed):
    stages, cost, L, counts, memory, limits, ca = inst
    try:
        sched = schedule_paths(stages, cost, L, counts, memory, seed, budget_s=30,
                               limits=limits, collision_aware=ca, max_iterations=40)
    except ScheduleError as e:
        # only allowed when the limits make some stage unreachable for its share
        event(f"rejected: {e.constraint}")
        assert e.constraint in ("max-jump", "stage-balance"), e
        assert L > 1 and limits.max_jump < len(stages) - 1 or limits.max_swaps < 2
        return
    event("scheduled")
    validate_schedule(sched, microbatches_per_data_node=dict(zip(stages[0], counts)), limits=limits)
    assert sched.limits == limits
    res = simulate(sched)
    assert not res.deadlock and res.iteration_time_s > 0


def test_deterministic_per_seed(geo_cost):
    a = schedule_paths(GEO_STAGES, geo_cost, 4, 6, 3, seed=5, budget_s=60, max_iterations=300)
    b = schedule_paths(GEO_STAGES, geo_cost, 4, 6, 3, seed=5, budget_s=60, max_iterations=300)
    assert a.to_json() == b.to_json()
    c = schedule_paths(GEO_STAGES, geo_cost, 4, 6, 3, seed=6, budget_s=60, max_iterations=300)
    assert c.to_json() != a.to_json()  # the seed matters


def test_collision_awareness_never_hurts(geo_cost):
    blind = schedule_paths(GEO_STAGES, geo_cost, 4, 6, 3, collision_aware=False)
    aware, rep = schedule_paths_report(GEO_STAGES, geo_cost, 4, 6, 3, budget_s=60, max_iterations=300)
    assert rep.final_time_s <= rep.initial_time_s
    assert simulate(aware).iteration_time_s <= simulate(blind).iteration_time_s
    assert rep.final_time_s == pytest.approx(simulate(aware).iteration_time_s)


def test_full_pipeline_path_length_and_uneven_counts():
    stages = ((0, 1), (2,), (3, 4), (5,))
    sched = schedule_paths(stages, uniform_cost(6, link=0.5), 4, {0: 5, 1: 2}, 2, max_iterations=50)
    validate_schedule(sched, microbatches_per_data_node={0: 5, 1: 2})
    for p in sched.paths:
        assert {2, 5} <= set(p.route)  # single-replica stages are on every full route


def test_microbatches_not_divisible_and_unequal_stages():
    stages = ((0, 1, 2), (3, 4, 5, 6), (7,), (8, 9))
    sched = schedule_paths(stages, uniform_cost(10, link=1.0), 3, [3, 1, 0], 2, max_iterations=50)
    validate_schedule(sched, microbatches_per_data_node={0: 3, 1: 1, 2: 0})


def test_request_errors():
    cost = uniform_cost(4)
    with pytest.raises(ScheduleError, match="^path-length"):
        schedule_paths(((0,), (1,)), cost, 3, 2, 1)
    with pytest.raises(ScheduleError, match="^stages"):
        schedule_paths(((0,), ()), cost, 2, 2, 1)
    with pytest.raises(ScheduleError, match="^stages"):
        schedule_paths(((0,), (7,)), cost, 2, 2, 1)
    with pytest.raises(ScheduleError, match="^microbatch-count"):
        schedule_paths(((0,), (1,)), cost, 2, 0, 1)
    with pytest.raises(ScheduleError, match="^memory"):
        schedule_paths(((0,), (1,)), cost, 2, 1, 0)
    # stage 3 can never be reached with one hop and max_jump 2
    with pytest.raises(ScheduleError, match="^stage-balance"):
        schedule_paths(((0,), (1,), (2,), (3,)), cost, 2, 3, 1, limits=RouteLimits(max_jump=2))


def test_budget_cap_still_returns_valid_schedule(geo_cost):
    sched, rep = schedule_paths_report(GEO_STAGES, geo_cost, 4, 6, 3, budget_s=0.0, max_iterations=10**6)
    assert rep.budget_hit and rep.iterations < rep.iteration_budget == 10**6
    validate_schedule(sched, microbatches_per_data_node=6)


def test_default_search_is_bounded_by_work_not_by_the_wall_clock(geo_cost):
    # no max_iterations: the work budget of the problem size; any cap not reached gives the same schedule
    a, ra = schedule_paths_report(GEO_STAGES, geo_cost, 4, 6, 3, seed=2, budget_s=60)
    b, rb = schedule_paths_report(GEO_STAGES, geo_cost, 4, 6, 3, seed=2, budget_s=1e6)
    assert a.to_json() == b.to_json()
    assert not ra.budget_hit and ra.iterations == ra.iteration_budget == rb.iterations == 1500


def test_iteration_budget_shrinks_with_size():
    from scheduler.paths import iteration_budget

    assert iteration_budget(30, 4) == 300 + 40 * 30  # 20-node setting: 1500
    assert iteration_budget(300, 4) == 1_500_000 // (300 * 9)  # 200 nodes: the simulated-task budget binds
    assert iteration_budget(1500, 4) == 111
    assert iteration_budget(100_000, 4) == 100  # never below min_iterations
    assert iteration_budget(1, 4, base_iterations=5, iterations_per_microbatch=0) == 5  # nor above what is asked


def test_search_moves_pick_replicas_near_the_route():
    # two locations, far apart; each stage has a replica in both (and two tied ones near data
    # node 0): a move re-placing position 1 of a route from data node 0 stays near it
    import random

    from scheduler.paths import _near_replica, _Problem

    near_ids = {0, 1, 2, 3, 4}  # data node 0 and stage 1's replicas 1, 2 (tied), stage 2's 3, 4
    link = tuple(tuple(0.0 if u == v else (0.1 if (u in near_ids) == (v in near_ids) else 5.0) for v in range(8))
                 for u in range(8))
    cost = CostMatrix((1.0,) * 8, link)
    stages = ((0, 7), (1, 2, 5), (3, 4, 6))
    pb = _Problem(stages, cost, 3, 2, RouteLimits(), 20000)
    rng = random.Random(0)
    got = {_near_replica(pb, rng, (0, 1, 3), 1, 1, 1, exclude=1) for _ in range(50)}
    assert got == {2}  # the nearest other replica; the far one (5) is out of reach
    got = {_near_replica(pb, rng, (0, 1, 3), 1, 1, 1) for _ in range(50)}
    assert got == {1, 2}  # ties with the nearest count
    got = {_near_replica(pb, rng, (0, 1, 3), 1, 1, None, exclude=1) for _ in range(50)}
    assert got == {2, 5}  # None: any other replica
