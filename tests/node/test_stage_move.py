"""Moving a node to the bottleneck stage: the pure decision (capacity per stage for the microbatches routed
through it, the margin, the minimum replicas, data nodes never moving), where ``--auto`` joiners go, the
coordinator issuing the move (and keeping the moved node there whatever its advert still says), and a trainer's
epoch tracker handing the move to its service instead of refusing it. Pure units: no daemons (the daemon test is
tests/faults/test_stage_move_daemons.py)."""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest

import node.compat  # noqa: F401
from node.net.identity import load_or_create_identity
from node.swarm.adverts import FetchedAdvert
from node.swarm.coordinator import Coordinator, RunConfig, epoch_membership
from node.swarm.replan import ReplanPolicy, StageMove, auto_stage, propose_move, stage_times
from node.swarm.view import SwarmView
from node.train.common import StageMoved
from node.train.epochs import EpochTracker
from protocol.messages import StageAdvert

STAGES = [(0,), (1,), (1,), (2,)]  # a data node, two --auto replicas of stage 1, one replica of stage 2
MOVABLE = [False, True, True, False]
LOAD = [4.0, 4.0, 4.0]  # full paths: every stage sees every microbatch


def _stage_of(**extra):
    return {"d": 0, "a": 1, "b": 1, "s": 2, **extra}


def test_a_movable_node_moves_to_the_bottleneck_stage_when_it_buys_more_than_the_margin():
    policy = ReplanPolicy()
    compute = {"d": 1.0, "a": 1.0, "b": 1.0, "s": 4.0}  # stage 2's one replica 4x slower
    assert stage_times(_stage_of(), compute, LOAD)[1:] == pytest.approx([2.0, 16.0])
    move = propose_move(policy, _stage_of(), ["a", "b"], compute, LOAD)
    # stage 1 keeps one replica (time 4), stage 2 gets a fast one (4 / (1/4 + 1) = 3.2): 16 / 4 = 4x
    assert move == StageMove("a", 1, 2, pytest.approx(4.0))
    # equal speeds: stage 2 is slower (one replica), but a move only swaps which stage is: no gain
    assert propose_move(policy, _stage_of(), ["a", "b"], dict.fromkeys("dabs", 1.0), LOAD) is None
    # the margin: 1.5x slower buys 1.5x (> 1.25), 1.2x slower only 1.2x
    assert propose_move(policy, _stage_of(), ["a", "b"], {**compute, "s": 1.5}, LOAD) is not None
    assert propose_move(policy, _stage_of(), ["a", "b"], {**compute, "s": 1.2}, LOAD) is None
    assert propose_move(dataclasses.replace(policy, move_gain=1.1), _stage_of(), ["a", "b"],
                        {**compute, "s": 1.2}, LOAD) is not None
    # off, nobody movable, or a move that would leave stage 1 below its minimum replicas
    assert propose_move(dataclasses.replace(policy, enabled=False), _stage_of(), ["a", "b"], compute, LOAD) is None
    assert propose_move(policy, _stage_of(), [], compute, LOAD) is None
    assert propose_move(dataclasses.replace(policy, min_replicas=2), _stage_of(), ["a", "b"], compute, LOAD) is None
    lone = {"d": 0, "a": 1, "s": 2}
    assert propose_move(policy, lone, ["a"], compute, LOAD) is None
    # a data node never moves, even when movable and stage 0 has spare replicas
    assert propose_move(policy, {**lone, "e": 0}, ["d", "e"], {**compute, "e": 1.0}, LOAD) is None
    # the move that gains most: from stage 3 (three replicas, the most spare capacity), not from stage 1
    four = {"d": 0, "a": 1, "b": 1, "s": 2, "c": 3, "e": 3, "f": 3}
    times = dict(compute, c=1.0, e=1.0, f=1.0)
    assert propose_move(policy, four, ["a", "c", "e"], times, [4.0] * 4).peer == "c"


def test_auto_joiners_go_to_an_empty_stage_then_to_the_least_capacity_then_to_the_fewest_replicas():
    assert auto_stage([0, 0, 0]) == 0  # the founder: a data node
    assert auto_stage([1, 0, 1]) == 1
    assert auto_stage([1, 1, 1]) == 1  # never stage 0 by a tie: a data node brings load, not capacity
    assert auto_stage([1, 2, 1]) == 2
    # measured: two fast replicas (capacity 2) vs one 4x slow replica (0.25) and one fast: stage 2 is weaker
    assert auto_stage([1, 2, 2], [1.0, 2.0, 1.25]) == 2
    assert auto_stage([1, 1, 2], [1.0, 1.0, 0.5]) == 2  # fewer replicas, more capacity: capacity decides
    assert auto_stage([1, 1, 2], [1.0, 1.0, 0.0]) == 1  # a stage without a measurement: fewest replicas


def test_choose_stages_uses_measured_capacity_only_with_replanning_on(identities):
    from node.swarm.config import DaemonConfig
    from node.swarm.handshake import choose_stages

    # stage 1: two replicas at 0.01, stage 2 one at 0.04
    stages, measured = [(0,), (1,), (1,), (2,)], [0.01, 0.01, 0.01, 0.04]
    view = _view(identities, measured, stages=stages)
    run = RunConfig(3, 3, 4)
    on, off = DaemonConfig(replan=ReplanPolicy()), DaemonConfig(replan=ReplanPolicy(enabled=False))
    assert choose_stages(off, run, view) == (2,)  # fewest replicas (stage 2: one)
    assert choose_stages(on, run, view) == (2,)  # and the least capacity (25 vs 200)
    fast2 = _view(identities, [0.01, 0.04, 0.04, 0.001], stages=stages)  # stage 1: 50; stage 2: 1000
    assert choose_stages(off, run, fast2) == (2,)
    assert choose_stages(on, run, fast2) == (1,)  # one fast replica outweighs two slow ones
    assert choose_stages(on, run, _view(identities, [0.01, 0.04, None, 0.001], stages=stages)) == (2,)
    assert choose_stages(DaemonConfig(stages=(2,)), run, fast2) == (2,)  # --stages pins it


@pytest.fixture(scope="module")
def identities(tmp_path_factory):
    d = tmp_path_factory.mktemp("ids")
    return [load_or_create_identity(d / f"id{i}.key") for i in range(len(STAGES))]


def _view(identities, measured, stages=STAGES, movable=MOVABLE, startup=(0.5,) * 4):
    ids = [i.peer_id.to_base58() for i in identities]
    view = SwarmView(run_id="r", self_id=ids[0])
    view.update_from_dht({
        p: FetchedAdvert(StageAdvert(
            run_id="r", peer_id=p, gossip_peer_id="g", maddrs=(), gossip_maddrs=(), stages=stages[k], state="ONLINE",
            compute_s_per_sample_per_layer=startup[k], memory_slots=2, free_slots=2, protocol_version=1, rpc_port=None,
            location=None, timestamp=time.time(), measured_compute_s_per_sample_per_layer=measured[k],
            movable=movable[k]), identities[k].public_key_bytes, time.time() + 60)
        for k, p in enumerate(ids)})
    view.changed_at -= 10
    return view


async def _epochs(identities, policy: ReplanPolicy, movable=MOVABLE, measured=(0.01, 0.01, 0.01, 0.04),
                  startup=(0.5,) * 4):
    """Epochs a coordinator issues: one on start-up figures, then (maybe) one once stage 2 measures 4x slow, then
    none more (also once the moved node advertises its new stage)."""
    published = []

    async def publish(epoch):
        published.append(epoch)

    c = Coordinator(run_id="r", identity=identities[0], view=_view(identities, [None] * 4, movable=movable),
                    run=RunConfig(3, 3, 4), memory=2, debounce_s=0.0, takeover_s=100.0, budget_s=2.0,
                    publish=publish, on_adopt=lambda e: None, replan=policy)
    await c.tick()
    assert len(published) == 1
    c.view = _view(identities, measured, movable=movable, startup=startup)
    await c.tick()
    await c.tick()  # adverts still say stage 1 for the mover: it stays where the epoch put it
    if len(published) == 2:
        moved = dict(epoch_membership(published[1]))
        stages = [(moved[i.peer_id.to_base58()],) for i in identities]
        c.view = _view(identities, measured, stages=stages, movable=movable, startup=startup)
        await c.tick()
    return published


async def test_the_coordinator_moves_an_auto_node_to_the_slow_stage_once(identities):
    ids = [i.peer_id.to_base58() for i in identities]
    now = ReplanPolicy(min_interval_s=0.0)
    published = await _epochs(identities, now)
    assert len(published) == 2, [dict(epoch_membership(e)) for e in published]
    before, after = dict(epoch_membership(published[0])), dict(epoch_membership(published[1]))
    assert [before[p] for p in ids] == [0, 1, 1, 2]
    assert after[ids[0]] == 0 and after[ids[3]] == 2 and sorted([after[ids[1]], after[ids[2]]]) == [1, 2], after
    # re-planning off, or nobody movable (--stages everywhere): no move
    assert len(await _epochs(identities, dataclasses.replace(now, enabled=False))) == 1
    assert len(await _epochs(identities, now, movable=[False] * 4)) == 1
    # start-up figures alone (one short benchmark, skewed by whatever else ran) never move a node, nor do they
    # while a replica has not measured itself yet (a re-plan for speed may still come: same stages)
    assert len(await _epochs(identities, now, measured=(None,) * 4, startup=(0.5, 0.5, 0.5, 2.0))) == 1
    partly = await _epochs(identities, now, measured=(0.01, 0.01, None, 0.04))
    assert {epoch_membership(e) for e in partly} == {epoch_membership(published[0])}


class _Epoch:
    def __init__(self, number, members, stages, start):
        self.run_id, self.epoch, self.members, self.start_iteration = "r", number, tuple(members), start
        self.schedule = {"stages": stages, "data_nodes": [0], "path_length": len(stages), "memory": 1,
                         "paths": [{"data_node": 0, "route": [0] + [s[0] for s in stages[1:]], "microbatches": 1}]}


def test_an_epoch_that_moves_this_node_hands_the_move_over_instead_of_refusing_it():
    members = ["d", "a", "b", "s"]
    first = _Epoch(1, members, [[0], [1, 2], [3]], 0)
    moved = _Epoch(2, members, [[0], [1], [2, 3]], 5)
    tracker = EpochTracker("b", "r", first)
    tracker.bind(first)
    assert tracker.stage == 1
    tracker.offer(moved)
    assert tracker.switch(4) is False  # not due yet
    with pytest.raises(StageMoved) as info:
        tracker.switch(5)
    assert (info.value.old_stage, info.value.new_stage, info.value.epoch) == (1, 2, moved)
    assert tracker.epoch is first and tracker.stage == 1  # still the old stage: the service rebuilds the trainer
    other = EpochTracker("a", "r", first)  # a member whose stage stays switches as before
    other.bind(first)
    other.offer(moved)
    assert other.switch(5) is True and other.stage == 1


async def test_the_node_advertises_the_stage_its_epoch_gives_it_only_when_it_joined_with_auto():
    from types import SimpleNamespace

    from node.swarm.wiring import move_to_stage
    from node.train.common import NodeLog
    from node.train.service import follow_stage_move

    announced = []

    class Membership:
        async def move_to(self, stages):
            announced.append(stages)

    def daemon(stages, flag):
        return SimpleNamespace(config=SimpleNamespace(stages=flag), stages=stages, membership=Membership(),
                               peer_id="b")

    auto, pinned = daemon((1,), None), daemon((1,), (1,))
    await move_to_stage(auto, 2)
    await move_to_stage(auto, 2)  # already there: nothing to announce
    await move_to_stage(pinned, 2)  # --stages: its advert stays
    assert (auto.stages, pinned.stages, announced) == ((2,), (1,), [(2,)])

    moved = _Epoch(2, ["d", "a", "b", "s"], [[0], [1], [2, 3]], 5)
    calls = []
    host = SimpleNamespace(peer_id="b", move_stage=lambda s: _record(calls, s))
    trainer = SimpleNamespace(moved=StageMoved("m", moved, 1, 2), log=NodeLog(logging.getLogger(), "b"))
    await follow_stage_move(host, trainer, moved)
    await follow_stage_move(host, None, moved)  # a first epoch (no trainer yet): the stage it gives, as well
    await follow_stage_move(SimpleNamespace(peer_id="x", move_stage=None), None, moved)  # not a member: nothing
    assert calls == [2, 2]


async def _record(calls, stage):
    calls.append(stage)
