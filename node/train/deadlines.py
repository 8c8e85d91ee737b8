"""Deadlines of microbatches: from observed round trips once there are enough, else from the cost model.

Why not a fixed timeout: a hop on a 5 ms LAN link and one across an ocean at 100 MB/s differ by
two orders of magnitude, so any constant is either too slow to notice a dead LAN peer or fires on
every healthy WAN hop. Each hop gets a budget from the same cost model the scheduler plans with
(compute of the receiving stage + transfer over that link, forward and backward), scaled by a
slack factor and floored; a microbatch's deadline is the sum of its route's hop budgets plus the
queueing the simulator predicts for the whole schedule (microbatches wait behind each other at
busy nodes, which a single-path sum cannot see). Only the data node enforces it: it is the one
place that sees a microbatch from its first forward to its last backward.

The cost model is only a model: on a box shared with other work a microbatch took 5x its estimate,
and fixed budgets dropped microbatch after microbatch. So the data node also keeps the round trips
it measured on each route (:class:`ObservedBudgets`) and, once a route has enough of them, gives its
microbatches ``median + k x MAD`` of those (:func:`robust_budget`), within a floor and a cap. The floor is
at least the cost model's own floors for that route (per microbatch and per hop: dispatch, stream
opens, GC pauses), so observation replaces the model's estimates, never the margins. Median and
MAD, not mean and deviation: one stalled microbatch must not double every later budget. A microbatch
that misses its deadline counts with the time it was given (a lower bound of its real time), so a
swarm that slowed down for good raises its budgets within a few misses instead of dropping forever.
"""

from __future__ import annotations

import collections
import logging
import statistics
from dataclasses import dataclass
from typing import Callable, Deque, Dict, Hashable, Optional, Sequence, Tuple

from scheduler.cost import CostMatrix
from scheduler.schedule import Schedule
from scheduler.simulator import simulate

__all__ = ["DeadlineConfig", "HopDeadlines", "ObservedDeadlineConfig", "ObservedBudgets", "median_mad", "robust_budget"]

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

    def floors_s(self, route: Sequence[str]) -> float:
        """The part of :meth:`microbatch_budget_s` that is no estimate: the per-microbatch floor and each hop's
        floor, forward and backward (what an observed budget never goes below)."""
        return self.cfg.floor_s + 2 * self.cfg.per_hop_floor_s * max(0, len(route) - 1)

    def microbatch_budget_s(self, route: Sequence[str]) -> float:
        """Deadline of a microbatch on ``route`` (peer ids, starting and ending at its data node)."""
        total = self.cfg.floor_s + self.cfg.slack * self.makespan_s
        for a, b in zip(route, route[1:]):
            total += self.hop_budget_s(a, b, "forward") + self.hop_budget_s(b, a, "backward")
        return total


@dataclass(frozen=True)
class ObservedDeadlineConfig:
    """How observed round trips become budgets (see the module docstring)."""

    #: False: the cost model's budgets only (the control run of a straggler benchmark)
    enabled: bool = True
    #: round trips kept per route: about ten iterations of one data node's microbatches on a route, recent
    #: enough to follow a change of load within a few iterations, many enough that the median ignores
    #: the odd stalled or dropped microbatch
    window: int = 48
    #: below this many samples of a route the cost model's budget applies: the MAD of a few values is
    #: no measure of spread (it is 0 for two equal ones)
    min_samples: int = 8
    #: MADs above the median. For normally spread times one MAD is ~0.67 standard deviations, so 8 MADs
    #: are ~5 of them; load spikes have heavier tails, which ``min_ratio`` and ``floor_s`` absorb
    k: float = 8.0
    #: the budget is at least this many times the median: the MAD is 0 when recent times are all equal
    #: (a tiny model on an idle box), and a microbatch may still wait once behind another at a busy hop
    min_ratio: float = 1.5
    #: no budget below this, nor below the route's floors in the cost model (:meth:`HopDeadlines.floors_s`):
    #: a GC pause, a slow stream open or a thread hand-off on a loaded box takes ~0.1-1 s each, several
    #: per route
    floor_s: float = 5.0
    #: no budget above this: a microbatch two minutes late (25x the median iteration of ``skippipe up``
    #: on a box at load 12-16) is lost, not slow; the trainer also caps every budget at a fraction of
    #: its iteration timeout
    cap_s: float = 120.0

    def __post_init__(self) -> None:
        if self.window < self.min_samples or self.min_samples < 3:
            raise ValueError(f"need window >= min_samples >= 3: {self}")
        if not (0.0 <= self.k and 1.0 <= self.min_ratio and 0.0 < self.floor_s <= self.cap_s):
            raise ValueError(f"need k >= 0, min_ratio >= 1 and 0 < floor_s <= cap_s: {self}")


def median_mad(samples: Sequence[float]) -> Tuple[float, float]:
    """Median and median absolute deviation of ``samples`` (order-free); the spread every observed time
    here is judged by (deadlines, hedges, the report)."""
    values = sorted(float(x) for x in samples)
    if not values:
        raise ValueError("no samples")
    med = statistics.median(values)
    return med, statistics.median(sorted(abs(x - med) for x in values))


def robust_budget(samples: Sequence[float], cfg: ObservedDeadlineConfig, floor_s: float = 0.0) -> float:
    """``median + k x MAD`` of ``samples`` (seconds), at least ``min_ratio x median``, within
    ``[max(cfg.floor_s, floor_s), cap_s]``. Pure: the same samples in any order give the same budget."""
    med, mad = median_mad(samples)
    return min(cfg.cap_s, max(cfg.floor_s, floor_s, med + cfg.k * mad, med * cfg.min_ratio))


class ObservedBudgets:
    """Recent round trips per key (a data node's routes) and the budgets they give."""

    def __init__(self, cfg: ObservedDeadlineConfig = ObservedDeadlineConfig()):
        self.cfg = cfg
        self._windows: Dict[Hashable, Deque[float]] = {}
        self._floors: Dict[Hashable, float] = {}  # the last route floor asked with, per key (for the report)
        self.last: Optional[Tuple[str, float]] = None  # (basis: "observed" or "cost model", budget) last given

    def observe(self, key: Hashable, seconds: float) -> None:
        """One round trip of ``seconds`` on ``key`` (a missed deadline counts with the time it was given)."""
        window = self._windows.get(key)
        if window is None:
            window = self._windows[key] = collections.deque(maxlen=self.cfg.window)
        window.append(max(0.0, float(seconds)))

    def samples(self, key: Hashable) -> Tuple[float, ...]:
        return tuple(self._windows.get(key, ()))

    def budget_s(self, key: Hashable, floor_s: Optional[float] = None) -> Optional[float]:
        """The observed budget of ``key``, at least ``floor_s`` (its route's floors; default: the last given);
        None until it has ``min_samples`` round trips."""
        if floor_s is not None:
            self._floors[key] = float(floor_s)
        window = self._windows.get(key)
        if not self.cfg.enabled or window is None or len(window) < self.cfg.min_samples:
            return None
        return robust_budget(window, self.cfg, self._floors.get(key, 0.0))

    def report(self) -> dict:
        """What the training RPC shows: the basis and size of the last budget given, and per route seen the
        samples kept, their median and MAD, and the budget they give (None below ``min_samples``)."""
        routes = []
        for key, window in self._windows.items():
            med, mad = median_mad(window)
            routes.append({"route": [str(p)[-8:] for p in key] if isinstance(key, tuple) else str(key),
                           "samples": len(window), "median_s": med, "floor_s": self._floors.get(key, 0.0),
                           "mad_s": mad, "budget_s": self.budget_s(key)})
        return {"last_basis": self.last[0] if self.last else None, "last_budget_s": self.last[1] if self.last else None,
                "routes": routes}
