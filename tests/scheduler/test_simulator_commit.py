"""The simulator's optional commit phase: per-stage all-reduce over the replicas' links, then the norm exchange."""

import math

import pytest

from scheduler.errors import ScheduleError
from scheduler.simulator import CommitModel, allreduce_time_s, commit_model, simulate_routes

from .conftest import uniform_cost

# 4 nodes: 0 and 1 fast neighbours, 2 far away (slow, high latency), 3 a lone stage
LAT = ((0.0, 0.01, 0.1, 0.02), (0.01, 0.0, 0.1, 0.02), (0.1, 0.1, 0.0, 0.2), (0.02, 0.02, 0.2, 0.0))
BW = ((1.0, 1e9, 1e6, 1e8), (1e9, 1.0, 1e6, 1e8), (1e6, 1e6, 1.0, 1e7), (1e8, 1e8, 1e7, 1.0))


def test_lone_replica_costs_nothing():
    assert allreduce_time_s(1e9, (3,), LAT, BW) == 0.0
    assert allreduce_time_s(1e9, (3, 3), LAT, BW) == 0.0  # the same node twice is one replica


def test_two_replicas_by_hand():
    # 2 (n-1)/n = 1 vector over 1 GB/s, plus two latencies of 10 ms
    assert allreduce_time_s(1e9, (0, 1), LAT, BW) == pytest.approx(1.0 + 0.02)


def test_the_slowest_link_of_the_group_decides():
    # three replicas: 2 * 2/3 of 1 MB over 1 MB/s (the links to node 2), plus 2 x 100 ms
    assert allreduce_time_s(1e6, (0, 1, 2), LAT, BW) == pytest.approx(4 / 3 + 0.2)
    assert allreduce_time_s(1e6, (0, 1, 2), LAT, BW) > allreduce_time_s(1e6, (0, 1), LAT, BW)


def test_time_grows_linearly_with_parameter_bytes():
    t = [allreduce_time_s(b, (0, 1), LAT, BW) - 0.02 for b in (1e6, 2e6, 4e6)]
    assert t[1] == pytest.approx(2 * t[0]) and t[2] == pytest.approx(4 * t[0])


def test_bad_inputs_are_refused():
    with pytest.raises(ScheduleError):
        allreduce_time_s(-1, (0, 1), LAT, BW)
    with pytest.raises(ScheduleError):
        allreduce_time_s(math.nan, (0, 1), LAT, BW)
    with pytest.raises(ScheduleError):
        CommitModel({0: -1.0})
    with pytest.raises(ScheduleError):
        CommitModel({0: 1.0}, norm_exchange_s=math.inf)
    with pytest.raises(ScheduleError):
        commit_model([(0, 1)], [1e6, 1e6], LAT, BW)


def test_commit_model_from_links():
    m = commit_model([(3,), (0, 1)], [1e6, 1e9], LAT, BW)
    assert m.allreduce_s == {0: 0.0, 1: pytest.approx(1.02)}
    assert m.averaging_s == pytest.approx(1.02)  # stages average in parallel
    # the norm message crosses the slowest member link: 3 <-> 0 or 1 (20 ms + 512 B at 100 MB/s)
    assert m.norm_exchange_s == pytest.approx(0.02 + 512 / 1e8)
    assert commit_model([(0,)], [1.0], LAT, BW).norm_exchange_s == 0.0  # one member: no exchange


def test_whole_iteration_adds_the_commit_to_the_microbatch_phase():
    cost = uniform_cost(2)
    plain = simulate_routes({0: [(0, 1)]}, cost, 1)
    assert plain.whole_iteration_s == plain.iteration_time_s and plain.averaging_s == 0.0
    with_commit = simulate_routes({0: [(0, 1)]}, cost, 1, commit=CommitModel({0: 0.5, 1: 2.0}, 0.25))
    assert with_commit.iteration_time_s == plain.iteration_time_s  # the microbatch phase is unchanged
    assert with_commit.averaging_s == 2.0 and with_commit.norm_exchange_s == 0.25
    assert with_commit.whole_iteration_s == pytest.approx(plain.iteration_time_s + 2.25)
