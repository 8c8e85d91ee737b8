"""Replicas of one stage behind NAT: placement, stage moves, the averaging group and re-sync sources.

Two replicas behind NAT (outbound-only, no relay) can never be connected, so they can neither average,
re-sync nor hand each other state. Pure rules, no daemons: ``--auto`` avoids a stage whose replicas are all
behind NAT when it is behind NAT itself, a stage move never strands a replica that way, a pinned node is told
in one warning line, and averaging and re-sync leave such a peer out instead of waiting for it.
"""

from __future__ import annotations

import logging
import time

import pytest

import node.compat  # noqa: F401
from node.net.identity import load_or_create_identity
from node.swarm.adverts import FetchedAdvert
from node.swarm.config import DaemonConfig
from node.swarm.coordinator import RunConfig
from node.swarm.handshake import choose_stages, complete_the_view
from node.swarm.replan import ReplanPolicy, StageMove, auto_stage, propose_move
from node.swarm.view import SwarmView
from node.train.averaging import AveragingGroup, averaging_group
from node.train.resync import ResyncAction, ResyncDecision, reachable_source, resync_decision
from protocol.messages import StageAdvert
from scheduler.reachability import stranded_replicas, stranded_stages

OUT, DIRECT, UNKNOWN = "outbound_only", "direct", "unknown"


def test_stranded_stages_are_those_whose_live_replicas_are_all_unreachable_to_us():
    replicas = [[DIRECT], [OUT, OUT], [OUT, DIRECT], [], [UNKNOWN]]
    assert stranded_stages(OUT, replicas) == [1]
    assert stranded_stages(DIRECT, replicas) == []  # a dialable node reaches everyone
    assert stranded_stages(UNKNOWN, replicas) == []  # not known yet: treated as dialable, as before


def test_stranded_replicas_share_a_stage_with_others_and_reach_none_of_them():
    reach = {"d": DIRECT, "p": DIRECT, "a": OUT, "b": OUT, "c": OUT}
    assert stranded_replicas({"d": 0, "a": 1, "b": 1}, reach) == {"a", "b"}
    assert stranded_replicas({"d": 0, "p": 1, "a": 1, "b": 1}, reach) == set()  # both reach p
    assert stranded_replicas({"d": 0, "a": 1, "c": 2}, reach) == set()  # alone on a stage: nobody to pair with
    assert stranded_replicas({"d": 0, "a": 1, "x": 1}, reach) == set()  # x advertises nothing: dialable


def test_auto_leaves_out_stranded_stages_while_another_stage_remains():
    assert auto_stage([1, 1, 1], stranded=[1]) == 2  # stage 1 would be the pick (lowest of the fewest)
    assert auto_stage([1, 2, 1], stranded=[2]) == 1
    assert auto_stage([1, 2, 2], [1.0, 2.0, 1.25], stranded=[2]) == 1  # capacity would pick stage 2
    assert auto_stage([1, 1, 1], stranded=[1, 2]) == 1  # every stage stranded: the old choice (and a warning)
    assert auto_stage([1, 0, 1], stranded=[2]) == 1  # an empty stage first, as before


def test_a_stage_move_never_strands_a_replica_behind_nat():
    policy = ReplanPolicy()
    load = [4.0, 4.0, 4.0]
    compute = {"d": 1.0, "p": 1.0, "a": 1.0, "b": 1.0, "s": 4.0}  # stage 2's one replica 4x slower
    # stage 1: public p and NATed a, b; moving p to the bottleneck stage 2 would leave a and b alone together
    stage_of = {"d": 0, "p": 1, "a": 1, "b": 1, "s": 2}
    reach = {"d": DIRECT, "p": DIRECT, "a": OUT, "b": OUT, "s": DIRECT}
    assert propose_move(policy, stage_of, ["p"], compute, load).peer == "p"  # without reachability: p moves
    assert propose_move(policy, stage_of, ["p"], compute, load, reach) is None
    move = propose_move(policy, stage_of, ["p", "a"], compute, load, reach)  # a may go: b keeps p
    assert move is not None and move.peer == "a" and move.to_stage == 2
    # a NATed node never moves into a stage whose replicas are all NATed
    natted_s = {**reach, "s": OUT}
    assert propose_move(policy, stage_of, ["a", "b"], compute, load, natted_s) is None
    assert propose_move(policy, stage_of, ["p"], compute, load, natted_s) is None  # p would strand a and b
    # a public node into it is fine when what it leaves behind still reaches someone
    four = {"d": 0, "p": 1, "q": 1, "a": 1, "s": 2}
    assert propose_move(policy, four, ["p"], {**compute, "q": 1.0}, load, {**natted_s, "q": DIRECT}) == \
        StageMove("p", 1, 2, pytest.approx(propose_move(policy, four, ["p"], {**compute, "q": 1.0}, load).gain))


def test_a_replica_averages_only_with_replicas_it_can_be_connected_to():
    reach = {"p": True, "a": True, "b": False}  # as NATed a sees them: b is behind NAT too
    assert averaging_group("a", ["a", "b", "p"], reach.get) == AveragingGroup(("a", "p"), client_mode=True)
    assert averaging_group("p", ["a", "b", "p"], lambda q: True) == AveragingGroup(("a", "b", "p"), False)
    # only dialable groupmates: a normal peer, as before
    assert averaging_group("a", ["a", "p"], reach.get) == AveragingGroup(("a", "p"), client_mode=False)
    assert averaging_group("a", ["a", "b"], reach.get).peers == ("a",)  # nobody to average with: no averager
    assert averaging_group("a", ["a", "b", "p"]) == AveragingGroup(("a", "b", "p"), False)  # no reachability known
    # a stage held only behind NAT, with a reducer: every replica, in client mode, and the reducer leads
    with_reducer = averaging_group("a", ["a", "b"], reach.get, reducer="d")
    assert with_reducer == AveragingGroup(("a", "b"), client_mode=True, reducer="d") and with_reducer.size == 3


def test_resync_copies_from_a_reachable_replica_of_the_majority_or_not_at_all():
    reaches = {"a": False, "p": True, "q": True}.get  # as NATed b sees the others
    # a, p, q agree; b differs: the majority's lowest id is a (unreachable): copy p, with a still backing it
    follow = resync_decision({"a": (1, 1.0), "p": (1, 1.0), "q": (1, 1.0)}, 2.0, 1, "b", 1e-6)
    assert follow.action is ResyncAction.FOLLOW and follow.source == "a"
    moved = reachable_source(follow, reaches)
    assert (moved.action, moved.source, set(moved.backers)) == (ResyncAction.FOLLOW, "p", {"a", "p", "q"})
    assert reachable_source(follow, lambda q: True) == follow
    # two NATed replicas alone on a stage: the tie cannot be resolved by a download, each keeps its own
    tie = resync_decision({"a": (1, 1.0)}, 2.0, 1, "b", 1e-6)
    assert tie.action is ResyncAction.TIE
    refused = reachable_source(tie, reaches)
    assert refused.action is ResyncAction.REFUSE and refused.source is None and "reached" in refused.why
    keep = ResyncDecision(ResyncAction.KEEP)
    assert reachable_source(keep, reaches) is keep


def test_a_candidate_downloads_its_proof_from_a_replica_it_can_reach_first():
    from types import SimpleNamespace

    from node.train.proof import StageProof

    epoch = SimpleNamespace(members=("d", "a", "b", "p", "me"), schedule={"stages": [[0], [1, 2, 3, 4]]})
    proof = StageProof(SimpleNamespace(), 1, peer_id="me", p2p=None, dht=None, epoch=lambda: epoch,
                       reaches=lambda peer: peer != "a")  # a is behind NAT, like this candidate
    assert proof.sources(epoch) == ["b", "p", "a"]  # a still backs the state by its sketch, asked last


async def test_a_stage_probe_reference_is_never_asked_of_a_replica_this_node_cannot_reach():
    from node.swarm.admission import Admission

    asked = []

    async def ask(peer, params):
        asked.append(peer)
        return {}  # no sketch: the next replica would be asked

    async def no_sketch(stage, nonce):
        return None  # this node does not hold the stage: it asks the replicas

    admission = Admission("me", "d" * 64, None, lambda: (0,), log=logging.getLogger("test"), sketch=no_sketch,
                          replicas=lambda stage: ["a", "b"], ask_replica=ask, reachable=lambda peer: peer != "a")
    assert [who async for who, _ in admission._reference_sketches(1, b"n" * 16, "candidate")] == []
    assert asked == ["b"]


@pytest.fixture(scope="module")
def identities(tmp_path_factory):
    d = tmp_path_factory.mktemp("ids")
    return [load_or_create_identity(d / f"id{i}.key") for i in range(4)]


def _view(identities, stages, reach) -> SwarmView:
    ids = [i.peer_id.to_base58() for i in identities]
    view = SwarmView(run_id="r", self_id="joiner")
    view.update_from_dht({
        p: FetchedAdvert(StageAdvert(
            run_id="r", peer_id=p, gossip_peer_id="g", maddrs=(), gossip_maddrs=(), stages=stages[k], state="ONLINE",
            compute_s_per_sample_per_layer=0.5, memory_slots=2, free_slots=2, protocol_version=1, rpc_port=None,
            location=None, timestamp=time.time(), reachability=reach[k]), identities[k].public_key_bytes, time.time() + 60)
        for k, p in enumerate(ids)})
    return view


def test_choose_stages_keeps_a_natted_joiner_off_a_stage_held_only_behind_nat(identities, caplog):
    # a public data node, stage 1 held by one NATed replica, stage 2 by two public ones
    view = _view(identities, [(0,), (1,), (2,), (2,)], [DIRECT, OUT, DIRECT, DIRECT])
    run, auto = RunConfig(3, 3, 4), DaemonConfig(replan=ReplanPolicy(enabled=False))
    assert choose_stages(auto, run, view) == (1,)  # fewest replicas; reachability not known
    assert choose_stages(auto, run, view, own_reachability=DIRECT) == (1,)
    with caplog.at_level(logging.INFO):
        assert choose_stages(auto, run, view, own_reachability=OUT) == (2,)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    caplog.clear()
    # pinned there anyway: one warning line saying what will not work and what to do
    with caplog.at_level(logging.INFO):
        assert choose_stages(DaemonConfig(stages=(1,)), run, view, own_reachability=OUT) == (1,)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert "stage 1" in warnings[0] and "behind NAT" in warnings[0] and "--announce-maddrs" in warnings[0]
    assert "average" in warnings[0] and "state" in warnings[0] and "--stages" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        choose_stages(DaemonConfig(stages=(2,)), run, view, own_reachability=OUT)
        choose_stages(DaemonConfig(stages=(1,)), run, view, own_reachability=DIRECT)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def _fetched(identities, stages, reach):
    """What one DHT read returns for the peers of :func:`_view` (peer id -> FetchedAdvert)."""
    return {p: FetchedAdvert(e.advert, e.public_key, e.expires_at)
            for p, e in _view(identities, stages, reach).peers.items()}


@pytest.mark.asyncio
async def test_an_auto_joiner_reads_again_before_trusting_a_view_with_an_unheld_stage(identities):
    # the first read missed stage 2's only replica (a NATed one): choosing on it would take stage 2 and
    # strand a NATed joiner; the next read finds it, and the one after adds nobody, so reading stops
    stages, reach = [(0,), (1,), (2,), (1,)], [DIRECT, DIRECT, OUT, DIRECT]
    view = _view(identities[:2] + identities[3:], [(0,), (1,), (1,)], [DIRECT, DIRECT, DIRECT])
    reads = []

    async def fetch_all(num_stages):
        reads.append(num_stages)
        return _fetched(identities, stages, reach)

    await complete_the_view(view, fetch_all, 3, pause_s=0.0)
    assert len(reads) == 1
    assert choose_stages(DaemonConfig(replan=ReplanPolicy(enabled=False)), RunConfig(3, 3, 4), view,
                         own_reachability=OUT) == (1,)
    # every stage held: no read at all; a stage truly empty: reads stop at the first that adds nobody
    await complete_the_view(view, fetch_all, 3, pause_s=0.0)
    assert len(reads) == 1
    await complete_the_view(view, fetch_all, 4, pause_s=0.0)
    assert len(reads) == 2
