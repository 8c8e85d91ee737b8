"""Link probes: RTT and bandwidth to a few peers per round, shared with the swarm by gossip.

The coordinator's schedules need link costs. Each round probes ``link_probe_peers_per_round``
peers (round-robin over the view, so every link gets measured eventually without probing all of
them every round) and publishes one :class:`LinkReport`; the view keeps the freshest per link.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Callable

from hivemind.p2p import P2P, PeerID

from node.swarm.config import DaemonConfig
from node.swarm.view import SwarmView
from protocol.messages import LinkReport

__all__ = ["PING_PROTOCOL", "PROBE_TIMEOUT_S", "LinkProber", "answer_ping"]

logger = logging.getLogger(__name__)

#: libp2p protocol id of the link probe (echo of small frames, 1-byte ack of large ones).
PING_PROTOCOL = "skippipe/ping/1"
#: Frames up to this size are echoed (RTT probes); larger ones are acknowledged (bandwidth).
PING_ECHO_MAX_BYTES = 64
#: RTT samples per probe (the minimum is reported: queueing only ever adds delay).
PING_SAMPLES = 3
#: Seconds one link probe may take before the peer counts as unreachable for this round.
PROBE_TIMEOUT_S = 5.0


async def answer_ping(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """The probe's far end: echo small frames (RTT), acknowledge large ones with one byte (bandwidth)."""
    try:
        while True:
            data = await P2P.receive_raw_data(reader)
            await P2P.send_raw_data(data if len(data) <= PING_ECHO_MAX_BYTES else b"\x01", writer)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


class LinkProber:
    """Runs the probe rounds (:meth:`loop`); :func:`answer_ping` answers other nodes' probes."""

    def __init__(self, config: DaemonConfig, p2p: P2P, peer_id: str, view: SwarmView,
                 publish: Callable[[LinkReport], None], log: logging.LoggerAdapter | logging.Logger = logger):
        self.config, self.p2p, self.peer_id, self.view = config, p2p, peer_id, view
        self._publish, self._log = publish, log
        self._cursor = 0

    handle_ping = staticmethod(answer_ping)

    async def probe(self, peer_id: str) -> tuple[float, float | None]:
        """(min RTT in ms, bandwidth in bytes/s) to ``peer_id`` over our p2pd."""
        _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), PING_PROTOCOL)
        try:
            rtts = []
            for _ in range(PING_SAMPLES):
                t0 = time.perf_counter()
                await P2P.send_raw_data(b"p", writer)
                await P2P.receive_raw_data(reader)
                rtts.append(time.perf_counter() - t0)
            rtt = min(rtts)
            payload = os.urandom(self.config.link_probe_payload_bytes)
            t0 = time.perf_counter()
            await P2P.send_raw_data(payload, writer)
            await P2P.receive_raw_data(reader)
            elapsed = time.perf_counter() - t0
            bandwidth = len(payload) / max(elapsed - rtt, elapsed / 2, 1e-6)
            return rtt * 1000.0, bandwidth
        finally:
            writer.close()

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
