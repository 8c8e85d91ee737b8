"""Membership upkeep: the heartbeat (our adverts) and the view loop (everyone else's, gossip, epochs).

Two loops, because announcing must never wait for view or schedule work: under load (20 daemons
on 2 cores) one combined loop took longer than the advert TTL and healthy peers flapped out of
each other's views. The view loop wakes on its beat or at once when gossip announces a change
(a newcomer we have not read from the DHT, a leave).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Optional

from node.swarm.gossip import GossipMessage
from node.swarm.states import NodeState
from protocol.errors import ProtocolError
from protocol.messages import LinkReport, MembershipEvent, ScheduleEpoch, StageAdvert, decode, encode

if TYPE_CHECKING:
    from node.ops.metrics import NodeMetrics
    from node.swarm.admission import Admission
    from node.swarm.adverts import AdvertStore
    from node.swarm.config import DaemonConfig
    from node.swarm.coordinator import Coordinator, RunConfig
    from node.swarm.gossip import GossipService
    from node.swarm.gossip_access import GossipAccessControl
    from node.swarm.states import NodeLogger
    from node.swarm.view import SwarmView

__all__ = ["Membership", "MembershipParts", "gossip_topics"]

logger = logging.getLogger(__name__)

#: The DHT epoch record outlives the heartbeat by far: late joiners read it from there.
EPOCH_RECORD_TTL_S = 3600.0
#: Look for a newer epoch in the DHT every this many view rounds (gossip is the fast path).
EPOCH_DHT_POLL_HEARTBEATS = 3
#: Store durations of margin in the advert lifetime (see Membership.advert_ttl_s).
TTL_STORE_MARGIN = 3.0
#: A JOINING node turns ONLINE after this many successful heartbeats.
JOINING_HEARTBEATS = 1


def gossip_topics(run_id: str) -> dict[str, str]:
    """The run's gossip topics by purpose."""
    return {
        "membership": f"skippipe/{run_id}/membership",
        "links": f"skippipe/{run_id}/links",
        "epochs": f"skippipe/{run_id}/epochs",
    }


@dataclass(frozen=True)
class MembershipParts:
    """The daemon's parts that membership works with, which exist only once the network is up: the daemon
    hands them over (:meth:`Membership.bind`) before membership's first round."""

    peer_id: str
    public_key: bytes
    #: this node's stages (chosen when joining; an epoch may move an ``--auto`` node to another)
    stages: tuple
    view: "SwarmView"
    adverts: "AdvertStore"
    run: "RunConfig"
    gossip: "GossipService"
    coordinator: "Coordinator"
    admission: "Admission"


class Membership:
    """Keeps our adverts fresh, the view current, gossip connected and the coordinator ticking.

    Made with the daemon's configuration and the parts that exist from the start; ``advert`` builds our
    current advert, ``state`` reads the node's state and ``go_online`` turns a JOINING node ONLINE. The parts
    of the running network come with :meth:`bind`; before it, gossip is ignored and nothing is announced."""

    def __init__(self, config: "DaemonConfig", log: "NodeLogger", metrics: "NodeMetrics",
                 gossip_access: "GossipAccessControl", advert: Callable[[], StageAdvert],
                 state: Callable[[], NodeState], go_online: Callable[[], None]):
        self.config, self._log, self.metrics, self.gossip_access = config, log, metrics, gossip_access
        self._advert, self._state, self._go_online = advert, state, go_online
        self.parts: Optional[MembershipParts] = None
        self.topics = gossip_topics(config.run_id)
        #: Seconds the last announce / view refresh took (exposed in status: load indicator).
        self.last_announce_s = 0.0
        self.last_refresh_s = 0.0
        #: Completed view refreshes (status: lets a test wait for "the view has been re-read").
        self.view_refreshes = 0
        self.refresh_now = asyncio.Event()
        self._heartbeats = 0
        self._gossip_dialing: set[str] = set()

    def bind(self, parts: MembershipParts) -> None:
        """The running network's parts (before :meth:`catch_up` and the loops)."""
        self.parts = parts

    # ------------------------------------------------------------------ adverts
    def advert_ttl_s(self) -> float:
        """Advert lifetime: the configured TTL, stretched when stores are slow.

        The next advert lands one heartbeat plus one store duration after this one was sent, so
        a lifetime shorter than ``heartbeat + 2 x store time`` makes a healthy node flap out of
        views on an overloaded machine; we keep a margin of 3 store durations.
        """
        cfg = self.config
        return max(cfg.advert_ttl_s, cfg.heartbeat_s + TTL_STORE_MARGIN * self.last_announce_s)

    async def move_to(self, stages: tuple) -> None:
        """This node holds ``stages`` from now on (an epoch moved it): announce that now, not a heartbeat later,
        so ``--auto`` joiners count it there; a failed store is retried by the next heartbeat."""
        if self.parts is None:
            return
        self.parts = replace(self.parts, stages=tuple(stages))
        try:
            await self.announce()
        except Exception as e:  # noqa: BLE001 - the heartbeat announces again
            self._log.info("announcing the new stage failed (the next heartbeat retries): %r", e)

    async def announce(self) -> None:
        p = self.parts
        if p is None:
            return  # nothing to announce through yet
        advert = self._advert()
        ttl = self.advert_ttl_s()
        await p.adverts.announce(advert, ttl)
        p.view.set_self(advert, p.public_key, time.time() + ttl)

    async def refresh_view(self) -> None:
        p = self.parts
        fetched = await p.adverts.fetch_all(p.run.num_stages)
        fetched.pop(p.peer_id, None)  # our own entry is set locally, never from the DHT
        p.view.update_from_dht(fetched)

    async def heartbeat_loop(self) -> None:
        """Re-announce our adverts on a fixed beat, never delayed by view or schedule work."""
        while True:
            t0 = time.monotonic()
            try:
                self._heartbeats += 1
                if self._state() == NodeState.JOINING and self._heartbeats > JOINING_HEARTBEATS:
                    self._go_online()
                    await self.announce()
                    self.publish_event("join")
                else:
                    await self.announce()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - one failed heartbeat must not kill the daemon
                self._log.exception("advert announce failed")
            self.last_announce_s = time.monotonic() - t0
            await asyncio.sleep(max(0.0, self.config.heartbeat_s - self.last_announce_s))

    # ------------------------------------------------------------------ view
    async def catch_up(self) -> None:
        """One round of everything the loops do, before the loops start (so start() returns a node
        that has announced itself, read the view and adopted any epoch already issued)."""
        await self.announce()
        await self.refresh_view()
        await self.maintain_gossip()
        await self.adopt_epoch_from_dht()

    async def view_loop(self) -> None:
        """Refresh the view, keep gossip connections, and drive the coordinator."""
        rounds = 0
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.refresh_now.wait(), timeout=self.config.heartbeat_s)
            self.refresh_now.clear()
            t0 = time.monotonic()
            try:
                rounds += 1
                await self.refresh_view()
                self.view_refreshes += 1
                self.update_view_metrics()
                await self.maintain_gossip()
                if rounds % EPOCH_DHT_POLL_HEARTBEATS == 0:
                    await self.adopt_epoch_from_dht()
                await self.parts.coordinator.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001
                self._log.exception("view refresh failed")
            self.last_refresh_s = time.monotonic() - t0

    def update_view_metrics(self) -> None:
        p = self.parts
        if p is None:
            return  # no view yet
        self.metrics.set_peer_states(e.state for e in p.view.peers.values())
        epoch = p.coordinator.current
        self.metrics.set_schedule_epoch(epoch.epoch if epoch else None)

    async def maintain_gossip(self) -> None:
        """Keep up to ``gossip_target_peers`` gossip connections, to peers found in the DHT."""
        p = self.parts
        connected = p.gossip.connected_peers()
        wanted = self.config.gossip_target_peers - len(connected)
        if wanted <= 0:
            return
        candidates = [
            e
            for e in p.view.alive()
            if e.peer_id != p.peer_id
            and e.advert.gossip_peer_id
            and e.advert.gossip_peer_id not in connected
            and e.advert.gossip_peer_id not in self._gossip_dialing
            and e.advert.gossip_maddrs
        ]
        # Spread connections: start after our own id in the ring so the mesh is not a star.
        candidates.sort(key=lambda e: (e.peer_id <= p.peer_id, e.peer_id))
        for entry in candidates[:wanted]:
            gid = entry.advert.gossip_peer_id
            self._gossip_dialing.add(gid)
            task = asyncio.create_task(p.gossip.connect(gid, list(entry.advert.gossip_maddrs)))
            task.add_done_callback(lambda _t, gid=gid: self._gossip_dialing.discard(gid))

    async def admission_loop(self) -> None:
        """Each heartbeat: data nodes (the coordinator candidates) challenge the candidates, every node
        probes the epoch's members (:mod:`node.swarm.admission`); a changed verdict wakes the view loop."""
        p = self.parts
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            try:
                epoch = p.coordinator.current
                candidates = [e for e in p.view.online() if e.peer_id != p.peer_id] if 0 in p.stages else []
                if await p.admission.round(candidates, epoch.members if epoch is not None else ()):
                    self.refresh_now.set()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - one failed round must not stop admissions
                self._log.exception("admission round failed")

    # ------------------------------------------------------------------ epochs
    async def adopt_epoch_from_dht(self) -> None:
        p = self.parts
        for epoch, _owner in await p.adverts.fetch_epochs():
            p.coordinator.consider(epoch)

    async def publish_epoch(self, epoch: ScheduleEpoch) -> None:
        self.parts.gossip.publish(self.topics["epochs"], encode(epoch))
        await self.parts.adverts.store_epoch(epoch, EPOCH_RECORD_TTL_S)

    # ------------------------------------------------------------------ gossip
    def publish_event(self, kind: str) -> None:
        p = self.parts
        event = MembershipEvent(run_id=self.config.run_id, peer_id=p.peer_id, kind=kind, stages=tuple(p.stages),
                                timestamp=time.time())
        p.gossip.publish(self.topics["membership"], encode(event))

    def publish_links(self, report: LinkReport) -> None:
        self.parts.gossip.publish(self.topics["links"], encode(report))

    def on_gossip(self, message: GossipMessage) -> None:
        p = self.parts
        if p is None or message.from_gossip_id == p.gossip.peer_id:
            return  # not bound yet (nothing to apply it to), or our own
        if not self.gossip_access.allowed(message.from_gossip_id):
            return
        try:
            if message.topic == self.topics["membership"]:
                event = decode(message.data, expect=MembershipEvent)
                if not p.view.on_membership(event, message.from_gossip_id) and event.kind != "leave":
                    self.refresh_now.set()  # a newcomer we have not read from the DHT yet
                elif event.kind == "leave":
                    self.refresh_now.set()
            elif message.topic == self.topics["links"]:
                p.view.on_link_report(decode(message.data, expect=LinkReport), message.from_gossip_id)
            elif message.topic == self.topics["epochs"]:
                epoch = decode(message.data, expect=ScheduleEpoch)
                verdict = p.coordinator.consider(epoch)
                self._log.debug("epoch %d from %s: %s", epoch.epoch, epoch.coordinator, verdict)
        except ProtocolError as e:
            self.metrics.count_gossip_dropped("malformed")
            self._log.debug("dropping malformed gossip on %s: %s", message.topic, e)
