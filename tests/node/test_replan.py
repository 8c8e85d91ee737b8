"""Re-planning from measured compute: the planning speeds (measured, else the start-up figure), the decision
(margin, minimum interval, relative to the members' median) and the coordinator issuing a new epoch for the
same members that gives a slow replica fewer microbatches. Pure units: no daemons (the daemon test is
tests/faults/test_replan_daemons.py)."""

from __future__ import annotations

import dataclasses
import time

import pytest

import node.compat  # noqa: F401
from node.net.identity import load_or_create_identity
from node.swarm.adverts import FetchedAdvert
from node.swarm.coordinator import Coordinator, RunConfig
from node.swarm.replan import ReplanPolicy, departure, planning_compute, replan_reason, worth_switching
from node.swarm.view import SwarmView
from protocol.messages import StageAdvert
from scheduler.schedule import Schedule

STAGES = [(0,), (1,), (1,)]  # a data node and two replicas of stage 1
STARTUP_S = 0.5  # every node's start-up benchmark (reference layer shape): the same box


def test_planning_compute_prefers_measurements_and_scales_the_missing():
    assert planning_compute([0.5, 0.5, 0.5], [None, None, None]) == [0.5, 0.5, 0.5]
    # measured: the relative speeds, on the start-up scale (median start-up/measured ratio 50); missing: start-up
    assert planning_compute([0.5, 0.5, 0.5, 1.0], [0.01, 0.01, 0.04, None]) == pytest.approx([0.5, 0.5, 2.0, 1.0])
    assert planning_compute([0.5, 0.5], [0.01, 0.04], use_measured=False) == [0.5, 0.5]


def test_replan_needs_the_margin_the_interval_and_a_relative_change():
    policy = ReplanPolicy(margin=1.5, min_interval_s=30.0)
    planned = [1.0, 1.0, 1.0]
    assert replan_reason(policy, planned, [1.0, 1.0, 4.0], epoch_age_s=31.0)  # one replica 4x slower
    assert replan_reason(policy, planned, [1.0, 1.0, 4.0], epoch_age_s=29.0) is None  # too soon after the last
    assert replan_reason(policy, planned, [1.0, 1.0, 1.4], epoch_age_s=31.0) is None  # within the margin (noise)
    assert replan_reason(policy, planned, [3.0, 3.0, 3.0], epoch_age_s=31.0) is None  # the whole box slowed
    assert replan_reason(policy, None, [1.0, 1.0, 4.0], epoch_age_s=31.0) is None  # plan unknown
    off = dataclasses.replace(policy, enabled=False)
    assert replan_reason(off, planned, [1.0, 1.0, 4.0], epoch_age_s=31.0) is None
    # planned in other units (start-up figures) but the same relative speeds: nothing moved
    assert departure([0.5, 0.5, 0.5], [0.01, 0.01, 0.01]) == (1.0, -1)
    assert departure([1.0, 1.0, 4.0], [1.0, 1.0, 1.0])[1] == 2  # a replica that got fast again also moves
    assert worth_switching(policy, current_s=2.0, new_s=1.5) and not worth_switching(policy, 2.0, 1.9)
    with pytest.raises(ValueError):
        ReplanPolicy(margin=1.0)


@pytest.fixture(scope="module")
def identities(tmp_path_factory):
    d = tmp_path_factory.mktemp("ids")
    return [load_or_create_identity(d / f"id{i}.key") for i in range(len(STAGES))]


def _view(identities, measured):
    ids = [i.peer_id.to_base58() for i in identities]
    view = SwarmView(run_id="r", self_id=ids[0])
    view.update_from_dht({
        p: FetchedAdvert(StageAdvert(
            run_id="r", peer_id=p, gossip_peer_id="g", maddrs=(), gossip_maddrs=(), stages=STAGES[k], state="ONLINE",
            compute_s_per_sample_per_layer=STARTUP_S, memory_slots=2, free_slots=2, protocol_version=1, rpc_port=None,
            location=None, timestamp=time.time(), measured_compute_s_per_sample_per_layer=measured[k]),
            identities[k].public_key_bytes, time.time() + 60)
        for k, p in enumerate(ids)})
    view.changed_at -= 10
    return view


def _microbatches(epoch) -> dict:
    """Peer id -> microbatches routed through it per iteration."""
    sched = Schedule.from_json(epoch.schedule)
    out = {m: 0 for m in epoch.members}
    for p in sched.paths:
        for v in set(p.route):
            out[epoch.members[v]] += p.microbatches
    return out


async def _epochs_after_slowdown(identities, policy: ReplanPolicy, slow_measured: float):
    """Epochs a coordinator issues: one on start-up figures, then (maybe) one after the replica measures slow."""
    published = []

    async def publish(epoch):
        published.append(epoch)

    c = Coordinator(run_id="r", identity=identities[0], view=_view(identities, [None] * 3), run=RunConfig(2, 2, 4),
                    memory=2, debounce_s=0.0, takeover_s=100.0, budget_s=2.0, publish=publish,
                    on_adopt=lambda e: None, replan=policy)
    await c.tick()
    assert len(published) == 1
    c.view = _view(identities, [0.01, 0.01, slow_measured])  # data node and replica A at 0.01, replica B measured
    await c.tick()
    await c.tick()  # a second tick right after: the interval holds further re-plans back
    return published


async def test_the_coordinator_replans_a_slow_replica_to_fewer_microbatches(identities):
    ids = [i.peer_id.to_base58() for i in identities]
    now = ReplanPolicy(min_interval_s=0.0)
    first, second = await _epochs_after_slowdown(identities, now, slow_measured=0.04)
    before, after = _microbatches(first), _microbatches(second)
    assert before[ids[1]] == before[ids[2]] == 2, before  # equal start-up figures: an even split
    assert second.epoch == 2 and second.members == first.members
    assert after[ids[2]] < after[ids[1]] and after[ids[1]] + after[ids[2]] == 4, after
    # within the margin: noise, no new epoch
    assert len(await _epochs_after_slowdown(identities, now, slow_measured=0.014)) == 1
    # re-planning off: the start-up figures stay the plan, no new epoch
    assert len(await _epochs_after_slowdown(identities, dataclasses.replace(now, enabled=False), 0.04)) == 1
    # the interval since the current epoch has not passed
    assert len(await _epochs_after_slowdown(identities, ReplanPolicy(min_interval_s=60.0), 0.04)) == 1


def test_node_run_flags_reach_the_coordinator_policy():
    import argparse

    from node.cli.node_cmd import add_node_run_arguments, config_from_args
    from node.cli.train_args import add_training_arguments

    def config(*argv):
        p = argparse.ArgumentParser()
        add_node_run_arguments(p)
        add_training_arguments(p)
        return config_from_args(p.parse_args(list(argv)))

    assert config().replan == ReplanPolicy(enabled=False)  # off unless asked (co-located daemons: noise)
    assert config("--replan", "on").replan == ReplanPolicy()
    assert config("--replan", "off", "--replan-interval", "5").replan == ReplanPolicy(enabled=False, min_interval_s=5.0)
