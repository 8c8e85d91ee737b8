"""A daemon's own reachability: learned by dial-backs at start and re-learned while the node runs.

The founder of a swarm has nobody to ask at start, and a home router's mapping can change, so the node
asks again: often while it knows nothing (:data:`RECHECK_UNKNOWN_S`), rarely once it knows
(:data:`RECHECK_KNOWN_S`). What it learned goes into every advert (``StageAdvert.reachability``), the
status RPC and the one start-up line (:func:`node.net.reachability.advice_line`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from hivemind.p2p import PeerID

from node.net.reachability import (DIALBACK_PROTOCOL, DialbackHandler, ReachabilityReport, advice_line,
                                   learn_reachability)
from protocol.messages import Reachability

if TYPE_CHECKING:
    from node.swarm.host import SwarmHost

__all__ = ["ReachabilityWatch", "RECHECK_UNKNOWN_S", "RECHECK_KNOWN_S", "MAX_ASKED_PEERS"]

logger = logging.getLogger(__name__)

#: Seconds between dial-back rounds while nobody has answered: the first joiners arrive within seconds.
RECHECK_UNKNOWN_S = 10.0
#: Seconds between rounds once known: a router's mapping or a port forward changes rarely.
RECHECK_KNOWN_S = 300.0
#: Peers asked in one round: one answer decides, a few guard against one peer that cannot dial out.
MAX_ASKED_PEERS = 3


class ReachabilityWatch:
    """A daemon service: ``start(daemon)`` registers the dial-back handler, asks the initial peers (so the
    start-up line can say how others reach us; :meth:`learn` may have done that already) and keeps asking in
    the background; ``stop()`` ends that."""

    def __init__(self) -> None:
        self.daemon: "SwarmHost | None" = None
        self.report = ReachabilityReport(Reachability.UNKNOWN)
        self.handler = DialbackHandler()
        self._task: asyncio.Task | None = None

    @property
    def value(self) -> str:
        return self.report.reachability.value

    async def learn(self, daemon: "SwarmHost") -> None:
        """Register the dial-back handler and ask the first round (once): the daemon calls it before it picks its
        stage, since a node behind NAT must not take a stage whose replicas are all behind NAT too."""
        if self.daemon is not None:
            return
        self.daemon = daemon
        await daemon.p2p.add_binary_stream_handler(DIALBACK_PROTOCOL, self.handler)
        await self.check()

    async def start(self, daemon: "SwarmHost") -> None:
        await self.learn(daemon)
        self._task = asyncio.create_task(self.loop(), name="reachability")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _peers_to_ask(self) -> list[PeerID]:
        d = self.daemon
        entries = d.view.alive() if d.view is not None else []
        ids = [e.advert.peer_id for e in entries if e.advert.peer_id != d.peer_id
               and e.advert.reachability in (Reachability.DIRECT.value, Reachability.UNKNOWN.value)]
        asked = [p for p in d._initial_ids][:MAX_ASKED_PEERS]
        for peer in ids:
            if len(asked) >= MAX_ASKED_PEERS:
                break
            try:
                pid = PeerID.from_base58(peer)
            except Exception:  # noqa: BLE001 - a malformed id in an advert
                continue
            if pid not in asked:
                asked.append(pid)
        return asked

    async def check(self, peers: list[PeerID] | None = None) -> ReachabilityReport:
        d = self.daemon
        maddrs = [str(m) for m in await d.p2p.get_visible_maddrs(latest=True)]
        report = await learn_reachability(d.p2p, peers if peers is not None else self._peers_to_ask(), maddrs)
        if report.reachability is Reachability.UNKNOWN and self.report.reachability is not Reachability.UNKNOWN:
            return self.report  # nobody answered this time: keep what we knew
        if report.reachability is not self.report.reachability:
            d.log.info("%s", advice_line(report))
        self.report = report
        return report

    async def loop(self) -> None:
        while True:
            known = self.report.reachability is not Reachability.UNKNOWN
            await asyncio.sleep(RECHECK_KNOWN_S if known else RECHECK_UNKNOWN_S)
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a failed round is retried next time
                logger.debug("reachability round failed", exc_info=True)

    def line(self) -> str:
        return advice_line(self.report)

    def to_json(self) -> dict:
        r = self.report
        return {"reachability": r.reachability.value, "observed_ip": r.observed_ip, "ports": list(r.ports),
                "relays": list(r.relays), "answered_by": [a.peer for a in r.answers]}
