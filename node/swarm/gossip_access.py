"""Access control on gossip: only senders named by an accepted advert may speak.

With a swarm key or an allowlist, a gossip message counts only if its sender's gossip id belongs
to a peer whose advert we accepted (adverts carry the swarm-key proof and are checked against the
allowlist when stored). Dropped senders are counted per id (for ``status``) and logged at most
once per :data:`DROPPED_GOSSIP_LOG_EVERY_S`, so a flooding intruder cannot flood the log too.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable

from node.net.access import SwarmAccess
from node.ops.metrics import NodeMetrics
from node.swarm.view import SwarmView

__all__ = ["GossipAccessControl"]

logger = logging.getLogger(__name__)

#: One warning per gossip sender that is dropped by access control at most this often.
DROPPED_GOSSIP_LOG_EVERY_S = 30.0
#: Distinct dropped gossip senders remembered (for status); the table restarts when full.
MAX_TRACKED_DROPPED_SENDERS = 1024
#: Distinct senders whose last warning time is remembered; the table restarts when full.
MAX_TRACKED_LOG_TIMES = 1024
#: Dropped gossip senders listed in status (the most frequent ones).
STATUS_DROPPED_SENDERS = 20


class GossipAccessControl:
    """Decides per gossip message whether its sender may speak; remembers who was dropped."""

    def __init__(self, access: Callable[[], SwarmAccess], view: Callable[[], SwarmView | None],
                 peer_allowed: Callable[[str], bool], metrics: NodeMetrics,
                 log: logging.LoggerAdapter | logging.Logger = logger):
        # callables: the daemon replaces its access settings and view during start-up
        self._access, self._view, self._peer_allowed = access, view, peer_allowed
        self._metrics, self._log = metrics, log
        self._logged_at: dict[str, float] = {}
        #: Gossip messages dropped by access control, per sending gossip id (bounded).
        self.dropped_from: collections.Counter[str] = collections.Counter()

    def allowed(self, gossip_id: str) -> bool:
        """With access control on, only gossip ids named by an accepted advert may speak."""
        if not self._access().enabled:
            return True
        view = self._view()
        entry = view.by_gossip_id(gossip_id) if view is not None else None
        if entry is not None and self._peer_allowed(entry.peer_id):
            return True
        self._metrics.count_gossip_dropped("not_allowed")
        if gossip_id not in self.dropped_from and len(self.dropped_from) >= MAX_TRACKED_DROPPED_SENDERS:
            self.dropped_from.clear()
        self.dropped_from[gossip_id] += 1
        now = time.monotonic()
        if now - self._logged_at.get(gossip_id, -DROPPED_GOSSIP_LOG_EVERY_S) >= DROPPED_GOSSIP_LOG_EVERY_S:
            if len(self._logged_at) > MAX_TRACKED_LOG_TIMES:
                self._logged_at.clear()
            self._logged_at[gossip_id] = now
            self._log.warning("dropping gossip from %s: not an allowed member of this swarm", gossip_id)
        return False

    def most_dropped(self) -> dict[str, int]:
        """The most frequently dropped senders (for ``status``)."""
        return dict(self.dropped_from.most_common(STATUS_DROPPED_SENDERS))
