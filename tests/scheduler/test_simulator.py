"""Simulator cases small enough to compute by hand (compute 1 s forward, 1.5 s backward, 0.25 s loss)."""

import pytest

from scheduler.cost import CostMatrix
from scheduler.schedule import PathEntry, Schedule
from scheduler.simulator import simulate, simulate_routes

from .conftest import uniform_cost


def test_single_node_route():
    r = simulate_routes({0: [(0,)]}, uniform_cost(1), 1)
    assert r.iteration_time_s == pytest.approx(1 + 0.25 + 1.5)


def test_one_hop_uses_each_link_direction():
    # F0 1, 0->1 2 s, F1 1, 1->0 3 s, loss .25, 0->1 2 s, B1 1.5, 1->0 3 s, B0 1.5
    c = CostMatrix((1.0, 1.0), ((0.0, 2.0), (3.0, 0.0)))
    r = simulate_routes({0: [(0, 1)]}, c, 3)
    assert r.iteration_time_s == pytest.approx(15.25)
    assert r.busy_s == pytest.approx((1 + 0.25 + 1.5, 1 + 1.5))


def test_memory_one_serialises_microbatches():
    c = CostMatrix((1.0, 1.0), ((0.0, 2.0), (3.0, 0.0)))
    assert simulate_routes({0: [(0, 1), (0, 1)]}, c, 1).iteration_time_s == pytest.approx(30.5)


def test_two_microbatches_pipeline_with_memory_two():
    r = simulate_routes({0: [(0, 1), (0, 1)]}, uniform_cost(2), 2, record_timelines=True)
    assert r.iteration_time_s == pytest.approx(7.5)
    got = [(t.start_s, t.end_s, t.kind, t.index) for t in r.timelines[0]]
    assert got == [(0, 1, "F", 0), (1, 2, "F", 1), (2, 2.25, "L", 0), (3, 3.25, "L", 1), (4.5, 6, "B", 0), (6, 7.5, "B", 1)]
    got1 = [(t.start_s, t.end_s, t.kind, t.index) for t in r.timelines[1]]
    assert got1 == [(1, 2, "F", 0), (2, 3, "F", 1), (3, 4.5, "B", 0), (4.5, 6, "B", 1)]


def test_backward_first_and_loss_before_forward():
    r = simulate_routes({0: [(0, 1)] * 3}, uniform_cost(2), 3, record_timelines=True)
    # node 1: F2 arrives at 3.25, B1 at 3.5; when node 1 frees at 4.5 the backward goes first
    n1 = [(t.start_s, t.kind, t.index) for t in r.timelines[1]]
    assert n1 == [(1, "F", 0), (2, "F", 1), (3, "B", 0), (4.5, "B", 1), (6, "F", 2), (7.75, "B", 2)]
    # node 0 at t=2: loss of mb 0 and forward of mb 2 both waiting: loss first
    n0 = [(t.start_s, t.kind, t.index) for t in r.timelines[0]]
    assert n0[2:4] == [(2, "L", 0), (2.25, "F", 2)]
    assert r.iteration_time_s == pytest.approx(10.75)


def test_two_data_nodes_collide_on_shared_node():
    # both forwards reach node 2 at t=1; mb of data node 0 (earlier dispatch) runs [1,2], the
    # other [2,3]. B(0) arrives at 2.25 but node 2 is busy (no preemption): [3,4.5], then B at
    # node 0 [4.5,6]. mb of 1: loss [3,3.25], B at 2 waits for B(0): [4.5,6], B at 1 [6,7.5].
    r = simulate_routes({0: [(0, 2)], 1: [(1, 2)]}, uniform_cost(3), 3)
    assert r.finish_s[0] == pytest.approx(6.0)
    assert r.finish_s[1] == pytest.approx(7.5)
    assert r.iteration_time_s == pytest.approx(7.5)


def test_deadlock_is_reported():
    # memory 1, crossing routes: each holds the node the other needs
    r = simulate_routes({0: [(0, 2, 3)], 1: [(1, 3, 2)]}, uniform_cost(4), 1)
    assert r.deadlock and r.iteration_time_s == float("inf")


def test_simulate_schedule_uses_entries_in_dispatch_order():
    s = Schedule(((0,), (1,)), 2, 2, (PathEntry(0, (0, 1), 2),), uniform_cost(2))
    assert simulate(s).iteration_time_s == pytest.approx(7.5)
    assert len(simulate(s).timelines[1]) == 4


def test_shared_link_queues_the_second_transfer_behind_the_first():
    # 0 -> 1 takes 10 s, of which 5 s occupy the link (bytes / bandwidth). F0 of mb 0 ends at 1, of mb 1 at 2:
    # unshared, they reach node 1 at 11 and 12; shared, mb 1 waits for the link until 6 and arrives at 16.
    c = CostMatrix((1.0, 1.0), ((0.0, 10.0), (10.0, 0.0)))
    busy = ((0.0, 5.0), (5.0, 0.0))
    unshared = simulate_routes({0: [(0, 1), (0, 1)]}, c, 2, record_timelines=True)
    shared = simulate_routes({0: [(0, 1), (0, 1)]}, c, 2, record_timelines=True, link_busy_s=busy)
    assert [t.start_s for t in unshared.timelines[1] if t.kind == "F"] == pytest.approx([11, 12])
    assert [t.start_s for t in shared.timelines[1] if t.kind == "F"] == pytest.approx([11, 16])
    assert shared.iteration_time_s > unshared.iteration_time_s


def test_links_that_are_never_busy_change_nothing():
    c = uniform_cost(3)
    routes = {0: [(0, 1, 2), (0, 2, 1), (0, 1, 2)]}
    zero = tuple(tuple(0.0 for _ in range(3)) for _ in range(3))
    assert simulate_routes(routes, c, 2, link_busy_s=zero) == simulate_routes(routes, c, 2)


def test_link_busy_matrix_must_fit_the_cost_matrix():
    from scheduler.errors import ScheduleError

    c = CostMatrix((1.0, 1.0), ((0.0, 2.0), (2.0, 0.0)))
    with pytest.raises(ScheduleError, match="2x2"):
        simulate_routes({0: [(0, 1)]}, c, 1, link_busy_s=((0.0,),))
    with pytest.raises(ScheduleError, match="link_busy_s\\[0\\]\\[1\\]"):
        simulate_routes({0: [(0, 1)]}, c, 1, link_busy_s=((0.0, 3.0), (0.0, 0.0)))  # busier than the whole transfer


def test_link_busy_matrix_is_bytes_over_bandwidth():
    from scheduler.cost import GIB, LinkProfile, ModelShape, NodeSpec, activation_bytes, build_cost, link_busy_matrix

    profile = LinkProfile.from_dict({
        "name": "two", "locations": ["A", "B"], "same_location": {"latency_ms": 0.0, "bandwidth_GiBps": 1.0},
        "links": {"A-B": {"latency_ms": 100.0, "bandwidth_GiBps": 0.5}},
    })
    nodes = [NodeSpec(0, "A", 0.01, 2), NodeSpec(1, "B", 0.01, 2)]
    shape = ModelShape(layers_per_stage=1, d_model=64, seq_len=64, samples_per_microbatch=8)
    busy = link_busy_matrix(nodes, profile, shape)
    assert busy[0][0] == 0.0 and busy[0][1] == pytest.approx(activation_bytes(shape) / (0.5 * GIB))
    assert busy[0][1] <= build_cost(nodes, profile, shape).link_s[0][1]
