"""One node's live picture of the swarm: peers, their stages and states, and measured links.

Two sources feed it, with different jobs:

* the DHT adverts (signed, expiring) are the authority on *who exists*: a peer is in the view
  while its advert is live, and leaves when the advert expires (SIGKILL, network loss);
* gossip is the fast path: a signed ``leave`` event removes a peer at once on clean shutdown, a
  ``join`` makes a newcomer visible before the next DHT refresh, and ``LinkReport``s fill in the
  link table. Gossip is only trusted for peers whose advert names the sending gossip id.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable

from node.swarm.states import HOLDING_STATES, NodeState
from protocol.messages import PEER_STATE_ORDER, LinkReport, MembershipEvent, Reachability, StageAdvert
from scheduler.reachability import LinkKind, link_kind

__all__ = ["PeerEntry", "LinkStat", "SwarmView", "STATES"]

#: Advert states in lifecycle order.
STATES = PEER_STATE_ORDER


@dataclass
class LinkStat:
    """One direction of a link as measured by ``src``."""

    rtt_ms: float
    bandwidth_Bps: float | None
    measured_at: float


@dataclass
class PeerEntry:
    """What the view knows about one peer."""

    advert: StageAdvert
    public_key: bytes
    expires_at: float
    last_seen: float
    #: "dht" or "gossip": which source last refreshed this entry.
    source: str = "dht"
    #: Time of a signed gossip ``leave``: the peer is gone even if its (older) advert is still live.
    left_at: float | None = None

    @property
    def peer_id(self) -> str:
        return self.advert.peer_id

    @property
    def state(self) -> str:
        if self.left_at is not None and self.left_at >= self.advert.timestamp:
            return NodeState.OFFLINE
        return self.advert.state

    def to_json(self) -> dict:
        a = self.advert
        return {
            "peer_id": a.peer_id,
            "gossip_peer_id": a.gossip_peer_id,
            "stages": list(a.stages),
            "state": self.state,
            "maddrs": list(a.maddrs),
            "gossip_maddrs": list(a.gossip_maddrs),
            "compute_s_per_sample_per_layer": a.compute_s_per_sample_per_layer,
            "measured_compute_s_per_sample_per_layer": a.measured_compute_s_per_sample_per_layer,
            "memory_slots": a.memory_slots,
            "free_slots": a.free_slots,
            "protocol_version": a.protocol_version,
            "rpc_port": a.rpc_port,
            "location": a.location,
            "config_digest": a.config_digest,
            "reachability": a.reachability,
            "relay": a.relay,
            "ready": a.ready,
            "last_seen": self.last_seen,
            "age_s": round(time.time() - self.last_seen, 3),
            "source": self.source,
        }


@dataclass
class SwarmView:
    """Merged DHT + gossip table. Pure bookkeeping: no I/O, safe to call from any coroutine."""

    run_id: str
    self_id: str
    peers: dict[str, PeerEntry] = field(default_factory=dict)
    #: links[src][dst] as reported by src (our own probes are stored under self_id).
    links: dict[str, dict[str, LinkStat]] = field(default_factory=dict)
    #: Incremented whenever the set of (peer, state, stages) changes.
    version: int = 0
    changed_at: float = field(default_factory=time.monotonic)

    # ------------------------------------------------------------------ updates
    def update_from_dht(self, fetched: dict, now: float | None = None) -> None:
        """Replace the DHT-derived membership with ``fetched`` (peer id -> FetchedAdvert)."""
        now = time.time() if now is None else now
        before = self._signature()
        for peer_id, item in fetched.items():
            if item.expiration_time <= now:
                continue
            entry = self.peers.get(peer_id)
            if entry is None or item.advert.timestamp >= entry.advert.timestamp:
                self.peers[peer_id] = PeerEntry(
                    advert=item.advert,
                    public_key=item.public_key,
                    expires_at=item.expiration_time,
                    last_seen=max(item.advert.timestamp, entry.last_seen if entry else 0.0),
                    source="dht",
                    left_at=entry.left_at if entry else None,
                )
            else:
                entry.expires_at = max(entry.expires_at, item.expiration_time)
        for peer_id in list(self.peers):
            if peer_id == self.self_id:
                continue
            entry = self.peers[peer_id]
            if peer_id not in fetched and entry.expires_at <= now:
                del self.peers[peer_id]
                self.links.pop(peer_id, None)
                for row in self.links.values():
                    row.pop(peer_id, None)
        self._note_change(before)

    def set_self(self, advert: StageAdvert, public_key: bytes, expires_at: float) -> None:
        before = self._signature()
        self.peers[advert.peer_id] = PeerEntry(advert, public_key, expires_at, advert.timestamp, "self")
        self._note_change(before)

    def gossip_sender_ok(self, peer_id: str, gossip_id: str) -> bool:
        """Gossip about ``peer_id`` is trusted only from the gossip id its signed advert names."""
        entry = self.peers.get(peer_id)
        return entry is not None and entry.advert.gossip_peer_id == gossip_id

    def on_membership(self, event: MembershipEvent, gossip_id: str) -> bool:
        """Apply a gossip membership event; returns whether it was accepted."""
        if event.run_id != self.run_id or not self.gossip_sender_ok(event.peer_id, gossip_id):
            return False
        entry = self.peers[event.peer_id]
        before = self._signature()
        if event.kind == "leave":
            entry.left_at = max(event.timestamp, entry.advert.timestamp)
        entry.last_seen = max(entry.last_seen, event.timestamp)
        entry.source = "gossip"
        self._note_change(before)
        return True

    def on_link_report(self, report: LinkReport, gossip_id: str | None) -> bool:
        if report.run_id != self.run_id:
            return False
        if gossip_id is not None and not self.gossip_sender_ok(report.src, gossip_id):
            return False
        row = self.links.setdefault(report.src, {})
        for dst, rtt in report.rtt_ms.items():
            if dst in self.peers:
                row[dst] = LinkStat(float(rtt), report.bandwidth_Bps.get(dst), report.timestamp)
        return True

    # ------------------------------------------------------------------ queries
    def alive(self) -> list[PeerEntry]:
        """Peers not known to have left, sorted by peer id."""
        return [self.peers[p] for p in sorted(self.peers) if self.peers[p].state != NodeState.OFFLINE]

    def online(self) -> list[PeerEntry]:
        return [e for e in self.alive() if e.state == NodeState.ONLINE]

    def missing_stages(self, num_stages: int) -> list[int]:
        """Stages of ``range(num_stages)`` that no live peer holding its stages (ONLINE or DRAINING) holds."""
        held = {s for e in self.alive() if e.state in HOLDING_STATES for s in e.advert.stages}
        return [s for s in range(num_stages) if s not in held]

    def get(self, peer_id: str) -> PeerEntry | None:
        return self.peers.get(peer_id)

    def reachability_of(self, peer_id: str) -> str:
        """``peer_id``'s advertised reachability; ``unknown`` for a peer we know nothing of."""
        entry = self.peers.get(peer_id)
        return entry.advert.reachability if entry is not None else Reachability.UNKNOWN.value

    def reaches(self, own: str, peer_id: str) -> bool:
        """Whether a node of reachability ``own`` and ``peer_id`` can be connected at all (directly or
        through a relay; :func:`scheduler.reachability.link_kind`). A peer we know nothing of counts as
        reachable, as an ``unknown`` reachability does."""
        return link_kind(own, self.reachability_of(peer_id)) is not LinkKind.IMPOSSIBLE

    def by_gossip_id(self, gossip_id: str) -> PeerEntry | None:
        for entry in self.peers.values():
            if entry.advert.gossip_peer_id == gossip_id:
                return entry
        return None

    def link(self, src: str, dst: str) -> LinkStat | None:
        """Best knowledge of src->dst: src's own report, else dst's report of the reverse link."""
        return self.links.get(src, {}).get(dst) or self.links.get(dst, {}).get(src)

    def to_json(self) -> dict:
        return {
            "run_id": self.run_id,
            "self": self.self_id,
            "version": self.version,
            "peers": [e.to_json() for e in (self.peers[p] for p in sorted(self.peers))],
            "links": [
                {
                    "src": src,
                    "dst": dst,
                    "rtt_ms": round(stat.rtt_ms, 3),
                    "bandwidth_Bps": stat.bandwidth_Bps,
                    "measured_at": stat.measured_at,
                }
                for src in sorted(self.links)
                for dst, stat in sorted(self.links[src].items())
            ],
        }

    # ------------------------------------------------------------------ internals
    def _signature(self) -> frozenset:
        return frozenset((p, e.state, tuple(e.advert.stages), e.advert.reachability) for p, e in self.peers.items())

    def _note_change(self, before: frozenset) -> None:
        if self._signature() != before:
            self.version += 1
            self.changed_at = time.monotonic()

    def membership(self, peers: Iterable[PeerEntry] | None = None) -> frozenset:
        """Hashable summary of the ONLINE membership (what an epoch is computed from)."""
        peers = self.online() if peers is None else peers
        return frozenset((e.peer_id, tuple(e.advert.stages)) for e in peers)
