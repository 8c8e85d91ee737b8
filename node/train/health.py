"""Which peers a trainer may route microbatches through: the host's liveness view plus local suspicion.

The host's view (an advert not expired, not OFFLINE) answers "is the peer there"; a send that fails
or a norm that never comes makes this node *suspect* the peer for a while, like hivemind's
blacklist of peers that failed an averaging round: the ban starts at ``ban_s`` and doubles on each
repeat up to ``ban_max_s``. ``ban_s`` outlasts the advert TTL, so a dead peer is out of the view
before its ban ends, and a live one that hiccupped is routed to again soon.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, Dict, Iterable, Optional, Set, Tuple

from node.train.common import NodeLog

__all__ = ["PeerHealth", "gone_peers", "FAULTS_BEFORE_BAN"]

logger = logging.getLogger(__name__)

#: Faults of a member (a poisoned frame it sent us, a norm report far outside the others') this
#: node tolerates before it bans the member like a dead one. More than one: a single odd value may be
#: a fluke of an honest member (a loss spike at a boundary of the statistics); three in a row is a
#: pattern, and each costs at most one microbatch or one member's share of one norm exchange.
FAULTS_BEFORE_BAN = 3


def gone_peers(peers, is_alive: Callable[[str], bool], absent_since: Dict[str, float], now: float,
               grace_s: float) -> set:
    """The ``peers`` that have been out of the view for at least ``grace_s`` (``now`` monotonic).

    ``absent_since`` remembers when each peer was first seen absent and is updated in place: a peer
    seen alive again is forgotten, so a momentary lapse never adds up with a later one.
    """
    gone = set()
    for peer in peers:
        if is_alive(peer):
            absent_since.pop(peer, None)
            continue
        since = absent_since.setdefault(peer, now)
        if now - since >= grace_s:
            gone.add(peer)
    return gone


class PeerHealth:
    """Liveness and suspicion of the other members, as one node sees them."""

    def __init__(self, peer_id: str, *, alive: Optional[Callable[[str], bool]], self_alive: Callable[[], bool],
                 ban_s: float, ban_max_s: float, metrics=None, node_name: Optional[str] = None,
                 reaches: Optional[Callable[[str], bool]] = None):
        """``alive(peer)``: the host's membership oracle; None = every member counts as alive until a
        send to it fails. ``self_alive()``: False once this node was killed. ``reaches(peer)``: False where
        no connection between us can exist (both behind NAT, no relay); None = every peer can be reached."""
        self.peer_id = peer_id
        #: the host's membership oracle; replaceable (tests hide a live peer from one node's view)
        self.oracle = alive
        self._reaches = reaches
        self._self_alive = self_alive
        self.ban_s, self.ban_max_s = ban_s, ban_max_s
        self.metrics = metrics
        self.log = NodeLog(logger, node_name)
        self._bans: Dict[str, Tuple[float, float]] = {}  # peer -> (banned until, current back-off)
        self._absent_since: Dict[str, float] = {}  # peer -> when this node first saw it out of the view
        self._faults: Dict[str, int] = {}  # peer -> faults counted since its last ban
        #: faults counted per peer over the whole run (what the training RPC shows)
        self.faults_total: Dict[str, int] = {}

    def is_alive(self, peer: str) -> bool:
        if peer == self.peer_id:
            return self._self_alive()
        return self.oracle(peer) if self.oracle is not None else True

    def reaches(self, peer: str) -> bool:
        """Whether a message to ``peer`` can arrive at all. A control message (a norm report, an iteration's
        end) to a peer it cannot reach is not sent: the send could only fail and blame the peer for our
        network; what it says is in the DHT records, which the peer reads instead."""
        return self._reaches is None or peer == self.peer_id or self._reaches(peer)

    def suspected(self, peer: str) -> bool:
        entry = self._bans.get(peer)
        return entry is not None and entry[0] > time.monotonic()

    def usable(self, peer: str) -> bool:
        """This node, or a live peer that is not suspected: a peer new work may be routed through."""
        return peer == self.peer_id or (self.is_alive(peer) and not self.suspected(peer))

    def suspect(self, peer: str, why: str) -> None:
        """Ban ``peer`` from new routes for a back-off that doubles on each repeat (capped)."""
        if peer == self.peer_id:
            return
        _, backoff = self._bans.get(peer, (0.0, self.ban_s / 2))
        backoff = min(self.ban_max_s, backoff * 2)
        self._bans[peer] = (time.monotonic() + backoff, backoff)
        self.log.warning("suspecting %s for %.0fs: %s", peer[-8:], backoff, why)
        if self.metrics is not None:
            with contextlib.suppress(Exception):  # metrics never break training
                self.metrics.count_failure("suspect")

    def fault(self, peer: str, why: str, *, ban_now: bool = False) -> bool:
        """Count one misbehaviour of ``peer`` (poison it sent, a lying report); the
        :data:`FAULTS_BEFORE_BAN`-th since its last ban (or ``ban_now``) bans it. True if it was banned."""
        if peer == self.peer_id:
            return False
        self.faults_total[peer] = self.faults_total.get(peer, 0) + 1
        n = self._faults[peer] = self._faults.get(peer, 0) + 1
        if n < FAULTS_BEFORE_BAN and not ban_now:
            self.log.warning("fault %d/%d of %s: %s", n, FAULTS_BEFORE_BAN, peer[-8:], why)
            return False
        self._faults[peer] = 0
        self.suspect(peer, f"fault: {why}")
        return True

    def trusted(self, peer: str) -> bool:
        """Neither banned now nor ever caught misbehaving: a peer whose state may be copied."""
        return not self.suspected(peer) and not self.faults_total.get(peer)

    def suspects(self) -> Set[str]:
        """The peers banned right now."""
        now = time.monotonic()
        return {p for p, (until, _) in self._bans.items() if until > now}

    def gone(self, peers: Iterable[str], now: float, grace_s: float) -> Set[str]:
        """The ``peers`` out of the view for ``grace_s`` or longer (see :func:`gone_peers`)."""
        return gone_peers(peers, self.is_alive, self._absent_since, now, grace_s)
