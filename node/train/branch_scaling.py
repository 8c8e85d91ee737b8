"""How much each stage's residual branches are scaled while the swarm trains (inverted stochastic depth).

With skipping paths a stage runs on only a share ``p`` of an iteration's microbatches, yet the trained
model is run at full depth, every stage on every token. Scaling a visited stage's residual branches by
``1/p`` while training makes each stage's *expected* contribution to the residual stream what it adds
in the full model, so the checkpoint runs as a plain model (scale 1, nothing to remember at inference):
dropout's rule applied to whole stages. Measured at equal tokens against the full pipeline trained with
the same scale (docs/evaluation.md, "Treatments of skip training"), it closes plain skip training's gap;
``none`` keeps plain training. A full pipeline (every path visits every stage) has ``p = 1`` everywhere
and trains exactly as without it.

The share comes from the epoch's schedule, which every member holds, so all replicas of a stage use
the same scale; it changes only at an epoch boundary.
"""

from __future__ import annotations

import enum
from typing import Optional

from node.errors import UserError
from scheduler.schedule import Schedule

__all__ = ["BranchScaling", "DEFAULT_BRANCH_SCALING", "parse_branch_scaling", "visit_share", "training_branch_scale",
           "inference_branch_scale"]


class BranchScaling(str, enum.Enum):
    NONE = "none"  # plain skip training: a visited stage adds its branches unscaled
    INVERSE = "inverse"  # a visited stage's branches scaled by 1/p in training, 1 at inference


#: What the swarm trains with unless the run says otherwise (the measured best; docs/evaluation.md).
DEFAULT_BRANCH_SCALING = BranchScaling.INVERSE


def parse_branch_scaling(value: str) -> BranchScaling:
    try:
        return BranchScaling(str(value))
    except ValueError:
        raise UserError(f"--branch-scaling must be one of {', '.join(m.value for m in BranchScaling)}, "
                        f"got {value!r}") from None


def visit_share(plan: Schedule, stage: int) -> float:
    """Fraction of one iteration's microbatches whose path visits ``stage`` (1.0 for stage 0, which every
    path starts and ends at, and for a schedule without microbatches)."""
    if stage == 0:
        return 1.0
    members = set(plan.stages[stage])
    total = sum(p.microbatches for p in plan.paths)
    if total <= 0:
        return 1.0
    visits = sum(p.microbatches for p in plan.paths if members.intersection(p.route))
    return visits / total


def training_branch_scale(mode: str, plan: Schedule, stage: int) -> float:
    """The residual-branch scale ``stage`` trains with under ``plan`` (1.0 = plain; a stage no path visits
    keeps 1.0: it computes nothing this epoch)."""
    if parse_branch_scaling(mode) is BranchScaling.NONE:
        return 1.0
    share = visit_share(plan, stage)
    return 1.0 / share if share > 0 else 1.0


def inference_branch_scale(mode: str, n_stages: int, n_kept: int) -> Optional[float]:
    """The residual-branch scale of stages 1.. when a model trained under ``mode`` runs with only ``n_kept``
    of its ``n_stages`` stages (stage 0 included); None = the modules' own scale (plain models).

    An ``inverse``-trained model is a plain model at full depth (1.0). With stages missing, the stages
    present take on the share of those left out, as each visited stage did in training: ``(S - 1) / (K - 1)``
    for K of S stages, exactly the training scale ``1/p`` when K is the training path length and every
    stage had the same share (what the schedule gives). Measured on a seed-1 checkpoint of the tiny model
    (docs/evaluation.md): half the stages left out costs +13.3% perplexity with it, +26.6% at scale 1."""
    if parse_branch_scaling(mode) is BranchScaling.NONE:
        return None
    if n_kept <= 1 or n_kept >= n_stages:
        return 1.0
    return (n_stages - 1) / (n_kept - 1)
