"""Link probes: RTT and bandwidth to a few peers per round, shared with the swarm by gossip.

The coordinator's schedules need link costs. Each round probes ``link_probe_peers_per_round``
peers (round-robin over the view, so every link gets measured eventually without probing all of
them every round) and publishes one :class:`LinkReport`; the view keeps the freshest per link.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from hivemind.p2p import P2P, PeerID

from node.net.ping import PING_PROTOCOL, probe_link
from node.swarm.config import DaemonConfig
from node.swarm.view import SwarmView
from protocol.messages import LinkReport

__all__ = ["PING_PROTOCOL", "PROBE_TIMEOUT_S", "LinkProber"]

logger = logging.getLogger(__name__)

#: RTT samples per probe (the minimum is reported: queueing only ever adds delay).
PING_SAMPLES = 3
#: Seconds one link probe may take before the peer counts as unreachable for this round.
PROBE_TIMEOUT_S = 5.0


class LinkProber:
    """Runs the probe rounds (:meth:`loop`); :class:`node.net.ping.PingHandler` answers other nodes' probes."""

    def __init__(self, config: DaemonConfig, p2p: P2P, peer_id: str, view: SwarmView,
                 publish: Callable[[LinkReport], None], log: logging.LoggerAdapter | logging.Logger = logger):
        self.config, self.p2p, self.peer_id, self.view = config, p2p, peer_id, view
        self._publish, self._log = publish, log
        self._cursor = 0

    async def probe(self, peer_id: str) -> tuple[float, float | None]:
        """(min RTT in ms, bandwidth in bytes/s) to ``peer_id`` over our p2pd; the answers are read bounded."""
        return await probe_link(self.p2p, PeerID.from_base58(peer_id), self.config.link_probe_payload_bytes,
                                PING_SAMPLES)

    def _next_peers(self) -> list[str]:
        peers = [e.peer_id for e in self.view.alive() if e.peer_id != self.peer_id]
        if not peers:
            return []
        count = min(self.config.link_probe_peers_per_round, len(peers))
        chosen = [peers[(self._cursor + i) % len(peers)] for i in range(count)]
        self._cursor += count
        return chosen

    async def probe_round(self) -> LinkReport | None:
        """Probe the next few peers; the report of those that answered (None if none did)."""
        rtt_ms, bandwidth = {}, {}
        for peer in self._next_peers():
            try:
                rtt, bw = await asyncio.wait_for(self.probe(peer), PROBE_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - unreachable peers are routine
                self._log.debug("link probe to %s failed: %r", peer, e)
                continue
            rtt_ms[peer] = rtt
            if bw is not None:
                bandwidth[peer] = bw
        if not rtt_ms:
            return None
        return LinkReport(run_id=self.config.run_id, src=self.peer_id, timestamp=time.time(), rtt_ms=rtt_ms,
                          bandwidth_Bps=bandwidth)

    async def loop(self) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.heartbeat_s * cfg.link_probe_every_heartbeats)
            report = await self.probe_round()
            if report is not None:
                self.view.on_link_report(report, None)
                self._publish(report)
