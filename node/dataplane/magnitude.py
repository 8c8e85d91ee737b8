"""Magnitude screening of received activations and gradients: a finite frame can still be poison.

A member of the swarm may send activations or gradients that are finite and of the right shape but
absurdly large (1e30 activations, gradients multiplied by -1e6): the finiteness check lets them
through, the receiving stage runs on them, and one member undoes the training of the whole stage
(measured on a 4-daemon swarm: loss 2.6 -> 11.3 in a few iterations). Honest tensors of one
direction at one node are alike: the residual stream a stage receives, or the loss gradient it
receives, changes its scale slowly as training goes on. So each node keeps, per direction, the
root-mean-square of the last :data:`WINDOW` frames it accepted, and refuses a frame

- whose largest absolute value exceeds :data:`ABSOLUTE_MAX_ABS` (always, from the first frame), or
- whose RMS exceeds :data:`RMS_FACTOR` times the median RMS of that window, once the window holds
  :data:`MIN_SAMPLES` frames.

Only accepted frames enter the window, so a sender cannot drag the median up by sending outliers;
one that grows its values slowly is bounded by :data:`RMS_FACTOR` per window. The check reads the
frame's decompressed values once (one pass of numpy over the tensor, like the finiteness check).
"""

from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass, field
from typing import Deque, Dict, Optional

__all__ = ["MagnitudeScreen", "Magnitude", "measure", "RMS_FACTOR", "ABSOLUTE_MAX_ABS", "MIN_SAMPLES", "WINDOW",
           "OUT_OF_RANGE"]

#: Reason code of a refused frame (a rejection reason of the data plane, like the guard's).
OUT_OF_RANGE = "out_of_range"
#: A frame's RMS may be at most this many times the median RMS of the recent frames of its
#: direction. Honest scales drift by a few times over a window (a loss spike, a loss-scale change
#: of fp16 by 2x); 100x (40 dB) is far outside that, and every attack measured was 1e4x or more.
RMS_FACTOR = 100.0
#: Largest absolute value any honest boundary tensor carries. Activations of the residual stream
#: stay within ~1e4 even in large models (their "massive activations"); fp16 gradients are scaled by
#: at most 2^24 (node.train.precision's ceiling) times values far below 1. Values of 1e10 overflow
#: fp16 compute (max 65504) and swamp everything else in a float32 sum: no honest member sends them.
ABSOLUTE_MAX_ABS = 1e10
#: Frames a direction's window must hold before the relative rule applies: the median of fewer is
#: the scale of one or two microbatches (about 4 iterations of a 2-microbatch schedule).
MIN_SAMPLES = 8
#: Frames the median is taken over (the most recent accepted ones): long enough that one noisy
#: microbatch cannot move it, short enough to follow the slow drift of an honest run.
WINDOW = 64


@dataclass(frozen=True)
class Magnitude:
    """The numbers a frame is judged by."""

    rms: float
    max_abs: float


def measure(values) -> Magnitude:
    """RMS and max-abs of a 1-D float numpy array, without a copy of it (two reductions and one dot).

    The RMS is only computed below :data:`ABSOLUTE_MAX_ABS` (beyond it the frame is refused anyway):
    there squares stay below 1e20 and a float32 sum of them cannot overflow."""
    import numpy as np

    if values.size == 0:
        return Magnitude(0.0, 0.0)
    max_abs = max(float(np.max(values)), -float(np.min(values)))  # NaN propagates
    if not max_abs <= ABSOLUTE_MAX_ABS:
        return Magnitude(math.inf, max_abs)
    return Magnitude(math.sqrt(float(np.dot(values, values)) / values.size), max_abs)


@dataclass
class MagnitudeScreen:
    """Recent RMS of accepted frames per direction, and the rule a new frame is judged by."""

    rms_factor: float = RMS_FACTOR
    absolute_max_abs: float = ABSOLUTE_MAX_ABS
    min_samples: int = MIN_SAMPLES
    window: int = WINDOW
    _recent: Dict[str, Deque[float]] = field(default_factory=dict)

    def judge(self, direction: str, magnitude: Magnitude) -> Optional[str]:
        """Why a frame of ``direction`` with ``magnitude`` is refused, or None (then it is remembered)."""
        if not magnitude.max_abs <= self.absolute_max_abs:  # also catches NaN
            return f"max |value| {magnitude.max_abs:.3g} > absolute cap {self.absolute_max_abs:.3g}"
        recent = self._recent.setdefault(direction, collections.deque(maxlen=self.window))
        if len(recent) >= self.min_samples:
            median = statistics.median(recent)
            if magnitude.rms > self.rms_factor * median:
                return (f"RMS {magnitude.rms:.3g} > {self.rms_factor:g} x the median {median:.3g} of the last "
                        f"{len(recent)} {direction} frames")
        recent.append(magnitude.rms)
        return None

    def median(self, direction: str) -> Optional[float]:
        recent = self._recent.get(direction)
        return statistics.median(recent) if recent else None
