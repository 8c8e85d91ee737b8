"""Single-process training along SkipPipe paths (the paper's convergence "simulation").

Why this exists: whether skipping stages hurts convergence is a question about the *optimisation*,
not about the network. The paper answers it by training one full model per data node and letting
each microbatch run only the layers of the stages its scheduled path visits (stage 0, then the
visited stages in route order, then stage 0's head and loss). This module does the same in one
process, so the convergence benchmark and the omission evaluation run in minutes on a CPU with no
swarm at all.

What one :meth:`PathTrainer.train_iteration` does, and why it matches the swarm:

* Replicas of a stage collapse into one module: every replica of a stage holds the same weights
  after each averaged step, so which replica a route names does not matter here, only the stage.
* Each microbatch is one autograd graph through exactly its route; gradients accumulate (summed)
  in the parameters. Each stage's sum is then divided by the number of microbatches that visited
  that stage *over all its replicas*: the mean over visiting microbatches, which is what the
  swarm's count-weighted all-reduce gives. It is deliberately NOT divided by the replica count
  (the reference code's rule, which is only equal to the mean in configurations where the visits
  split evenly; see notes §7.6), nor scaled by the visit fraction (the reference's convergence
  scripts).
* One global L2 norm over all stages, one clip coefficient, one AdamW step per stage; a stage no
  microbatch visited still steps with a zero gradient, exactly like a swarm node does.

* ``wire`` (``--wire`` of the swarm: fp32, bf16, fp16, int8): every hop a swarm microbatch makes
  (stage 0 -> first visited stage -> ... -> back to stage 0's head, and the gradients the other
  way) goes through that wire codec here too, forward and backward, with the very codec code of
  :mod:`protocol.compression` (a float32 frame compressed and decoded again): the convergence bench
  measures what quantization on the wire costs per token.

The optimiser, clipping arithmetic, data shards and initial weights are the ones the swarm and
:class:`node.train.reference.ReferenceTrainer` use, so a schedule whose every path visits every stage in
order reproduces the reference to float32 rounding. Checkpoints go through
:class:`node.train.checkpoint.CheckpointStore` in the swarm's layout, so ``skippipe eval`` reads both.
"""

from __future__ import annotations

import logging
import os
import pathlib
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple, Union

import torch

from node.train.checkpoint import CheckpointStore
from node.train.data import DataConfig, DataShard, TokenSplits
from node.errors import UserError
from node.train.model import ModelConfig, StageModule, build_stage
from node.train.runtime import OptimConfig, clip_coefficient, make_optimizer, squared_norm
from node.train.precision import wire_round_trip
from protocol.compression import NO_COMPRESSION, wire_compression
from scheduler.errors import ScheduleError
from scheduler.schedule import Schedule

__all__ = [
    "IterationResult",
    "PathTrainer",
    "stage_routes",
    "full_pipeline_schedule",
    "DEFAULT_NODE_NAME",
    "TRAINER_KIND",
]

logger = logging.getLogger(__name__)

#: File name (per stage) of a single-process checkpoint inside the swarm layout.
DEFAULT_NODE_NAME = "path-trainer"
#: Recorded in checkpoint meta so readers can tell single-process runs from swarm runs.
TRAINER_KIND = "path-training"

StageRoute = Tuple[int, ...]  # stages visited after stage 0, in visiting order


@dataclass
class IterationResult:
    """What one iteration did: mean loss, global gradient norm before clipping, the clip factor,
    and how many microbatches visited each stage (stage 0 = all of them)."""

    iteration: int
    loss: float
    grad_norm: float
    clip_coef: float
    visits: List[int] = field(default_factory=list)
    tokens: int = 0


class _WireHop(torch.autograd.Function):
    """Identity for autograd, except that the activation (forward) and its gradient (backward) both
    cross the wire codec, as they do between two swarm nodes."""

    @staticmethod
    def forward(ctx, x, compression):  # type: ignore[override]
        ctx.compression = compression
        return wire_round_trip(x, compression)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return wire_round_trip(grad, ctx.compression), None


def _as_schedule(schedule: Union[Schedule, Mapping]) -> Schedule:
    if isinstance(schedule, Schedule):
        return schedule
    try:
        return Schedule.from_json(dict(schedule))
    except ScheduleError as e:
        raise UserError(f"malformed schedule: {e}") from None


def stage_routes(schedule: Union[Schedule, Mapping]) -> Dict[int, List[StageRoute]]:
    """Per data node (in ``stages[0]`` order), the stages after stage 0 of each of its
    microbatches in dispatch order. Node ids become stage indices because, in one process, every
    replica of a stage is the same module."""
    sched = _as_schedule(schedule)
    stage_of: Dict[int, int] = {}
    for s, nodes in enumerate(sched.stages):
        for n in nodes:
            if n in stage_of:
                raise UserError(f"schedule node {n} is in stages {stage_of[n]} and {s}")
            stage_of[n] = s
    out: Dict[int, List[StageRoute]] = {d: [] for d in sched.data_nodes}
    for d, routes in sched.dispatch_order().items():
        if d not in out:
            raise UserError(f"schedule path starts at {d}, which is not a data node")
        for route in routes:
            if not route or route[0] != d:
                raise UserError(f"schedule route {list(route)} does not start at its data node {d}")
            try:
                seq = tuple(stage_of[n] for n in route[1:])
            except KeyError as e:
                raise UserError(f"schedule route {list(route)} visits unknown node {e.args[0]}") from None
            if 0 in seq or len(set(seq)) != len(seq):
                raise UserError(f"schedule route {list(route)} visits stage 0 again or a stage twice")
            out[d].append(seq)
    return out


def full_pipeline_schedule(n_stages: int, data_nodes: int, microbatches: int, memory: int = 1) -> dict:
    """Schedule JSON where every microbatch of every data node visits all stages in order, one
    replica per non-zero stage: the no-skipping baseline over the same data nodes and batches."""
    stages = [list(range(data_nodes))] + [[data_nodes + s - 1] for s in range(1, n_stages)]
    route = [stage[0] for stage in stages[1:]]
    paths = [{"data_node": d, "route": [d] + route, "microbatches": microbatches} for d in range(data_nodes)]
    return {"stages": stages, "path_length": n_stages, "memory": memory, "paths": paths}


class PathTrainer:
    """All stages of one model in one process, trained along a schedule's paths.

    ``seed`` fixes the initial weights (as :func:`node.train.model.build_stage`); ``data.seed`` fixes
    which windows form each microbatch (as :class:`node.train.data.DataShard`), so two trainers with the
    same arguments produce bit-identical runs.
    """

    def __init__(self, model: ModelConfig, optim: OptimConfig, data: DataConfig, splits: TokenSplits,
                 schedule: Union[Schedule, Mapping], seed: int = 0, device: str = "cpu", wire: str = "fp32"):
        if splits.vocab_size > model.vocab_size:
            raise UserError(f"tokenizer vocab {splits.vocab_size} exceeds model vocab {model.vocab_size}")
        sched = _as_schedule(schedule)
        if len(sched.stages) != model.n_stages:
            raise UserError(f"schedule has {len(sched.stages)} stages, the model {model.n_stages}")
        self.model_cfg, self.optim_cfg, self.data_cfg = model, optim, data
        self.seed, self.device = seed, device
        self.wire, self.compression = wire, wire_compression(wire)
        self.routes = stage_routes(sched)
        self.stages: List[StageModule] = [build_stage(model, s, seed).to(device) for s in range(model.n_stages)]
        self.optimizers = [make_optimizer(m.parameters(), optim) for m in self.stages]
        data_nodes = list(self.routes)
        self.shards = {d: DataShard(splits, data, i, len(data_nodes)) for i, d in enumerate(data_nodes)}
        self.iteration = 0  # next iteration to run
        self._zero_grads()

    # ------------------------------------------------------------------ training
    def _zero_grads(self) -> None:
        """Zero (not None) gradients, so every stage steps even when nothing visited it."""
        for m in self.stages:
            for p in m.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                else:
                    p.grad.zero_()

    def _microbatch(self, data_node: int, index: int, route: StageRoute) -> Tuple[float, int]:
        """Forward and backward of one microbatch along ``route``; returns (loss, tokens)."""
        inputs, targets = self.shards[data_node].batch(self.iteration, index)
        stage0 = self.stages[0]
        hidden = stage0.embed(inputs.to(self.device))
        for s in route:
            hidden = self.stages[s](self._hop(hidden))
        loss = stage0.head_loss(self._hop(hidden), targets.to(self.device))
        loss.backward()
        return float(loss.detach()), int(targets.numel())

    def _hop(self, hidden: torch.Tensor) -> torch.Tensor:
        """One hop between nodes: through the wire codec (identity for the fp32 wire)."""
        if self.compression == NO_COMPRESSION:
            return hidden
        return _WireHop.apply(hidden, self.compression)

    def train_iteration(self) -> IterationResult:
        """Every microbatch of every data node along its route, then one optimiser step."""
        n_stages = len(self.stages)
        visits = [0] * n_stages
        losses: List[float] = []
        tokens = 0
        for d, routes in self.routes.items():  # same order as the reference: data nodes, then microbatches
            for j, route in enumerate(routes):
                loss, n_tok = self._microbatch(d, j, route)
                losses.append(loss)
                tokens += n_tok
                visits[0] += 1
                for s in route:
                    visits[s] += 1
        with torch.no_grad():
            for m, n in zip(self.stages, visits):
                if n > 1:
                    for p in m.parameters():
                        p.grad.div_(n)
        total_sq = sum(squared_norm(p.grad for p in m.parameters()) for m in self.stages)
        coef = clip_coefficient(total_sq, self.optim_cfg.clip_norm)
        with torch.no_grad():
            if coef != 1.0:
                for m in self.stages:
                    for p in m.parameters():
                        p.grad.mul_(coef)
        for opt in self.optimizers:
            opt.step()
        self._zero_grads()
        result = IterationResult(self.iteration, sum(losses) / max(len(losses), 1), total_sq ** 0.5, coef,
                                 visits, tokens)
        self.iteration += 1
        return result

    def modules(self) -> List[StageModule]:
        return list(self.stages)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_meta(self, run_id: str, extra: Optional[Mapping] = None) -> dict:
        """What a reader needs to rebuild and evaluate the model without guessing flags."""
        meta = {"run_id": run_id, "trainer": TRAINER_KIND, "model": self.model_cfg.to_dict(),
                "data": dict(vars(self.data_cfg)),  # every DataConfig field, the tokenizer hash included
                "seed": self.seed}
        meta.update(dict(extra or {}))
        return meta

    def save_checkpoint(self, root: Union[str, os.PathLike], run_id: str, node_name: str = DEFAULT_NODE_NAME,
                        extra_meta: Optional[Mapping] = None) -> List[pathlib.Path]:
        """One file per stage, ``<root>/<run_id>/stage<k>/<node_name>.pt`` (the swarm's layout),
        holding the last committed iteration and ``{"model", "optimizer"}`` as a stage runtime does."""
        if self.iteration == 0:
            raise UserError("nothing to save: no iteration has been trained yet")
        meta = self.checkpoint_meta(run_id, extra_meta)
        paths = []
        for s, (m, opt) in enumerate(zip(self.stages, self.optimizers)):
            state = {"model": m.state_dict(), "optimizer": opt.state_dict()}
            paths.append(CheckpointStore(root, run_id, s, node_name).save(self.iteration - 1, state, meta))
        return paths

    def load_checkpoint(self, root: Union[str, os.PathLike], run_id: str, node_name: str = DEFAULT_NODE_NAME) -> bool:
        """Resume from :meth:`save_checkpoint`'s files; False when there are none."""
        loaded = [CheckpointStore(root, run_id, s, node_name).load() for s in range(len(self.stages))]
        if all(c is None for c in loaded):
            return False
        if any(c is None for c in loaded):
            missing = [s for s, c in enumerate(loaded) if c is None]
            raise UserError(f"checkpoint {pathlib.Path(root) / run_id} lacks stages {missing}")
        iterations = {c.iteration for c in loaded}
        if len(iterations) != 1:
            raise UserError(f"stage checkpoints under {pathlib.Path(root) / run_id} disagree on the iteration: "
                            f"{sorted(iterations)}")
        for m, opt, c in zip(self.stages, self.optimizers, loaded):
            m.load_state_dict(c.state["model"])
            opt.load_state_dict(c.state["optimizer"])
        self.iteration = iterations.pop() + 1
        self._zero_grads()
        return True


# ---------------------------------------------------------------------- convergence treatments
# Helpers for bench/convergence.py's treatments of skip training (--train-branch-scale,
# --stage-lr). Kept apart from PathTrainer: they only read its routes and set attributes that
# already exist (StageModule.branch_scale, the optimisers' param-group lr).


def stage_visit_shares(routes: Mapping[int, List[StageRoute]], n_stages: int) -> List[float]:
    """Fraction of one iteration's microbatches that visit each stage (stage 0 is always 1.0)."""
    counts = [0] * n_stages
    total = 0
    for rs in routes.values():
        for route in rs:
            total += 1
            for s in route:
                counts[s] += 1
    if total == 0:
        return [1.0] * n_stages
    return [1.0] + [c / total for c in counts[1:]]


def branch_scales_for(mode: str, shares: List[float]) -> Tuple[List[float], List[float]]:
    """(training scales, inference scales) of each stage's residual branches for a treatment.

    * ``none``: 1 and 1 (plain training, plain full-depth model);
    * ``visit``: p and p, where p is the stage's visit share (the branch is scaled by its visit
      probability while training and the same at full depth);
    * ``inverse``: 1/p while training and 1 at inference (inverted stochastic depth: a stage's
      expected contribution in training equals its contribution in the full model, and the
      checkpoint runs as a plain model).
    A stage nothing visits (p = 0) keeps 1."""
    if mode == "none":
        return [1.0] * len(shares), [1.0] * len(shares)
    if mode == "visit":
        s = [p if p > 0 else 1.0 for p in shares]
        return list(s), list(s)
    if mode == "inverse":
        return [1.0 / p if p > 0 else 1.0 for p in shares], [1.0] * len(shares)
    raise UserError(f"unknown branch-scale treatment {mode!r} (none, visit, inverse)")


def set_branch_scales(modules: List[StageModule], scales: List[float]) -> None:
    """Set each stage's residual-branch scale (``StageModule.branch_scale``)."""
    for m, s in zip(modules, scales):
        m.branch_scale = float(s)
