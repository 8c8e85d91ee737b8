"""Hedged microbatches: when a data node hedges, and how the first attempt back wins (pure units, fakes only)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.train.common import IterationState, TrainerConfig
from node.train.hedging import HedgeConfig, hedge_after_s, hedges_allowed
from node.train.recovery import RouteRecovery
from protocol import MicrobatchId

CFG = HedgeConfig()
budgets = st.floats(min_value=0.0, max_value=500.0, allow_nan=False)
samples = st.lists(st.floats(min_value=0.0, max_value=200.0, allow_nan=False), max_size=40)


@settings(max_examples=80, deadline=None)
@given(budgets, samples)
def test_a_hedge_comes_before_the_deadline_and_not_before_the_floor(budget, xs):
    after = hedge_after_s(budget, xs, CFG)
    assert after <= budget
    assert after >= min(budget, CFG.floor_s)
    assert after <= max(CFG.floor_s, CFG.budget_fraction * budget)


@settings(max_examples=60, deadline=None)
@given(budgets, samples, st.floats(0.0, 1000.0))
def test_a_slower_route_is_never_hedged_sooner(budget, xs, slower_by):
    """Round trips all longer by the same amount never make the hedge come earlier."""
    assert hedge_after_s(budget, [x + slower_by for x in xs], CFG) >= hedge_after_s(budget, xs, CFG)


def test_hedge_time_from_the_budget_or_the_observed_round_trips():
    assert hedge_after_s(20.0, [], CFG) == 10.0  # half the budget
    assert hedge_after_s(20.0, [1.0] * 7, CFG) == 10.0  # too few samples
    assert hedge_after_s(20.0, [1.0, 1.1, 0.9, 1.0, 1.2, 0.8, 1.0, 1.0], CFG) == 2.0  # 2 x median, the floor
    xs = [3.0, 3.5, 4.0, 3.0, 3.5, 4.0, 3.5, 3.5]  # median 3.5, MAD 0.5: 3.5 + 4 x 0.5
    assert hedge_after_s(20.0, xs, CFG) == pytest.approx(7.0)
    assert hedge_after_s(1.0, [], CFG) == 1.0  # a budget under the floor: never later than the budget


def test_hedges_per_iteration():
    assert hedges_allowed(3, CFG) == 2 and hedges_allowed(4, CFG) == 2 and hedges_allowed(1, CFG) == 1
    assert hedges_allowed(0, CFG) == 0
    assert hedges_allowed(8, dataclasses.replace(CFG, enabled=False)) == 0
    assert hedges_allowed(8, dataclasses.replace(CFG, max_per_microbatch=0)) == 0
    with pytest.raises(ValueError):
        HedgeConfig(budget_fraction=1.5)


class _Runtime:
    def __init__(self):
        self.dropped = []

    def drop(self, key):
        self.dropped.append(key)


def _recovery(hedging: HedgeConfig = CFG):
    """A data node ``d`` of a swarm with two replicas each of stage 1 (a1, a2) and stage 2 (b1, b2)."""
    members = ["d", "a1", "a2", "b1", "b2"]
    stage_of = {0: 0, 1: 1, 2: 1, 3: 2, 4: 2}
    epochs = SimpleNamespace(members=members, stage_of=stage_of, epoch=SimpleNamespace(epoch=0),
                             replicas=lambda s: [m for i, m in enumerate(members) if stage_of[i] == s],
                             routes=lambda: [[0, 1, 3], [0, 1, 3]], plan=SimpleNamespace(path_length=3))
    sent = []
    state = IterationState()
    rec = RouteRecovery(
        TrainerConfig(run_id="r", hedging=hedging), peer_id="d", node_name="d", epochs=epochs,
        progress=SimpleNamespace(current=0, first_running=lambda: False, state=lambda it: state),
        health=SimpleNamespace(usable=lambda p: True, is_alive=lambda p: True, suspect=lambda p, why: None,
                               gone=lambda peers, now, grace: set()),
        resources=SimpleNamespace(runtime=_Runtime(),
                                  deadlines=SimpleNamespace(floors_s=lambda r: 5.0, microbatch_budget_s=lambda r: 20.0)),
        sender=SimpleNamespace(send_control=lambda peer, msg: sent.append((peer, msg))), life=None,
        pipeline=SimpleNamespace(starts=[], hedges=[], targets={}, wakeup=SimpleNamespace(set=lambda: None)),
        memory_slots=lambda: 1)
    rec.start_microbatches(0, state)
    return rec, state, sent


def _mb(index, attempt):
    return MicrobatchId("r", 0, 0, "d", index, attempt)


@pytest.mark.parametrize("winner", [0, 1])
def test_the_first_attempt_back_wins_and_the_other_is_discarded(winner):
    rec, state, sent = _recovery()
    assert [s[:2] for s in rec.pipeline.starts] == [(0, 0), (1, 0)] and rec._hedges_left == 1
    route = ("d", "a1", "b1", "d")
    assert rec.begin(0, 0, route, now=100.0) and rec.begin(1, 0, route, now=100.0)
    p = rec.pending[0]
    assert p.deadline == 120.0 and p.hedge_at == 110.0  # half the cost model's 20 s budget
    rec.expire(109.0)
    assert not rec.pipeline.hedges
    rec.expire(110.5)  # both late; one hedge an iteration of two microbatches
    assert rec.pipeline.hedges == [(0, 1, ("d", "a2", "b2", "d"))] and rec.hedges.sent == 0  # queued
    assert rec.begin(0, 1, ("d", "a2", "b2", "d"), now=111.0) and rec.hedges.sent == 1
    assert rec.answered(_mb(0, 2)) is None  # no such attempt
    won = rec.answered(_mb(0, winner))
    assert won is not None and won.attempt == winner and rec.pending[0] is won and not won.hedges
    assert rec.hedges.discarded == 1 and rec.hedges.won == winner
    loser = 1 - winner
    assert rec.resources.runtime.dropped == [("d", 0, 0, 0, loser)]
    # the loser's route is told to forget it; the loser's own answer is ignored
    told = {peer for peer, msg in sent if msg.mb.attempt == loser}
    assert told == ({"a1", "b1"} if loser == 0 else {"a2", "b2"})
    won.loss_done = True
    assert rec.answered(_mb(0, loser)) is None and rec.answered(_mb(0, winner)) is None  # never a second loss
    assert won.next_attempt() == 2  # numbers of discarded attempts are never reused


def test_a_failed_attempt_hands_over_to_the_other_and_a_hedge_counts_as_a_retry():
    rec, state, sent = _recovery()
    route = ("d", "a1", "b1", "d")
    rec.begin(0, 0, route, now=100.0)
    rec.expire(110.5)
    assert rec.pipeline.hedges == [(0, 1, ("d", "a2", "b2", "d"))]
    rec.begin(0, 1, ("d", "a2", "b2", "d"), now=110.5)
    rec.on_hop_failure(SimpleNamespace(mb=_mb(0, 0), hop=1, peer_id="a1", reason="x"))  # the original fails
    p = rec.pending[0]
    assert p.attempt == 1 and not p.hedges and state.dropped == 0 and not rec.pipeline.starts[2:]
    rec.expire(p.deadline + 1)  # the hedge is late too: no retry left (the hedge was it), dropped
    assert state.dropped == 1 and 0 not in rec.pending and not rec.pipeline.starts[2:]


def test_hedging_off_and_nowhere_else_to_go():
    rec, state, _ = _recovery(dataclasses.replace(CFG, enabled=False))
    rec.begin(0, 0, ("d", "a1", "b1", "d"), now=100.0)
    rec.expire(119.0)
    assert not rec.pipeline.hedges and rec.hedges.sent == 0
    rec, state, _ = _recovery()
    rec.epochs.replicas = lambda s: [m for i, m in enumerate(rec.epochs.members) if rec.epochs.stage_of[i] == s][:1]
    rec.begin(0, 0, ("d", "a1", "b1", "d"), now=100.0)
    rec.expire(119.0)  # one replica per stage: no other route to hedge on
    assert not rec.pipeline.hedges and rec.hedges.sent == 0


def test_a_route_node_forgets_an_attempt_its_data_node_gave_up():
    """A discarded attempt's state and queued hop are freed at once, and its hops that still come are dropped,
    so it holds no memory slot until the step (the other attempts of the microbatch go on)."""
    from node.train.common import mb_key
    from node.train.pipeline import MicrobatchPipeline
    from protocol import ActivationMessage

    runtime = _Runtime()
    pipeline = MicrobatchPipeline(
        TrainerConfig(run_id="r"), peer_id="a1", node_name="a1", epochs=SimpleNamespace(epoch=SimpleNamespace(epoch=0)),
        progress=SimpleNamespace(current=0), resources=SimpleNamespace(runtime=runtime), sender=None, life=None,
        memory_slots=lambda: 1)
    pipeline.open, pipeline.opened = True, 0
    route = ("d", "a1", "b1", "d")
    pipeline.on_hop(ActivationMessage(_mb(0, 0), 1, route, None))
    pipeline.on_hop(ActivationMessage(_mb(1, 0), 1, route, None))
    pipeline.forget(_mb(0, 0))
    assert runtime.dropped == [mb_key(_mb(0, 0))] and pipeline.queue_sizes() == (0, 1, 0, 0)
    pipeline.on_hop(ActivationMessage(_mb(0, 0), 1, route, None))  # late: dropped
    pipeline.on_hop(ActivationMessage(_mb(0, 1), 1, route, None))  # another attempt: queued
    assert pipeline.queue_sizes() == (0, 2, 0, 0)
    pipeline.stop_compute()
