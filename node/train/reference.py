"""Single-process training of the same model on the same batches as the swarm.

This is the oracle the swarm is tested against: the same stage modules (same initial weights),
the same microbatches along the same schedule paths, the same per-stage mean over visiting
microbatches, the same global clipping and the same AdamW step, all in one process with no
network. With one replica per stage and full in-order paths the swarm must reproduce its
parameters to float32 rounding; it is also the single-process baseline of the benchmark.

``precision`` ("fp32", "bf16", "fp16") is the stages' compute precision (:mod:`node.train.precision`),
exactly as a swarm member runs it: the same StageRuntime, so the same autocast, float32 boundaries
and master weights, and for fp16 the same loss scale and the same skip on a non-finite norm.
``wire`` (fp32, bf16, fp16, int8) passes every activation and gradient of every hop through that
wire codec, as the swarm's data plane does.
"""

from __future__ import annotations

import logging
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from node.train.branch_scaling import DEFAULT_BRANCH_SCALING, training_branch_scale
from node.train.data import DataConfig, DataShard, TokenSplits
from node.train.epochs import parse_schedule, routes_for, stage_index
from node.train.model import ModelConfig, StageModule, build_stage
from node.train.precision import wire_round_trip
from node.train.runtime import OptimConfig, StageRuntime, clip_coefficient
from protocol.compression import wire_compression

__all__ = ["ReferenceTrainer", "evaluate_loss"]

logger = logging.getLogger(__name__)


class ReferenceTrainer:
    """All stages in one process; one :meth:`train_iteration` = one swarm iteration."""

    def __init__(self, model: ModelConfig, optim: OptimConfig, data: DataConfig, splits: TokenSplits,
                 schedule: dict, seed: int = 0, device: str = "cpu", precision: str = "fp32",
                 wire: str = "fp32", branch_scaling: str = DEFAULT_BRANCH_SCALING.value):
        """``branch_scaling``: as the swarm's (``TrainerConfig.branch_scaling``), each stage scaled by its visit
        share in ``schedule``."""
        self.plan = parse_schedule(schedule)
        self._stage_of = stage_index(self.plan)
        self.compression = wire_compression(wire)
        self.optim = optim
        self.stages = [StageRuntime(build_stage(model, s, seed), optim, device, precision=precision)
                       for s in range(model.n_stages)]
        for s, st in enumerate(self.stages):
            st.branch_scale = training_branch_scale(branch_scaling, self.plan, s)
        n_data = len(self.plan.data_nodes)
        self.shards = {d: DataShard(splits, data, i, n_data) for i, d in enumerate(self.plan.data_nodes)}
        self.iteration = 0

    def train_iteration(self) -> float:
        """Run every microbatch of every data node, then one step; returns the mean loss."""
        it = self.iteration
        losses: List[float] = []
        stage0 = self.stages[0]
        for d in self.plan.data_nodes:
            for j, route in enumerate(routes_for(self.plan, d)):
                key = (d, it, j)
                inputs, targets = self.shards[d].batch(it, j)
                hop = self._hop
                h = stage0.start(key, inputs)
                visited = [self.stages[self._stage_of[n]] for n in route[1:]]
                for st in visited:
                    h = st.forward(key, hop(h))
                loss, g = stage0.loss_backward(hop(h), targets)
                losses.append(loss)
                for st in reversed(visited):
                    g = st.backward(key, hop(g))
                stage0.finish(key, hop(g))
        for st in self.stages:
            st.mean_grads()
        total_sq = sum(st.grad_squared_norm() for st in self.stages)
        coef = clip_coefficient(total_sq, self.optim.clip_norm)
        for st in self.stages:
            if not math.isfinite(total_sq):  # as the swarm: a non-finite norm skips the step everywhere
                st.skip_step()
                continue
            st.scale_grads(coef)
            st.step()
        self.iteration += 1
        return sum(losses) / max(len(losses), 1)

    def _hop(self, t: torch.Tensor) -> torch.Tensor:
        return wire_round_trip(t, self.compression)

    def modules(self) -> List[StageModule]:
        return [st.module for st in self.stages]


@torch.no_grad()
def evaluate_loss(stages: Sequence[StageModule], batches: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                  order: Optional[Sequence[int]] = None, branch_scale: Optional[float] = None) -> float:
    """Mean validation loss with the stages applied in ``order`` (default: all, in order); ``branch_scale``
    overrides the residual-branch scale of the stages in ``order`` (node.train.branch_scaling)."""
    order = list(order) if order is not None else list(range(1, len(stages)))
    was_training = [m.training for m in stages]
    for m in stages:
        m.eval()
    total = 0.0
    for inputs, targets in batches:
        dev = next(stages[0].parameters()).device
        h = stages[0].embed(inputs.to(dev))
        for s in order:
            h = stages[s](h, branch_scale=branch_scale)
        total += float(stages[0].head_loss(h, targets.to(dev)))
    for m, t in zip(stages, was_training):
        m.train(t)
    return total / len(batches)
