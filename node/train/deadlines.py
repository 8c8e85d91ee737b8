"""Per-hop deadlines of microbatches, from the scheduler's cost model.

Why not a fixed timeout: a hop on a 5 ms LAN link and one across an ocean at 100 MB/s differ by
two orders of magnitude, so any constant is either too slow to notice a dead LAN peer or fires on
every healthy WAN hop. Each hop gets a budget from the same cost model the scheduler plans with
(compute of the receiving stage + transfer over that link, forward and backward), scaled by a
slack factor and floored; a microbatch's deadline is the sum of its route's hop budgets plus the
queueing the simulator predicts for the whole schedule (microbatches wait behind each other at
busy nodes, which a single-path sum cannot see). Only the data node enforces it: it is the one
place that sees a microbatch from its first forward to its last backward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

from scheduler.cost import CostMatrix
from scheduler.schedule import Schedule
from scheduler.simulator import simulate

__all__ = ["DeadlineConfig", "HopDeadlines"]

logger = logging.getLogger(__name__)

#: (one-way latency in seconds, bandwidth in bytes/s) of the link to a peer, or None if unknown
LinkEstimate = Callable[[str, str], Optional[Tuple[float, float]]]


@dataclass(frozen=True)
class DeadlineConfig:
    #: budgets are this many times the cost model's estimate: CPU contention and Python scheduling
    #: on a shared volunteer box routinely triple a hop, and a false alarm costs a recomputation
    slack: float = 4.0
    #: added to every hop budget: a p2pd stream open and an executor hand-off take ~0.1-1 s under load
    per_hop_floor_s: float = 1.0
    #: added once per microbatch, so tiny models on fast links still survive a GC pause or a slow dial
    floor_s: float = 5.0
    #: link assumed when nothing is known about a pair (loopback-like, as the coordinator assumes)
    default_latency_s: float = 0.005
    default_bandwidth_Bps: float = 100e6
    #: backward / forward compute and loss / forward ratios (the scheduler's CostParams defaults)
    backward_ratio: float = 1.5
    loss_ratio: float = 0.25


class HopDeadlines:
    """Budgets for the microbatches of one schedule epoch.

    ``members``: peer ids by node index; ``forward_s``: estimated forward seconds of one microbatch at
    each node; ``activation_bytes``: size of one activation frame; ``link``: latency/bandwidth lookup.
    """

    def __init__(self, schedule: dict, members: Sequence[str], forward_s: Sequence[float], activation_bytes: int,
                 link: Optional[LinkEstimate] = None, cfg: DeadlineConfig = DeadlineConfig()):
        self.cfg, self.members = cfg, tuple(members)
        self._index = {p: i for i, p in enumerate(self.members)}
        n = len(self.members)
        self.forward_s = tuple(float(f) for f in forward_s)
        link_s, busy_s = [], []
        for u in range(n):
            row, busy = [], []
            for v in range(n):
                if u == v:
                    row.append(0.0), busy.append(0.0)
                    continue
                est = link(self.members[u], self.members[v]) if link is not None else None
                lat, bw = est if est is not None else (cfg.default_latency_s, cfg.default_bandwidth_Bps)
                busy.append(activation_bytes / max(float(bw), 1.0))
                row.append(float(lat) + busy[-1])
            link_s.append(tuple(row)), busy_s.append(tuple(busy))
        self.link_s = tuple(link_s)
        self.cost = CostMatrix(self.forward_s, self.link_s, cfg.backward_ratio, cfg.loss_ratio)
        try:
            # transfers on one link queue for it (as on a real link): a schedule whose routes collide
            # on a slow link takes that much longer, and its microbatches must be given that time
            self.makespan_s = float(simulate(Schedule.from_json(dict(schedule)), self.cost, record_timelines=False,
                                             link_busy_s=tuple(busy_s)).iteration_time_s)
        except Exception as e:  # noqa: BLE001 - a budget must exist even for a schedule the simulator rejects
            logger.warning("cannot simulate the schedule for deadlines (%r); using route sums only", e)
            self.makespan_s = 0.0

    def hop_budget_s(self, sender: str, receiver: str, direction: str) -> float:
        """Budget of one hop: transfer over the link plus the receiver's compute, times slack, plus floor."""
        u, v = self._index.get(sender), self._index.get(receiver)
        if u is None or v is None:
            transfer, compute = self.cfg.default_latency_s, max(self.forward_s, default=0.0)
        else:
            transfer, compute = self.link_s[u][v], self.forward_s[v]
        if direction == "backward":
            compute *= self.cfg.backward_ratio
        return self.cfg.slack * (transfer + compute) + self.cfg.per_hop_floor_s

    def microbatch_budget_s(self, route: Sequence[str]) -> float:
        """Deadline of a microbatch on ``route`` (peer ids, starting and ending at its data node)."""
        total = self.cfg.floor_s + self.cfg.slack * self.makespan_s
        for a, b in zip(route, route[1:]):
            total += self.hop_budget_s(a, b, "forward") + self.hop_budget_s(b, a, "backward")
        return total
