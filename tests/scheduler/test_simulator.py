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
