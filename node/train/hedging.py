"""Hedged microbatches: one that is late is sent again on another route before it is given up.

A data node sees a microbatch from its first forward to its last backward, but not where it is in
between: a microbatch that has not come back by its *hedge time* is started again as a new attempt on
a route through other replicas of the same stages (:meth:`node.train.recovery.RouteRecovery.hedge_route`),
while the original stays alive. The first attempt whose activation comes back to the data node
wins: only its loss is computed and only its gradient flows back, so no stage ever runs the backward
of two attempts of one microbatch and no gradient is counted twice. The other attempt is discarded
by its (iteration, microbatch, attempt) identity: its frames that still come are ignored like those
of any given-up attempt. A backward is never hedged: its autograd state lives on the nodes of its route.

The hedge time is a fraction of the microbatch's budget, or earlier where the route's observed round
trips say the microbatch is already far slower than usual (``median + k x MAD``), never before a floor.
A hedge duplicates work, so few are sent: one per microbatch and at most a fraction of an
iteration's microbatches (a swarm where most microbatches are late is loaded, not held up by a straggler).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

from node.train.deadlines import median_mad

__all__ = ["HedgeConfig", "HedgeCounters", "hedge_after_s", "hedges_allowed"]


@dataclass(frozen=True)
class HedgeConfig:
    """When a data node hedges a microbatch (see the module docstring)."""

    #: False: never hedge (the control run of a straggler benchmark)
    enabled: bool = True
    #: hedge once a microbatch has used this fraction of its budget: half leaves the hedge a whole
    #: typical round trip (budgets are several of them) to finish before the original's deadline
    budget_fraction: float = 0.5
    #: with enough observed round trips of the route, hedge already at ``median + k x MAD`` of them:
    #: 4 MADs (~2.7 standard deviations of normally spread times) is rarely reached by a healthy one
    k: float = 4.0
    #: ... and at least this many medians: when recent round trips are all equal their MAD is 0, and a
    #: microbatch may still wait once behind another at a busy hop
    min_ratio: float = 2.0
    #: observed round trips of a route needed before they move the hedge time (the MAD of a few values
    #: is no measure of spread); the same count the observed deadlines wait for
    min_samples: int = 8
    #: never hedge sooner: a stream open, a GC pause and a thread hand-off on a loaded box take ~0.1-1 s
    #: each, and hedging a microbatch that is merely queued only adds load
    floor_s: float = 2.0
    #: hedges of one microbatch: one other route is enough to route around one straggler, and each
    #: hedge is a whole microbatch of extra work
    max_per_microbatch: int = 1
    #: hedges of one iteration, as a fraction of the data node's microbatches (rounded up): a stuck
    #: replica of a two-replica stage holds about half of them; more late than that means the swarm is
    #: loaded, and duplicating work would only load it more
    max_iteration_fraction: float = 0.5

    def __post_init__(self) -> None:
        if not (0.0 < self.budget_fraction < 1.0 and self.k >= 0.0 and self.min_ratio >= 1.0 and self.floor_s >= 0.0
                and self.min_samples >= 3 and self.max_per_microbatch >= 0 and 0.0 <= self.max_iteration_fraction <= 1.0):
            raise ValueError(f"need 0 < budget_fraction < 1, k >= 0, min_ratio >= 1, floor_s >= 0, min_samples >= 3, "
                             f"max_per_microbatch >= 0 and 0 <= max_iteration_fraction <= 1: {self}")


def hedge_after_s(budget_s: float, samples: Sequence[float], cfg: HedgeConfig) -> float:
    """Seconds after its start at which a microbatch with ``budget_s`` is hedged if it has not come back;
    ``samples``: observed round trips of its route. Never later than ``budget_fraction`` of the budget
    (nor than the budget itself), never sooner than ``floor_s``. Pure."""
    after = cfg.budget_fraction * budget_s
    if len(samples) >= cfg.min_samples:
        med, mad = median_mad(samples)
        after = min(after, max(med + cfg.k * mad, med * cfg.min_ratio))
    return min(budget_s, max(cfg.floor_s, after))


def hedges_allowed(microbatches: int, cfg: HedgeConfig) -> int:
    """Hedges a data node may send in an iteration of ``microbatches`` of its own."""
    if not cfg.enabled or microbatches <= 0 or cfg.max_per_microbatch <= 0:
        return 0
    return max(1, math.ceil(cfg.max_iteration_fraction * microbatches))


@dataclass
class HedgeCounters:
    """What a data node's hedges did over the run (the training RPC's ``recovery.hedges``)."""

    #: hedges started
    sent: int = 0
    #: microbatches whose hedge came back first
    won: int = 0
    #: attempts given up because another attempt of the same microbatch came back first (the original
    #: when the hedge won, the hedge when the original did)
    discarded: int = 0

    def report(self) -> dict:
        return asdict(self)
