"""Re-planning from measured compute: when a schedule epoch with the same members is worth issuing.

A schedule is planned with each member's compute speed. The start-up benchmark gives one figure, once; a
machine that becomes slow later (shared, throttled, paused, or slowed by the compute emulation) would keep
its full share of microbatches and hold up every iteration. So members advertise the speed they measure
while training (:mod:`node.train.compute_meter`), the coordinator plans with it (:func:`planning_compute`),
and it issues a new epoch for the same members when the speeds have moved away from those the current
epoch was planned with (:func:`replan_reason`).

Moving has a cost (an epoch switch at an iteration boundary, fresh deadlines to learn), so, following
Petals' rule that a server moves only when the swarm's throughput improves by more than a margin, it
re-plans only when all three hold: some member's speed *relative to the members' median* changed by more
than :attr:`ReplanPolicy.margin` (relative, so a box that slows down as a whole, which leaves the best
schedule as it is, never triggers one); the current epoch is at least :attr:`ReplanPolicy.min_interval_s`
old (so noise can never make epochs churn); and the new schedule's predicted iteration time, under the
measured costs, beats the current schedule's by :attr:`ReplanPolicy.min_gain` (:func:`worth_switching`).

A stage whose replicas together are too slow for the microbatches routed through it holds up every path that
visits it, however the microbatches are spread over its replicas. So the same first candidate may also move one
node that joined with ``--auto`` (it advertises ``movable``) from the stage with the most spare capacity to that
bottleneck stage (:func:`propose_move`), again only when the predicted throughput improves by more than
:attr:`ReplanPolicy.move_gain`: a move costs more than a re-plan (the mover drops its stage and downloads the
other's state), so a move that buys a few percent is never worth it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Collection, Mapping, Optional, Sequence

from scheduler.reachability import stranded_replicas

__all__ = ["ReplanPolicy", "StageMove", "planning_compute", "relative_speeds", "departure", "replan_reason",
           "worth_switching", "stage_times", "propose_move", "auto_stage"]


@dataclass(frozen=True)
class ReplanPolicy:
    #: re-plan from measurement at all (off: plan with the start-up benchmark only, and never re-plan for speed;
    #: the control of bench/stragglers.py)
    enabled: bool = True
    #: a member's compute time relative to the members' median must have changed by more than this factor since
    #: the epoch was planned: the running median a node advertises moves by ~10-30% on a box shared with other
    #: work, while a node slowed by half or more (1.5x) costs its routes a third of their time
    margin: float = 1.5
    #: seconds the current epoch must have run before a re-plan replaces it: a switch costs about one iteration
    #: boundary (and new routes' deadlines start from the cost model again); 20 s is several iterations at the
    #: 1-5 s per iteration seen on small swarms, so noise can switch at most once in that many, while a node
    #: that slowed for good is re-planned around within a few dozen seconds
    min_interval_s: float = 20.0
    #: the new schedule's predicted iteration must be this many times faster than the current one's under the
    #: same (measured) costs; below that the switch costs about what it buys (the simulator's own error is ~5%)
    min_gain: float = 1.1
    #: a node moves to another stage only if the swarm's predicted throughput (the slowest stage's time per
    #: iteration) improves by more than this factor: a move costs a stage build, a state download and an epoch
    #: switch, and the capacity figures come from medians that move by ~10-30% on a shared box; 1.25 keeps such
    #: noise from moving a node while a stage that is twice as slow as the next (a 2x gain) draws one at once
    move_gain: float = 1.25
    #: a move never leaves a stage with fewer replicas than this: one is what keeps the stage alive, and a move
    #: that emptied a stage would stop every path through it
    min_replicas: int = 1

    def __post_init__(self) -> None:
        if not (self.margin > 1 and self.min_interval_s >= 0 and self.min_gain >= 1 and self.move_gain >= 1
                and self.min_replicas >= 1):
            raise ValueError("ReplanPolicy needs margin > 1, min_interval_s >= 0, min_gain >= 1, move_gain >= 1 "
                             "and min_replicas >= 1")


@dataclass(frozen=True)
class StageMove:
    """One node to move to another stage at the next epoch, and the throughput factor it is predicted to buy."""

    peer: str
    from_stage: int
    to_stage: int
    gain: float


def planning_compute(startup: Sequence[float], measured: Sequence[Optional[float]],
                     use_measured: bool = True) -> list[float]:
    """Per member, the compute speed (s/sample/layer) to plan with: the measured one where there is one, in the
    start-up benchmark's units.

    The benchmark and the training steps time different work: the benchmark a reference layer shape (the one
    the cost model prices activations and links for), the steps this run's model. So a measurement says how a
    member compares with the others, and the median start-up / measured ratio of the members that have both
    converts it to the benchmark's scale; a member without a measurement yet (a joiner, a node before its
    first steps) keeps its start-up figure. With no measurement at all (or ``use_measured`` off) the start-up
    figures."""
    startup = [float(s) for s in startup]
    if not use_measured:
        return startup
    ratios = [s / m for s, m in zip(startup, measured) if m is not None and m > 0 and s > 0]
    if not ratios:
        return startup
    scale = statistics.median(ratios)
    return [float(m) * scale if m is not None and m > 0 else s for s, m in zip(startup, measured)]


def relative_speeds(compute: Sequence[float]) -> list[float]:
    """Each compute time divided by their median (all 1.0 when the median is not positive)."""
    mid = statistics.median(compute) if compute else 0.0
    return [float(c) / mid if mid > 0 else 1.0 for c in compute]


def departure(planned: Sequence[float], now: Sequence[float]) -> tuple[float, int]:
    """How far the relative compute times moved since planning: the largest factor (>= 1, either way) over
    members, and that member's index. Members whose planned or current time is not positive are left out."""
    worst, who = 1.0, -1
    for i, (p, n) in enumerate(zip(relative_speeds(planned), relative_speeds(now))):
        if p > 0 and n > 0:
            factor = max(n / p, p / n)
            if factor > worst:
                worst, who = factor, i
    return worst, who


def replan_reason(policy: ReplanPolicy, planned: Optional[Sequence[float]], now: Sequence[float],
                  epoch_age_s: float) -> Optional[str]:
    """Why a new epoch for the same members is due (None: it is not): the policy is on, the epoch has run
    ``min_interval_s``, and a member's relative compute time moved by more than ``margin`` from ``planned``
    (the current epoch's, None when unknown)."""
    if not policy.enabled or planned is None or len(planned) != len(now) or not now:
        return None
    if epoch_age_s < policy.min_interval_s:
        return None
    worst, who = departure(planned, now)
    if worst <= policy.margin:
        return None
    return f"member {who}'s measured compute moved {worst:.2f}x relative to the others (margin {policy.margin:g})"


def worth_switching(policy: ReplanPolicy, current_s: float, new_s: float) -> bool:
    """Does a schedule predicted at ``new_s`` per iteration beat the current one (``current_s`` under the same
    costs) by the policy's ``min_gain``?"""
    return new_s > 0 and current_s >= new_s * policy.min_gain


def stage_times(stage_of: Mapping[str, int], compute: Mapping[str, float], load: Sequence[float]) -> list[float]:
    """Per stage, the time its replicas together need for the microbatches routed through it (``load[s]``):
    load / capacity, where a replica's capacity is 1 / its compute time (the same layers per stage, so the unit
    cancels out when stages are compared). A stage with load and no replica (or no positive compute) is
    infinitely slow; one without load takes no time."""
    capacity = [0.0] * len(load)
    for peer, s in stage_of.items():
        c = compute.get(peer)
        if 0 <= s < len(load) and c is not None and c > 0:
            capacity[s] += 1.0 / float(c)
    return [0.0 if load[s] <= 0 else (float(load[s]) / capacity[s] if capacity[s] > 0 else math.inf)
            for s in range(len(load))]


def _slowest(times: Sequence[float]) -> tuple[float, int]:
    """The slowest stage other than stage 0 (the data nodes', whose microbatches are their own data): its time
    and index (the lowest index on ties); (0, -1) without such a stage."""
    best, who = 0.0, -1
    for s in range(1, len(times)):
        if times[s] > best:
            best, who = times[s], s
    return best, who


def propose_move(policy: ReplanPolicy, stage_of: Mapping[str, int], movable: Sequence[str] | set,
                 compute: Mapping[str, float], load: Sequence[float],
                 reachability: Optional[Mapping[str, str]] = None) -> Optional[StageMove]:
    """The move of one ``movable`` node into the bottleneck stage that the swarm gains most from, or None.

    ``stage_of``: member -> stage; ``compute``: member -> its compute time (measured where measured);
    ``load[s]``: microbatches the schedule routes through stage ``s`` per iteration. The bottleneck is the stage
    (other than 0) whose replicas need the longest for their load; the predicted iteration time is that
    longest stage time. A candidate is a movable node of another stage other than 0 (data nodes never move)
    that keeps at least ``min_replicas`` there; the best is the one whose move shortens the predicted time most
    (ties: from the stage with the most spare capacity, then by peer id), proposed when the throughput gain
    (old time / new time) exceeds ``move_gain``. ``reachability`` (member -> advertised value): a move that would
    strand a replica (:func:`scheduler.reachability.stranded_replicas`: a node behind NAT among replicas all behind
    NAT too, which it can neither average with nor take state from) is never proposed."""
    if not policy.enabled:
        return None
    times = stage_times(stage_of, compute, load)
    now, bottleneck = _slowest(times)
    if bottleneck < 0 or not math.isfinite(now) or now <= 0:
        return None
    counts = [0] * len(load)
    for s in stage_of.values():
        if 0 <= s < len(load):
            counts[s] += 1
    best: Optional[tuple] = None
    stranded = stranded_replicas(stage_of, reachability) if reachability is not None else set()
    for peer in sorted(set(movable)):
        s = stage_of.get(peer)
        c = compute.get(peer)
        if s is None or s in (0, bottleneck) or not 0 < s < len(load) or counts[s] <= policy.min_replicas \
                or c is None or not c > 0:
            continue
        moved = dict(stage_of)
        moved[peer] = bottleneck
        if reachability is not None and stranded_replicas(moved, reachability) - stranded:
            continue
        after, _ = _slowest(stage_times(moved, compute, load))
        if after <= 0:
            continue
        key = (now / after, -times[s])  # the gain, then the donor's spare capacity; peers in id order
        if best is None or key > best[0]:
            best = (key, StageMove(peer, s, bottleneck, now / after))
    if best is None or not best[1].gain > policy.move_gain:
        return None
    return best[1]


def auto_stage(counts: Sequence[int], capacity: Optional[Sequence[float]] = None,
               stranded: Collection[int] = ()) -> int:
    """The stage a node joining with ``--auto`` takes: a stage nobody holds (the lowest), else the bottleneck
    among the stages other than 0 (a data node brings its own microbatches, so it never relieves one): the
    least ``capacity`` (summed 1 / compute time of the stage's replicas) where every such stage has one, the
    fewest replicas otherwise (ties: the lowest stage). ``stranded``: stages whose replicas this node could not
    be connected to (:func:`scheduler.reachability.stranded_stages`), left out while another stage remains."""
    empty = [s for s, n in enumerate(counts) if n <= 0]
    if empty:
        return empty[0]
    stages = list(range(1, len(counts))) or [0]
    stages = [s for s in stages if s not in stranded] or stages
    if capacity is not None and len(capacity) == len(counts) and all(capacity[s] > 0 for s in stages):
        return min(stages, key=lambda s: (capacity[s], s))
    return min(stages, key=lambda s: (counts[s], s))
