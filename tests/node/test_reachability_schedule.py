"""The coordinator schedules by reachability: two nodes nobody can dial are never adjacent on a path.

A real epoch from :class:`node.swarm.coordinator.Coordinator` over a view whose adverts say which nodes are
behind NAT (``StageAdvert.reachability``); pure, no daemons.
"""

from __future__ import annotations

import dataclasses
import time

import node.compat  # noqa: F401
from node.swarm.adverts import FetchedAdvert
from node.swarm.coordinator import RunConfig
from node.swarm.view import SwarmView
from scheduler.reachability import impossible_hops, relayed_hops
from tests.node.test_schedule_policy import STAGES, _advert, _coordinator, _routes, identities  # noqa: F401

OUT = "outbound_only"


def _view(identities, reach: dict[int, str], relays: tuple[int, ...] = ()) -> SwarmView:
    ids = [i.peer_id.to_base58() for i in identities]
    view = SwarmView(run_id="r", self_id=ids[0])
    view.update_from_dht({
        p: FetchedAdvert(dataclasses.replace(_advert(p, STAGES[k]), reachability=reach.get(k, "direct"),
                                             relay=k in relays),
                         identities[k].public_key_bytes, time.time() + 60)
        for k, p in enumerate(ids)
    })  # fmt: skip
    view.changed_at -= 10
    return view


async def test_two_outbound_only_nodes_are_never_adjacent(identities):
    # a replica of stage 1 and one of stage 2 behind NAT with no relay; every path visits stages 0, 1, 2
    natted = {3: OUT, 5: OUT}
    published = []
    await _coordinator(identities[0], _view(identities, natted), RunConfig(3, 3, 4, "skippipe"), published).tick()
    assert len(published) == 1, "an epoch should be issued: the NATed nodes can still talk to the public ones"
    sched, _ = _routes(published[0])
    members = published[0].members
    peer_ids = [i.peer_id.to_base58() for i in identities]
    reach = [natted.get(peer_ids.index(m), "direct") for m in members]
    assert impossible_hops(sched, reach) == [], sched.paths
    used = {v for p in sched.paths for v in p.route}
    assert {members.index(peer_ids[3]), members.index(peer_ids[5])} <= used  # both still get work


async def test_no_epoch_when_every_path_would_need_an_impossible_link(identities):
    # every node of stages 1 and 2 unreachable: each path has a stage-1 -> stage-2 hop that cannot exist
    published = []
    coordinator = _coordinator(identities[0], _view(identities, {3: OUT, 4: OUT, 5: OUT, 6: OUT}),
                               RunConfig(3, 3, 4, "skippipe"), published)
    await coordinator.tick()
    assert published == [] and "reachability" in coordinator.status, coordinator.status


async def test_a_relay_member_lets_natted_nodes_be_neighbours(identities):
    # as above, but a public member relays (its advert says so): the NATed pairs are relayed, not impossible
    natted = {3: OUT, 4: OUT, 5: OUT, 6: OUT}
    published = []
    coordinator = _coordinator(identities[0], _view(identities, natted, relays=(0,)), RunConfig(3, 3, 4, "skippipe"),
                               published)
    await coordinator.tick()
    assert len(published) == 1, coordinator.status
    sched, _ = _routes(published[0])
    peer_ids = [i.peer_id.to_base58() for i in identities]
    reach = [natted.get(peer_ids.index(m), "direct") for m in published[0].members]
    assert relayed_hops(sched, reach) and impossible_hops(sched, reach, relay=True) == [], sched.paths


def test_view_says_which_peers_no_connection_can_reach(identities):
    # what the trainer asks before it sends a control message (node.train.health.PeerHealth.reaches)
    ids = [i.peer_id.to_base58() for i in identities]
    view = _view(identities, {3: OUT, 5: "relayed"})
    assert not view.reaches(OUT, ids[3])  # both behind NAT, no relay: no connection can exist
    assert view.reaches("direct", ids[3]) and view.reaches(OUT, ids[4])  # either side dialable
    assert view.reaches(OUT, ids[5])  # through the relay it holds
    assert view.reaches(OUT, "a-peer-we-never-heard-of")  # unknown counts as dialable
