"""This node's compute speed as it trains: a robust running estimate the coordinator can plan with.

Why: the speed a node advertises at start-up comes from a short matmul benchmark, taken once. A machine
that gets busy later (another program, thermal throttling, a paused VM, or a compute emulation factor)
keeps advertising its start-up figure, and the schedule keeps giving it a full share of microbatches. So
the stage runtime times every forward and backward it runs (its own compute, not the wait before it; the
emulated time where compute is emulated and that is longer) and keeps the last :attr:`ComputeMeterConfig.window` of them as *forward-equivalent seconds per sample per
layer*: a forward's seconds / (samples x layers), a backward's divided by the cost model's backward ratio
too, the unit of the advert's ``compute_s_per_sample_per_layer`` and of the scheduler's cost model. The
estimate is their median: one step that waited for a GC pause or an unrelated burst of work must not make
the node look slow, while a node that is slow for good moves the median within half a window. The loss
step is left out: it runs the LM head, whose cost does not scale with the stage's layers.
"""

from __future__ import annotations

import collections
import math
import statistics
import threading
from dataclasses import dataclass
from typing import Deque, Optional

__all__ = ["ComputeMeterConfig", "ComputeMeter"]


@dataclass(frozen=True)
class ComputeMeterConfig:
    #: steps the median runs over: 32 steps are a few iterations of a node that sees 4-8 microbatches an
    #: iteration (each a forward and a backward), so a lasting slowdown shows within a few iterations
    window: int = 32
    #: no estimate before this many steps: the first steps of a stage include lazy initialisation, kernel
    #: selection and stream opens, which a median of fewer than 8 would still reflect
    min_samples: int = 8
    #: backward time / forward time: the scheduler's ``CostParams.backward_ratio`` (two matmuls per forward one)
    backward_ratio: float = 1.5


class ComputeMeter:
    """Running median of this node's forward-equivalent seconds per sample per layer (thread-safe: the
    compute thread records, the event loop reads)."""

    KINDS = ("forward", "backward")

    def __init__(self, config: ComputeMeterConfig = ComputeMeterConfig()):
        if config.window < 1 or not 1 <= config.min_samples <= config.window or not config.backward_ratio > 0:
            raise ValueError("ComputeMeterConfig needs window >= min_samples >= 1 and backward_ratio > 0")
        self.config = config
        self._recent: Deque[float] = collections.deque(maxlen=config.window)
        self._lock = threading.Lock()
        self.steps = 0

    def record(self, kind: str, seconds: float, samples: int, layers: int) -> None:
        """One ``kind`` step ("forward" or "backward") of ``samples`` samples through ``layers`` layers took
        ``seconds``; anything else (a loss step, a stage without layers, a clock that went backwards) is
        ignored."""
        if kind not in self.KINDS or samples < 1 or layers < 1 or not (math.isfinite(seconds) and seconds > 0):
            return
        factor = self.config.backward_ratio if kind == "backward" else 1.0
        with self._lock:
            self._recent.append(seconds / (samples * layers * factor))
            self.steps += 1

    def estimate(self) -> Optional[float]:
        """The median of the recent steps, or None before :attr:`ComputeMeterConfig.min_samples` of them."""
        with self._lock:
            if len(self._recent) < self.config.min_samples:
                return None
            return statistics.median(self._recent)

    def to_json(self) -> dict:
        with self._lock:
            n = len(self._recent)
        return {"estimate_s_per_sample_per_layer": self.estimate(), "samples": n, "steps": self.steps}
