"""Which replica, if any, a diverged replica copies its stage's state from.

Every member reports a checksum of its stage's parameters with its gradient norm; replicas of a
stage must agree. When they do not, each replica decides on its own, from the same reports, what to
do (:func:`resync_decision`):

* a **strict majority** of the stage's opinions (its own counts as one) holds the same weights: a
  replica outside it copies the majority (from its lowest peer id, the others of the majority
  backing the download); a replica inside it keeps stepping;
* **three or more opinions and no majority** (three replicas that all differ, two against two): no
  replica can tell which is right, so each keeps its own state and steps on; copying "the lowest
  peer id" would let a liar that picked a low id hand its weights to everyone;
* **two replicas that disagree** (two opinions, no third): the same doubt, but two honest replicas
  diverge whenever one round of averaging failed on one side (a view flap), and refusing for good
  would leave them apart (and every joiner of the stage disputed) for the rest of the run. So the
  replica whose id sorts later copies the other, but only a state within
  :data:`TIE_MAX_LR_STEPS` optimizer steps of its own (:func:`within_tie_bound`: what a failed round
  explains, plus :data:`TIE_LR_STEPS_PER_SKIP` per step it skipped itself), and it tries at most once
  per :data:`TIE_EVERY_ITERATIONS` iterations unless it skipped a step since its last try (its own
  report was left out, an fp16 overflow: it knows it is behind, and no peer can make it skip); otherwise
  it keeps its own.
  A liar with the lower id can thus move an honest replica by a few steps' worth now and then, never
  hand it arbitrary weights.
  When exactly one of the two said (its norm records) that an averaging round failed since the two last
  agreed (a round's failure shows in the checksums of the next iteration), the cause is known: an
  all-reduce whose results did not all come back (a stage averaging through a reducer, behind NAT,
  meets this on a loaded uplink) leaves the replica that failed on its local gradient while the
  other stepped on the mean. So the replica whose round failed copies the other, whatever the ids, at once
  (its own observation, no peer's word: the same bounds as above, without the wait), and the other keeps.

A replica whose own parameters are not finite follows the largest finite group (its own state is of
no use to anyone).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import AbstractSet, Callable, Iterable, List, Mapping, Optional, Tuple

__all__ = ["ResyncAction", "ResyncDecision", "resync_decision", "reachable_source", "within_tie_bound", "TIE_MAX_LR_STEPS",
           "TIE_LR_STEPS_PER_SKIP", "TIE_EVERY_ITERATIONS", "not_averaged_after"]

#: Largest per-element difference, in units of the learning rate, between our weights and a tie's
#: source state that a copy accepts. An Adam step moves an element by about ``lr`` (at most
#: ``(1 - beta1) / sqrt(1 - beta2)``, ~3.2 ``lr``, for the default betas); a failed averaging round
#: leaves two honest replicas at most two such steps apart, and the source's state is one step
#: further on: 10 keeps that honest case, while all-zero or perturbed weights are hundreds of steps away.
TIE_MAX_LR_STEPS = 10.0
#: Further learning-rate steps a tie copy may be away per step the copying replica skipped itself (its
#: report left out, an fp16 overflow): the largest Adam step, ``(1 - beta1) / sqrt(1 - beta2)`` ~ 3.2 ``lr``.
TIE_LR_STEPS_PER_SKIP = 3.2
#: Fewest iterations between two downloads under a tie (unless the replica skipped a step since): honest replicas diverge only when a round of
#: averaging failed (rare), while a liar would otherwise steer its partner by up to
#: :data:`TIE_MAX_LR_STEPS` steps every iteration (and cost it a state download each time); with this
#: gap it gets at most a fifth of an honest step's worth per iteration on average.
TIE_EVERY_ITERATIONS = 50


class ResyncAction(str, enum.Enum):
    """What a replica does with the stage's checksums of one iteration."""

    KEEP = "keep"  # we are in the majority (or the lower id of a tie): step as usual
    FOLLOW = "follow"  # a strict majority holds other weights: copy it
    TIE = "tie"  # two replicas disagree and ours sorts later: copy the other within the tie's bounds
    REFUSE = "refuse"  # three or more opinions, no majority: keep our own state and step


@dataclass(frozen=True)
class ResyncDecision:
    action: ResyncAction
    source: Optional[str] = None  # whom to download from (FOLLOW, TIE)
    backers: Tuple[str, ...] = ()  # the source's group (they back the download)
    why: str = ""


def _close(theirs: float, mine: float, tolerance: float) -> bool:
    return math.isfinite(mine) and abs(theirs - mine) <= tolerance * max(1.0, abs(theirs))


def _groups(checksums: Mapping[str, float], tolerance: float) -> List[List[str]]:
    """Peers grouped by checksum, each group anchored at its lowest peer id's checksum, sorted by
    size (largest first), then by lowest peer id."""
    groups: List[List[str]] = []
    for p in sorted(checksums):
        anchor = next((g for g in groups if _close(checksums[g[0]], checksums[p], tolerance)), None)
        if anchor is None:
            groups.append([p])
        else:
            anchor.append(p)
    return sorted(groups, key=lambda g: (-len(g), g[0]))


def resync_decision(replicas: Mapping[str, Tuple[int, float]], mine: float, stage: int, me: str,
                    tolerance: float, not_averaged: AbstractSet[str] = frozenset()) -> ResyncDecision:
    """The rule of the module docstring for replica ``me`` of ``stage`` holding checksum ``mine``;
    ``replicas``: peer -> (stage, checksum) of the members it trusts (other stages are ignored);
    ``not_averaged``: the replicas (``me`` included) whose averaging round failed since the stage last agreed."""
    checksums = {p: c for p, (s, c) in replicas.items() if s == stage and p != me and math.isfinite(c)}
    own_finite = math.isfinite(mine)
    if own_finite:
        checksums[me] = mine
    groups = _groups(checksums, tolerance)
    if not groups:
        return ResyncDecision(ResyncAction.KEEP, why="no finite replica to compare with")
    top, n = groups[0], len(checksums)
    if 2 * len(top) > n or not own_finite:
        if me in top:
            return ResyncDecision(ResyncAction.KEEP)
        why = (f"{len(top)} of {n} replicas hold other weights" if own_finite
               else "our parameters are not finite")
        return ResyncDecision(ResyncAction.FOLLOW, top[0], tuple(top), why)
    if n == 2:
        other = next(p for p in checksums if p != me)
        if (me in not_averaged) != (other in not_averaged):
            if me in not_averaged:
                return ResyncDecision(ResyncAction.TIE, other, (other,), "our averaging round failed, theirs did not")
            return ResyncDecision(ResyncAction.KEEP, why="two replicas disagree; the other one's averaging round failed")
        if other < me:
            return ResyncDecision(ResyncAction.TIE, other, (other,), "two replicas disagree, no third opinion")
        return ResyncDecision(ResyncAction.KEEP, why="two replicas disagree; the other one sorts later")
    sizes = "/".join(str(len(g)) for g in groups)
    return ResyncDecision(ResyncAction.REFUSE, why=f"no majority among {n} replicas (groups of {sizes})")


def not_averaged_after(previous: AbstractSet[str], records: Mapping[str, object], mates: Iterable[str],
                       in_sync: bool) -> set:
    """The replicas of our stage (``mates``, us included) that did not average since the stage last agreed, after
    one iteration's norm ``records`` (peer -> record with ``avg_group``, empty when its round failed or was
    skipped); ``in_sync``: the stage agreed at this iteration, so only this iteration's failures count.

    A mate whose record is missing (our view lost it for that iteration, so we did not wait for its report) counts
    as not averaged: we cannot know it did. Otherwise the copy rule could act on an asymmetry only we see: our
    own skipped round against a partner whose failed round we never heard of, while that partner, holding both
    records, applies the id rule; each would then copy the other and both downloads would time out."""
    failed = {p for p in mates if p not in records or not records[p].avg_group}
    return failed if in_sync else set(previous) | failed


def reachable_source(decision: ResyncDecision, reaches: Callable[[str], bool]) -> ResyncDecision:
    """``decision`` with a download source a connection can exist to (``reaches(peer)``: False for a replica
    behind NAT when we are behind NAT too): the first reachable peer of the source's group, which holds the
    same weights. With none, the copy cannot happen: each keeps its own state (``REFUSE``), instead of a
    download that could only time out at every iteration."""
    if decision.source is None or reaches(decision.source):
        return decision
    source = next((p for p in decision.backers if reaches(p)), None)
    if source is None:
        return ResyncDecision(ResyncAction.REFUSE, why=f"{decision.why}; but no replica holding those weights can "
                                                       f"be reached (all behind NAT, like this node)")
    backers = (source,) + tuple(p for p in decision.backers if p != source)
    return ResyncDecision(decision.action, source, backers, decision.why)


def within_tie_bound(mine: Mapping[str, "object"], theirs: Mapping[str, "object"], lr: float,
                     skipped: int = 0) -> Tuple[bool, float]:
    """Whether ``theirs`` (name -> tensor) is within :data:`TIE_MAX_LR_STEPS` (plus
    :data:`TIE_LR_STEPS_PER_SKIP` per step we ``skipped``) learning-rate steps of ``mine`` in every
    element; also the largest difference found, in units of ``lr``. Different names or shapes are out
    of bounds."""
    import torch

    if set(mine) != set(theirs) or lr <= 0:
        return False, math.inf
    worst = 0.0
    with torch.no_grad():
        for name, a in mine.items():
            b = theirs[name]
            if tuple(a.shape) != tuple(b.shape):
                return False, math.inf
            if a.numel() == 0 or not a.is_floating_point():
                continue
            diff = float((a.detach().double() - b.detach().to(a.device).double()).abs().max())
            if not math.isfinite(diff):
                return False, math.inf
            worst = max(worst, diff / lr)
    return worst <= TIE_MAX_LR_STEPS + TIE_LR_STEPS_PER_SKIP * max(0, skipped), worst
