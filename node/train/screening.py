"""What one bad member of the swarm may not do: poison a hop, freeze or unclip a step, skew an average.

Three checks, each bounding what a member that is in the schedule (so past every outsider check)
can do with numbers that are well formed but wrong (docs/training.md, "A bad member"):

- **Poisoned hops.** A hop tensor the data-plane guard refused for its content (non-finite, or far
  outside the recent magnitudes: :mod:`node.dataplane.magnitude`) is a fault of its sender
  (:meth:`node.train.health.PeerHealth.fault`), and its microbatch is reported failed to its data node
  at once (a ``HopFailure`` naming the sender), which bans the sender from its routes and recomputes
  the microbatch on a path without it. Without the report the data node waited for the
  microbatch's deadline: a NaN-sending member stretched iterations from 0.3 s to 22.7 s.
- **Norm reports.** The clip coefficient is computed from the members' reports by
  :func:`robust_squared_norm`: a non-finite report is left out when another replica of its stage
  reports a finite one, a report :data:`ABSURD_SQ_FACTOR` times above the median of the others is
  left out, and each stage counts the lower median of its remaining reports. Every honest member
  sees the same set of reports, so all compute the same coefficient; each counts the left-out
  members as faulty; a member whose own report was left out skips its step.
- **Averaging.** hivemind's all-reduce gives no access to the other replicas' contributions (each
  peer reduces a part of the tensors), so a trimmed mean or median is not possible without
  replacing hivemind's reducer. Instead, the result is bounded (:class:`AveragingScreen`): an
  averaged gradient whose norm exceeds :data:`AVERAGED_NORM_FACTOR` times the larger of the
  replica's own gradient norm and its recent averaged norms is refused, and the replica steps on its
  own gradient (as after a failed round). A convex combination of honest gradients is never larger
  than the largest of them, so honest rounds pass. With two replicas the other one is the culprit
  and is banned; with three or more the culprit cannot be named, and the honest replicas each keep
  their own gradient (the damage is bounded to one round's lost averaging per attack).
"""

from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Deque, Dict, List, Mapping, Optional, Tuple

from node.dataplane.guard import CONTENT_FAULTS, NON_FINITE
from node.train.common import mb_key

if TYPE_CHECKING:
    from node.net.records import NormRecord

__all__ = ["NormVerdict", "robust_squared_norm", "AveragingScreen", "FrameRejections", "screening_summary",
           "ABSURD_SQ_FACTOR", "MIN_OTHER_REPORTS", "AVERAGED_NORM_FACTOR", "AVERAGED_HISTORY", "HONEST_OVERFLOW_WIRES"]

#: A report's squared norm may be at most this many times the median of the other members' reports
#: (1e6 in squared norm = 1000x in norm). Stages of one model differ in gradient norm by a few times,
#: an embedding/head stage by tens of times at most; a report a thousand times above the others is no
#: gradient of this model, and would shrink every step by that factor (1e30 froze training).
ABSURD_SQ_FACTOR = 1e6
#: Reports of other members needed before one can be judged absurd: the median of one is that one.
MIN_OTHER_REPORTS = 2
#: An averaged gradient may be at most this many times the larger of the replica's own (pre-averaging)
#: gradient norm and the median of its recent averaged norms. Honest averaging is a convex
#: combination, so never above the largest contribution; contributions differ because replicas
#: average different numbers of microbatches (a noise-dominated mean shrinks as 1/sqrt(visits): 1
#: visit next to 64 is 8x). A contribution scaled by 1000 gives ~500x.
AVERAGED_NORM_FACTOR = 10.0
#: Wire formats in which an honest member's hop tensor can arrive non-finite: fp16 tops out at 65504,
#: and an fp16-precision boundary gradient is multiplied by the loss scale (2^16 at start) before it
#: is sent. There a non-finite frame is refused but blamed on nobody.
HONEST_OVERFLOW_WIRES = frozenset({"fp16"})
#: Averaged norms remembered for that bound (iterations).
AVERAGED_HISTORY = 16


@dataclass(frozen=True)
class NormVerdict:
    """The global squared norm the step is clipped by, and the reports left out of it (peer -> why)."""

    total_sq: float
    excluded: Dict[str, str] = field(default_factory=dict)


def _lower_median(values: List[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def robust_squared_norm(records: Mapping[str, "NormRecord"]) -> NormVerdict:
    """Sum over stages of the lower median of the stage's accepted reports (see the module docstring).

    Deterministic in the set of records (not their order), so every member gets the same number. A
    stage whose every report is non-finite makes the total non-finite: everyone skips the step (the
    fp16 overflow protocol; a stage's only replica cannot be outvoted). A stage whose reports were all
    left out as absurd counts 0 (its members skip their own step)."""
    excluded: Dict[str, str] = {}
    by_stage: Dict[int, List[Tuple[str, float]]] = collections.defaultdict(list)
    for peer, r in records.items():
        by_stage[r.stage].append((peer, float(r.sq)))
    for stage, reports in by_stage.items():
        if any(math.isfinite(sq) for _, sq in reports):
            for peer, sq in reports:
                if not math.isfinite(sq):
                    excluded[peer] = f"non-finite gradient norm {sq} while stage {stage} has finite ones"
    finite = {p: sq for reports in by_stage.values() for p, sq in reports if math.isfinite(sq)}
    for peer, sq in finite.items():
        others = [v for p, v in finite.items() if p != peer]
        if len(others) < MIN_OTHER_REPORTS:
            continue
        median = statistics.median(others)
        if median > 0 and sq > ABSURD_SQ_FACTOR * median:
            excluded[peer] = f"squared gradient norm {sq:.3g} > {ABSURD_SQ_FACTOR:g} x the others' median {median:.3g}"
    total = 0.0
    for stage, reports in by_stage.items():
        kept = [sq for p, sq in reports if p not in excluded]
        if not kept:
            continue
        if not any(math.isfinite(sq) for sq in kept):
            return NormVerdict(math.nan, excluded)
        total += _lower_median([sq for sq in kept if math.isfinite(sq)])
    return NormVerdict(total, excluded)


@dataclass
class AveragingScreen:
    """The bound an averaged gradient's norm must stay under, from this replica's own norms."""

    factor: float = AVERAGED_NORM_FACTOR
    history: int = AVERAGED_HISTORY
    _recent: Deque[float] = field(default_factory=collections.deque)

    def bound(self, local_sq: float) -> Optional[float]:
        """Largest acceptable averaged norm, given our own squared norm before averaging; None = no
        bound yet (nothing to compare with: no gradient of our own and no history)."""
        reference = max(math.sqrt(local_sq) if math.isfinite(local_sq) and local_sq > 0 else 0.0,
                        statistics.median(self._recent) if self._recent else 0.0)
        return self.factor * reference if reference > 0 else None

    def accepted(self, sq: float) -> None:
        """Remember the squared norm of an averaged gradient we stepped on."""
        if math.isfinite(sq):
            self._recent.append(math.sqrt(sq))
            while len(self._recent) > self.history:
                self._recent.popleft()


@dataclass(frozen=True)
class FrameRejections:
    """The data plane's callback for a frame its guard refused (``DataPlane(on_rejected=...)``): a member's
    poisoned hop is its fault, and its microbatch fails now (the data node re-routes it around the sender)
    instead of at its deadline.

    ``cfg``: the trainer's configuration (run id, wire); ``epochs``: its epoch tracker (who is a member);
    ``life``: :class:`node.train.progress.LifeView`; ``health``, ``resources``, ``sender``, ``recovery``: the
    trainer's peer health, stage resources (the runtime), hop sender and route recovery."""

    cfg: object
    peer_id: str
    epochs: object
    life: object
    health: object
    resources: object
    sender: object
    recovery: object

    def __call__(self, msg: object, sender: str, reason: str, detail: str) -> None:
        from protocol import ActivationMessage, GradientMessage, HopFailure

        if reason not in CONTENT_FAULTS or not isinstance(msg, (ActivationMessage, GradientMessage)):
            return
        if self.life.closed or sender not in self.epochs.members or msg.mb.run_id != self.cfg.run_id:
            return  # an outsider's garbage is the allowlist's and the guard's business, not a route's
        if reason == NON_FINITE and self.cfg.wire in HONEST_OVERFLOW_WIRES:
            return  # an honest fp16 overflow looks the same: that microbatch is lost, its sender not blamed
        forward = isinstance(msg, ActivationMessage)
        kind = "activation" if forward else "gradient"
        self.health.fault(sender, f"{reason} {kind}: {detail}")
        runtime = self.resources.runtime
        if not forward and runtime is not None:
            runtime.drop(mb_key(msg.mb))  # its autograd state would wait for a gradient that never comes
        report = HopFailure(msg.mb, msg.hop - 1 if forward else msg.hop + 1, sender, f"{reason} {kind} from the sender")
        if msg.mb.data_node == self.peer_id:
            self.recovery.on_hop_failure(report)
        else:
            self.sender.send_control(msg.mb.data_node, report)


def screening_summary(*, dataplane, health, commit, faults) -> dict:
    """What the checks of this module (and the data-plane guard) caught on a trainer: for the training RPC.
    ``dataplane`` (None once closed), ``health``, ``commit`` and ``faults`` are the trainer's."""
    return {
        "rejected_frames": dict(dataplane.rejected) if dataplane is not None else {},
        "faults": dict(health.faults_total),
        "banned": sorted(health.suspects()),
        "excluded_reports": commit.excluded_reports,
        "averaging_outliers": commit.averaging_outliers,
        "injected_pending": faults.pending if faults else 0,
        "injected_fired": len(faults.fired) if faults else 0,
    }
