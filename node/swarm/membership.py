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
from typing import TYPE_CHECKING

from node.swarm.gossip import GossipMessage
from node.swarm.states import NodeState
from protocol.errors import ProtocolError
from protocol.messages import LinkReport, MembershipEvent, ScheduleEpoch, decode, encode

if TYPE_CHECKING:
    from node.swarm.host import SwarmHost

__all__ = ["Membership", "gossip_topics"]

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


class Membership:
    """Keeps our adverts fresh, the view current, gossip connected and the coordinator ticking."""

    def __init__(self, daemon: "SwarmHost"):
        self.daemon = daemon
        self.topics = gossip_topics(daemon.config.run_id)
        #: Seconds the last announce / view refresh took (exposed in status: load indicator).
        self.last_announce_s = 0.0
        self.last_refresh_s = 0.0
        #: Completed view refreshes (status: lets a test wait for "the view has been re-read").
        self.view_refreshes = 0
        self.refresh_now = asyncio.Event()
        self._heartbeats = 0
        self._gossip_dialing: set[str] = set()

    @property
    def _log(self):
        return self.daemon.log

    # ------------------------------------------------------------------ adverts
    def advert_ttl_s(self) -> float:
        """Advert lifetime: the configured TTL, stretched when stores are slow.

        The next advert lands one heartbeat plus one store duration after this one was sent, so
        a lifetime shorter than ``heartbeat + 2 x store time`` makes a healthy node flap out of
        views on an overloaded machine; we keep a margin of 3 store durations.
        """
        cfg = self.daemon.config
        return max(cfg.advert_ttl_s, cfg.heartbeat_s + TTL_STORE_MARGIN * self.last_announce_s)

    async def announce(self) -> None:
        d = self.daemon
        advert = d.advert()
        ttl = self.advert_ttl_s()
        await d.adverts.announce(advert, ttl)
        d.view.set_self(advert, d.identity.public_key_bytes, time.time() + ttl)

    async def refresh_view(self) -> None:
        d = self.daemon
        fetched = await d.adverts.fetch_all(d.run.num_stages)
        fetched.pop(d.peer_id, None)  # our own entry is set locally, never from the DHT
        d.view.update_from_dht(fetched)

    async def heartbeat_loop(self) -> None:
        """Re-announce our adverts on a fixed beat, never delayed by view or schedule work."""
        d = self.daemon
        while True:
            t0 = time.monotonic()
            try:
                self._heartbeats += 1
                if d.state == NodeState.JOINING and self._heartbeats > JOINING_HEARTBEATS:
                    d.state = NodeState.ONLINE
                    await self.announce()
                    self.publish_event("join")
                else:
                    await self.announce()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - one failed heartbeat must not kill the daemon
                self._log.exception("advert announce failed")
            self.last_announce_s = time.monotonic() - t0
            await asyncio.sleep(max(0.0, d.config.heartbeat_s - self.last_announce_s))

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
        d = self.daemon
        rounds = 0
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.refresh_now.wait(), timeout=d.config.heartbeat_s)
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
                await d.coordinator.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001
                self._log.exception("view refresh failed")
            self.last_refresh_s = time.monotonic() - t0

    def update_view_metrics(self) -> None:
        d = self.daemon
        d.metrics.set_peer_states(e.state for e in d.view.peers.values())
        epoch = d.current_epoch
        d.metrics.set_schedule_epoch(epoch.epoch if epoch else None)

    async def maintain_gossip(self) -> None:
        """Keep up to ``gossip_target_peers`` gossip connections, to peers found in the DHT."""
        d = self.daemon
        connected = d.gossip.connected_peers()
        wanted = d.config.gossip_target_peers - len(connected)
        if wanted <= 0:
            return
        candidates = [
            e
            for e in d.view.alive()
            if e.peer_id != d.peer_id
            and e.advert.gossip_peer_id
            and e.advert.gossip_peer_id not in connected
            and e.advert.gossip_peer_id not in self._gossip_dialing
            and e.advert.gossip_maddrs
        ]
        # Spread connections: start after our own id in the ring so the mesh is not a star.
        candidates.sort(key=lambda e: (e.peer_id <= d.peer_id, e.peer_id))
        for entry in candidates[:wanted]:
            gid = entry.advert.gossip_peer_id
            self._gossip_dialing.add(gid)
            task = asyncio.create_task(d.gossip.connect(gid, list(entry.advert.gossip_maddrs)))
            task.add_done_callback(lambda _t, gid=gid: self._gossip_dialing.discard(gid))

    async def admission_loop(self) -> None:
        """Each heartbeat: data nodes (the coordinator candidates) challenge the candidates, every node
        probes the epoch's members (:mod:`node.swarm.admission`); a changed verdict wakes the view loop."""
        d = self.daemon
        while True:
            await asyncio.sleep(d.config.heartbeat_s)
            try:
                epoch = d.current_epoch
                candidates = [e for e in d.view.online() if e.peer_id != d.peer_id] if 0 in d.stages else []
                if await d.admission.round(candidates, epoch.members if epoch is not None else ()):
                    self.refresh_now.set()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - one failed round must not stop admissions
                self._log.exception("admission round failed")

    # ------------------------------------------------------------------ epochs
    async def adopt_epoch_from_dht(self) -> None:
        d = self.daemon
        for epoch, _owner in await d.adverts.fetch_epochs():
            d.coordinator.consider(epoch)

    async def publish_epoch(self, epoch: ScheduleEpoch) -> None:
        self.daemon.gossip.publish(self.topics["epochs"], encode(epoch))
        await self.daemon.adverts.store_epoch(epoch, EPOCH_RECORD_TTL_S)

    # ------------------------------------------------------------------ gossip
    def publish_event(self, kind: str) -> None:
        d = self.daemon
        event = MembershipEvent(run_id=d.config.run_id, peer_id=d.peer_id, kind=kind, stages=tuple(d.stages),
                                timestamp=time.time())
        d.gossip.publish(self.topics["membership"], encode(event))

    def publish_links(self, report: LinkReport) -> None:
        self.daemon.gossip.publish(self.topics["links"], encode(report))

    def on_gossip(self, message: GossipMessage) -> None:
        d = self.daemon
        if d.gossip is not None and message.from_gossip_id == d.gossip.peer_id:
            return
        if not d.gossip_access.allowed(message.from_gossip_id):
            return
        try:
            if message.topic == self.topics["membership"]:
                event = decode(message.data, expect=MembershipEvent)
                if not d.view.on_membership(event, message.from_gossip_id) and event.kind != "leave":
                    self.refresh_now.set()  # a newcomer we have not read from the DHT yet
                elif event.kind == "leave":
                    self.refresh_now.set()
            elif message.topic == self.topics["links"]:
                d.view.on_link_report(decode(message.data, expect=LinkReport), message.from_gossip_id)
            elif message.topic == self.topics["epochs"]:
                epoch = decode(message.data, expect=ScheduleEpoch)
                verdict = d.coordinator.consider(epoch)
                self._log.debug("epoch %d from %s: %s", epoch.epoch, epoch.coordinator, verdict)
        except ProtocolError as e:
            d.metrics.count_gossip_dropped("malformed")
            self._log.debug("dropping malformed gossip on %s: %s", message.topic, e)
