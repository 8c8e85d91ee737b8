"""Lower bound on the iteration time: never above a simulated valid schedule, tight where it can be."""

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from scheduler.baselines import random_skip
from scheduler.bounds import _qth_smallest_finish, iteration_lower_bound, min_cycles
from scheduler.cost import CostMatrix
from scheduler.errors import ScheduleError
from scheduler.paths import _Problem, _random_balanced, normalise_request, routes_to_schedule, schedule_paths, schedule_paths_report
from scheduler.routes import RouteLimits
from scheduler.simulator import simulate, simulate_routes
from scheduler.validate import validate_schedule

from .conftest import GEO_STAGES, uniform_cost


@st.composite
def problems(draw):
    sizes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=5))
    n = sum(sizes)
    ids = draw(st.permutations(range(n)))
    stages, k = [], 0
    for s in sizes:
        stages.append(tuple(ids[k : k + s]))
        k += s
    compute = draw(st.lists(st.floats(0.0, 3.0), min_size=n, max_size=n))
    link = [[0.0 if u == v else draw(st.floats(0.0, 5.0)) for v in range(n)] for u in range(n)]
    ratios = draw(st.sampled_from([(1.5, 0.25), (1.0, 0.0), (2.0, 1.0)]))
    L = draw(st.integers(1, len(sizes)))
    counts = draw(st.lists(st.integers(0, 6), min_size=sizes[0], max_size=sizes[0]))
    counts[0] = max(counts[0], 1)
    memory = draw(st.integers(1, 3))
    limits = RouteLimits(draw(st.integers(0, 2)), draw(st.integers(1, 4)), draw(st.integers(1, 2)))
    cost = CostMatrix(tuple(compute), tuple(map(tuple, link)), *ratios)
    return tuple(stages), cost, L, counts, memory, limits


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.integers(0, 3))
def test_bound_is_below_every_schedule_tried(problem, seed):
    stages, cost, L, counts, memory, limits = problem
    try:
        st_, cnt = normalise_request(stages, cost, L, counts, memory)
        pb = _Problem(st_, cost, L, memory, limits, 20000)
    except ScheduleError as e:
        event(f"rejected: {e.constraint}")
        return
    bound = iteration_lower_bound(st_, cost, L, cnt, memory, limits=limits)
    relaxed = iteration_lower_bound(st_, cost, L, cnt, memory, limits=limits, max_sequences=0)
    assert 0 <= relaxed.value_s <= bound.value_s + 1e-9  # walks relax the stage orders
    schedules = []
    for ca in (True, False):
        try:
            schedules.append(schedule_paths(stages, cost, L, counts, memory, seed, limits=limits, collision_aware=ca,
                                            max_iterations=30))
        except ScheduleError:
            pass
    try:
        schedules.append(random_skip(stages, cost, L, counts, memory, seed, limits=limits))
    except ScheduleError:
        pass
    for k in range(3):  # network-blind valid routes, per microbatch and per lane
        r = _random_balanced(pb, cnt, random.Random(seed * 10 + k), tries=5, lanes=memory if k else None)
        if r is not None:
            schedules.append(routes_to_schedule(st_, r, L, memory, cost, limits))
    event(f"{len(schedules)} schedules")
    rng = random.Random(seed)
    for sched in schedules:
        validate_schedule(sched, microbatches_per_data_node=cnt, limits=limits)
        t = simulate(sched).iteration_time_s
        assert bound.value_s <= t + 1e-9 * max(1.0, t), (bound, t, sched)
        # the same routes in another dispatch order (the waves argument is about that order)
        shuffled = {d: rng.sample(rs, len(rs)) for d, rs in sched.dispatch_order().items()}
        t = simulate_routes(shuffled, cost, memory).iteration_time_s
        assert bound.value_s <= t + 1e-9 * max(1.0, t), (bound, t, shuffled)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9), st.integers(1, 3), st.integers(1, 4), st.lists(st.floats(0.0, 3.0), min_size=5, max_size=5),
       st.floats(0.0, 2.0), st.integers(0, 1000))
def test_one_data_node_never_beats_its_waves(c, memory, replicas, compute, link, seed):
    # one data node, one stage of replicas, every assignment and dispatch order allowed: the
    # data node's waves (memory slots freed only by its own backwards) bound every one of them
    n = 1 + replicas
    cost = CostMatrix(tuple(compute[:n]), tuple(tuple(0.0 if u == v else link * (1 + (u + v) % 3) for v in range(n))
                                                 for u in range(n)))
    stages = ((0,), tuple(range(1, n)))
    bound = iteration_lower_bound(stages, cost, 2, {0: c}, memory)
    rng = random.Random(seed)
    for _ in range(5):
        routes = {0: [(0, rng.randrange(1, n)) for _ in range(c)]}
        t = simulate_routes(routes, cost, memory).iteration_time_s
        assert bound.value_s <= t + 1e-9 * max(1.0, t), (bound, t, routes)


def test_waves_two_rounds_through_free_replicas():
    # 4 microbatches, memory 2, each on its own replica (no queueing there), round trip 5.25 s.
    # The third forward waits for the first backward (ends >= 5.25); the fourth for a second
    # backward at node 0, which then runs both of them and the third forward: 5.25 + 1.5 + 1;
    # the last round trip adds 5.25. The slot chains alone give 2 x 5.25 + (1 + 1.5) / 2.
    c = uniform_cost(5)
    b = iteration_lower_bound(((0,), (1, 2, 3, 4)), c, 2, {0: 4}, 2)
    assert b.argument == "round-trips"
    assert b.value_s == pytest.approx(2 * 5.25 + 1.5 + 1.0)
    t = simulate_routes({0: [(0, 1), (0, 2), (0, 3), (0, 4)]}, c, 2).iteration_time_s
    assert b.value_s <= t == pytest.approx(13.5)


def test_tight_for_one_microbatch_on_one_route():
    # F0 1, 0->1 2 s, F1 1, 1->0 3 s, loss .25, 0->1 2 s, B1 1.5, 1->0 3 s, B0 1.5 = 15.25 (simulator test)
    c = CostMatrix((1.0, 1.0), ((0.0, 2.0), (3.0, 0.0)))
    b = iteration_lower_bound(((0,), (1,)), c, 2, {0: 1}, 3)
    assert b.value_s == pytest.approx(15.25)
    assert b.value_s == pytest.approx(simulate_routes({0: [(0, 1)]}, c, 3).iteration_time_s)
    assert b.argument == "round-trips" and b.where == 0 and b.gap(15.25) == pytest.approx(0.0)


def test_tight_when_the_data_node_does_everything():
    # path length 1: every task on the data node, which is never idle: 5 x (1 + .25 + 1.5)
    c = uniform_cost(3)
    b = iteration_lower_bound(((0,), (1,), (2,)), c, 1, {0: 5}, 2)
    assert b.value_s == pytest.approx(5 * 2.75)
    assert simulate_routes({0: [(0,)] * 5}, c, 2).iteration_time_s == pytest.approx(b.value_s)
    assert b.argument == "data-node-work"


def test_memory_slots_multiply_the_round_trip():
    c = CostMatrix((1.0, 1.0), ((0.0, 2.0), (3.0, 0.0)))
    # memory 1 serialises two microbatches: 2 x 15.25 (the simulator gives exactly that)
    b = iteration_lower_bound(((0,), (1,)), c, 2, {0: 2}, 1)
    assert b.value_s == pytest.approx(30.5) == simulate_routes({0: [(0, 1), (0, 1)]}, c, 1).iteration_time_s


def test_tight_for_two_microbatches_through_one_replica():
    # simulator test: two microbatches 0 -> 1 with memory 2 take 7.5 s. Node 1 can start at 1 (after
    # a forward at 0), does 2 x (1 + 1.5) and its last gradient then needs 1.5 s at node 0.
    c = uniform_cost(2)
    b = iteration_lower_bound(((0,), (1,)), c, 2, {0: 2}, 2)
    assert b.value_s == pytest.approx(7.5) == simulate_routes({0: [(0, 1), (0, 1)]}, c, 2).iteration_time_s
    assert b.argument == "stage-work"
    # the slot chains give 2 round trips of 5.25 s in 2 slots, started a forward apart, ended a backward
    # apart (6.5 s); the waves do better: the first backward at 0 starts no earlier than 5.25 - 1.5 and
    # both backwards run there one after the other, 3.75 + 2 x 1.5
    assert b.by_argument["round-trips"] == pytest.approx(3.75 + 2 * 1.5)


def test_stage_work_binds_when_a_stage_is_the_bottleneck():
    # two data nodes, one slow replica in stage 1 that every microbatch must visit
    c = CostMatrix((1.0, 1.0, 10.0), ((0.0, 0.0, 0.0), (0.0, 0.0, 0.0), (0.0, 0.0, 0.0)))
    b = iteration_lower_bound(((0, 1), (2,)), c, 2, {0: 3, 1: 3}, 3)
    # 6 visits x 25 s of work, plus a data-node forward before and backward after
    assert b.argument == "stage-work" and b.where == 1
    assert b.value_s == pytest.approx(1.0 + 6 * 25.0 + 1.5)
    t = simulate(schedule_paths(((0, 1), (2,)), c, 2, 3, 3, max_iterations=20)).iteration_time_s
    assert b.value_s <= t


def test_qth_smallest_finish_is_the_best_spread():
    # replica 0 finishes jobs at 1, 2, 3, ...; replica 1 at 2, 4, ...: 3 jobs done by 2
    assert _qth_smallest_finish(np.array([0.0, 0.0]), np.array([1.0, 2.0]), 3) == 2.0
    assert _qth_smallest_finish(np.array([5.0, 0.0]), np.array([0.0, 1.0]), 100) == 5.0
    assert _qth_smallest_finish(np.array([1.0]), np.array([2.0]), 1) == 3.0


def test_min_cycles_matches_brute_force():
    rng = np.random.default_rng(3)
    E = rng.random((7, 7))
    w = rng.random(7)
    groups = [(0, 1), (2, 3), (4, 5, 6)]
    orders = [(1, 2), (2, 1)]
    got = min_cycles([0, 1], groups, orders, E, w)
    for i, d in enumerate((0, 1)):
        want = min(E[d, x] + w[x] + E[x, y] + w[y] + E[y, d]
                   for q in orders for x in groups[q[0]] for y in groups[q[1]])
        assert got[i] == pytest.approx(want)


def test_geo_plan_is_within_a_quarter_of_its_bound(geo_cost):
    sched, rep = schedule_paths_report(GEO_STAGES, geo_cost, 4, 6, 3)
    st_, cnt = normalise_request(GEO_STAGES, geo_cost, 4, 6, 3)
    b = iteration_lower_bound(st_, geo_cost, 4, cnt, 3)
    t = simulate(sched).iteration_time_s
    assert not rep.budget_hit and rep.iterations == rep.iteration_budget == 1500
    assert b.value_s <= t
    assert b.gap(t) < 0.25, (b, t)
