"""Microbatch deadlines from observed round trips: the pure estimator, and the data node's budget using it."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.launch.schedules import build_schedule
from node.train.common import Pending, TrainerConfig
from node.train.deadlines import HopDeadlines, ObservedBudgets, ObservedDeadlineConfig, robust_budget
from node.train.recovery import RouteRecovery

CFG = ObservedDeadlineConfig()
times = st.floats(min_value=0.0, max_value=500.0, allow_nan=False)
samples = st.lists(times, min_size=2, max_size=60)
configs = st.builds(ObservedDeadlineConfig, k=st.floats(0.0, 20.0), min_ratio=st.floats(1.0, 4.0),
                    floor_s=st.floats(0.1, 10.0), cap_s=st.floats(10.0, 400.0))


@settings(max_examples=60, deadline=None)
@given(samples, configs, st.floats(0.0, 20.0), st.floats(0.0, 20.0))
def test_the_budget_is_monotone_in_k(xs, cfg, k1, k2):
    lo, hi = sorted((k1, k2))
    assert robust_budget(xs, dataclasses.replace(cfg, k=lo)) <= robust_budget(xs, dataclasses.replace(cfg, k=hi))


@settings(max_examples=60, deadline=None)
@given(samples, configs, st.floats(0.0, 50.0))
def test_the_budget_stays_within_floor_and_cap(xs, cfg, route_floor):
    assert cfg.floor_s <= robust_budget(xs, cfg) <= cfg.cap_s
    assert min(cfg.cap_s, max(cfg.floor_s, route_floor)) <= robust_budget(xs, cfg, route_floor) <= cfg.cap_s


@settings(max_examples=60, deadline=None)
@given(samples, configs, st.floats(0.0, 1e9, allow_nan=False))
def test_one_outlier_cannot_push_the_budget_past_what_the_others_span(xs, cfg, outlier):
    lo, hi = min(xs), max(xs)
    bound = min(cfg.cap_s, max(cfg.floor_s, hi + cfg.k * (hi - lo), hi * cfg.min_ratio))
    assert robust_budget(xs + [outlier], cfg) <= bound * (1 + 1e-12)


@settings(max_examples=40, deadline=None)
@given(samples, st.randoms(use_true_random=False))
def test_the_budget_is_deterministic_in_any_order(xs, rnd):
    shuffled = list(xs)
    rnd.shuffle(shuffled)
    assert robust_budget(shuffled, CFG) == robust_budget(xs, CFG) == robust_budget(tuple(xs), CFG)


def test_median_plus_k_mad_with_its_floors():
    cfg = ObservedDeadlineConfig(k=8.0, min_ratio=1.0, floor_s=1.0, cap_s=100.0)
    assert robust_budget([10, 11, 12, 13, 14], cfg) == 12 + 8 * 1  # median 12, MAD 1
    assert robust_budget([3, 3, 3], dataclasses.replace(cfg, min_ratio=2.0)) == 6  # MAD 0: twice the median
    assert robust_budget([0.01] * 5, cfg) == 1.0  # floor
    assert robust_budget([90, 95, 99], cfg) == 100.0  # cap


def test_budgets_need_enough_samples_and_follow_the_recent_ones():
    budgets = ObservedBudgets(ObservedDeadlineConfig(window=8, min_samples=4, floor_s=0.1))
    for _ in range(3):
        budgets.observe("r", 1.0)
    assert budgets.budget_s("r") is None and budgets.budget_s("other") is None
    budgets.observe("r", 1.0)
    assert budgets.budget_s("r") == 1.5
    for _ in range(8):  # the swarm slowed down: the old samples leave the window
        budgets.observe("r", 10.0)
    assert budgets.samples("r") == (10.0,) * 8 and budgets.budget_s("r") == 15.0
    off = ObservedBudgets(ObservedDeadlineConfig(enabled=False))
    for _ in range(20):
        off.observe("r", 1.0)
    assert off.budget_s("r") is None


def test_a_bad_config_is_refused():
    with pytest.raises(ValueError):
        ObservedDeadlineConfig(window=4, min_samples=8)
    with pytest.raises(ValueError):
        ObservedDeadlineConfig(floor_s=10.0, cap_s=5.0)


def _recovery(observed: ObservedDeadlineConfig) -> RouteRecovery:
    """A data node's route recovery on the cost model of a 3-node path (only its budgets are used here)."""
    schedule = build_schedule(3, data_nodes=1, replicas=[1, 1], path_length=3, microbatches=2, memory=1)
    deadlines = HopDeadlines(schedule, ["d", "a", "b"], [0.01] * 3, 1000)
    return RouteRecovery(TrainerConfig(run_id="r", observed_deadlines=observed), peer_id="d", node_name="d",
                         epochs=None, progress=SimpleNamespace(first_running=lambda: False), health=None,
                         resources=SimpleNamespace(deadlines=deadlines), sender=None, life=None, pipeline=None,
                         memory_slots=lambda: 1)


@pytest.mark.parametrize("enabled", [True, False])
def test_the_data_node_budgets_from_observed_round_trips_once_it_has_enough(enabled):
    recovery = _recovery(ObservedDeadlineConfig(enabled=enabled))
    route = ("d", "a", "b", "d")
    model = recovery.budget_s(route)
    assert recovery.observed.last == ("cost model", model)
    now = time.monotonic()
    for i in range(recovery.cfg.observed_deadlines.min_samples):  # round trips of 20-27 s: a loaded box
        recovery.completed(Pending(i, 0, route, deadline=now + 60, started=now - 20.0 - i))
    budget = recovery.budget_s(route)
    if not enabled:
        assert budget == model and recovery.observed.last[0] == "cost model"
        return
    # median 23.5 s and MAD 2 s of what was seen, not the cost model's seconds
    assert recovery.observed.last == ("observed", budget) and budget != model
    assert 23.5 + 8 * 2.0 - 0.1 <= budget <= 23.5 + 8 * 2.0 + 0.1
    assert recovery.budget_s(("d", "b", "a", "d")) == pytest.approx(model)  # another route: no samples yet
    fast = ("d", "a", "d")  # round trips of 10 ms: the route's floors of the cost model still apply
    for i in range(recovery.cfg.observed_deadlines.min_samples):
        recovery.completed(Pending(i, 0, fast, deadline=now + 60, started=time.monotonic() - 0.01))
    assert recovery.budget_s(fast) == recovery.resources.deadlines.floors_s(fast) == 5.0 + 2 * 1.0 * 2
    assert recovery.observed.last[0] == "observed"
    recovery.budget_s(route)
    report = recovery.observed.report()
    assert report["last_basis"] == "observed" and len(report["routes"]) == 2
    assert report["routes"][0]["median_s"] == pytest.approx(23.5, abs=0.1) and report["routes"][0]["budget_s"] == budget


def test_a_missed_deadline_counts_with_the_time_it_was_given_and_raises_the_budget():
    """A swarm that slowed down for good: every microbatch misses its observed budget; counted at the time they
    were given (a lower bound of their real round trips), the misses raise the route's budget."""
    recovery = _recovery(ObservedDeadlineConfig(window=8, min_samples=4))
    recovery.health = SimpleNamespace(gone=lambda peers, now, grace: set())
    failed = []
    recovery.fail_microbatch = lambda p, why: (failed.append(why), recovery.pending.pop(p.index))
    route = ("d", "a", "b", "d")
    t0 = time.monotonic()
    for i in range(4):
        recovery.completed(Pending(i, 0, route, deadline=t0 + 60, started=t0 - 20.0))
    budgets = [recovery.budget_s(route)]
    for i in range(8):
        started = t0 + 1000 * i
        recovery.pending[i] = Pending(i, 0, route, deadline=started + budgets[-1], started=started)
        recovery.expire(started + budgets[-1] + 0.25)  # not back in time
        budgets.append(recovery.budget_s(route))
    assert len(failed) == 8 and all("deadline of" in why for why in failed)
    assert budgets == sorted(budgets) and budgets[-1] > budgets[0] * 2, budgets
    recovery.pending[9] = Pending(9, 0, route, deadline=t0 + 10, started=t0)
    recovery.expire(t0 + 5)  # in time: nothing happens
    assert len(failed) == 8 and 9 in recovery.pending
