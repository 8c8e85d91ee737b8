"""Compute side of one node: its stage's layers, per-microbatch autograd state, and the optimizer.

A :class:`StageRuntime` keeps, for every microbatch in flight, exactly what its backward pass
needs (the input leaf and the output of the local graph) and drops both as soon as that backward
has run, so a node never holds an activation it no longer needs. Gradients of all microbatches
that visit the node accumulate (summed) in the parameters' ``.grad``; :meth:`mean_grads` turns the
sum into the mean over the visiting microbatches before the replicas average it.

All methods are synchronous and CPU/GPU bound: the trainer calls them from one worker thread per
node, never concurrently, so autograd state is never shared between threads.

The optimizer arithmetic (:func:`make_optimizer`, :func:`clip_coefficient`) lives here so that the
swarm and the single-process reference use literally the same code.

Compute emulation (off unless a :class:`node.dataplane.emulation.ComputePadder` is given): each step
is padded, in the calling compute thread, to ``s/sample/layer x samples x layers x factor`` with
the cost model's factors (forward 1, backward 1.5, loss 0.25), so the node is busy as long as the
emulated hardware would be. The target counts from ``ready_at`` when the caller gives it (the
monotonic time the step could have started: input arrived, node free), else from the call.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Dict, Hashable, Iterable, List, Optional, Tuple

import torch

from node.train.model import StageModule

__all__ = ["OptimConfig", "StageRuntime", "make_optimizer", "clip_coefficient", "squared_norm"]

logger = logging.getLogger(__name__)


def _start_time(ready_at: Optional[float]) -> float:
    """When an emulated step's target starts counting: ``ready_at`` if given (never in the future)."""
    now = time.monotonic()
    return now if ready_at is None else min(now, ready_at)


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with global-norm clipping; one step per iteration."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_norm: float = 1.0  # max global L2 norm of the gradient over ALL stages; <= 0 disables


#: Added to the norm before dividing, as torch.nn.utils.clip_grad_norm_ does.
CLIP_EPS = 1e-6


def make_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.AdamW:
    # foreach=False: identical per-tensor arithmetic whether a stage runs alone or in the reference
    return torch.optim.AdamW(list(params), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, foreach=False)


def squared_norm(tensors: Iterable[torch.Tensor]) -> float:
    """Sum of squares in float64, so the order of stages barely matters for the global norm."""
    return float(sum(float(t.detach().double().pow(2).sum()) for t in tensors))


def clip_coefficient(total_squared_norm: float, clip_norm: float) -> float:
    """Factor to multiply every gradient with (1.0 when no clipping is needed)."""
    if clip_norm <= 0:
        return 1.0
    norm = math.sqrt(max(total_squared_norm, 0.0))
    return min(1.0, clip_norm / (norm + CLIP_EPS))


@dataclass
class _InFlight:
    inputs: Optional[torch.Tensor]  # leaf whose .grad goes back upstream (None for the embedding start)
    outputs: torch.Tensor


class StageRuntime:
    """One stage's module plus the autograd state of the microbatches currently inside it."""

    def __init__(self, module: StageModule, optim: OptimConfig, device: str = "cpu", padder=None):
        """``padder``: optional :class:`node.dataplane.emulation.ComputePadder`; None (default) = real compute only."""
        self.module = module.to(device)
        self.padder = padder
        self.n_layers = len(module.layers)
        self.device = device
        self.stage = module.stage
        self.optim_cfg = optim
        self.optimizer = make_optimizer(self.module.parameters(), optim)
        self._in_flight: Dict[Hashable, _InFlight] = {}
        self.visits = 0  # microbatches whose backward ran here this iteration
        self.peak_in_flight = 0  # most microbatches ever held at once (memory-slot check)
        self.reset_grads()

    # ---------------------------------------------------------------- forward / backward
    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def forward(self, key: Hashable, hidden: torch.Tensor, *, ready_at: Optional[float] = None) -> torch.Tensor:
        """Apply this stage's layers; returns the activation to send on (detached)."""
        t0 = _start_time(ready_at)
        x = hidden.to(self.device).detach().requires_grad_(True)
        y = self.module(x)
        self._hold(key, _InFlight(x, y))
        self._pad("forward", t0, hidden)
        return y.detach()

    def _pad(self, kind: str, started_at: float, batch: torch.Tensor) -> None:
        if self.padder is not None:
            self.padder.pad_blocking(kind, started_at, int(batch.shape[0]), self.n_layers)

    def _hold(self, key: Hashable, state: _InFlight) -> None:
        if key in self._in_flight:
            raise KeyError(f"microbatch {key!r} is already in flight here")
        self._in_flight[key] = state
        self.peak_in_flight = max(self.peak_in_flight, len(self._in_flight))

    def backward(self, key: Hashable, grad_output: torch.Tensor, *, ready_at: Optional[float] = None) -> torch.Tensor:
        """Backward through the stored graph; returns d loss / d input and frees the microbatch."""
        t0 = _start_time(ready_at)
        state = self._in_flight.pop(key)
        state.outputs.backward(grad_output.to(self.device))
        self.visits += 1
        assert state.inputs is not None and state.inputs.grad is not None
        self._pad("backward", t0, grad_output)
        return state.inputs.grad.detach()

    def start(self, key: Hashable, tokens: torch.Tensor, *, ready_at: Optional[float] = None) -> torch.Tensor:
        """Data node: embedding + stage-0 layers for a new microbatch."""
        t0 = _start_time(ready_at)
        y = self.module.embed(tokens.to(self.device))
        self._hold(key, _InFlight(None, y))
        self._pad("forward", t0, tokens)
        return y.detach()

    def loss_backward(self, hidden: torch.Tensor, targets: torch.Tensor, *,
                      ready_at: Optional[float] = None) -> Tuple[float, torch.Tensor]:
        """Data node: final norm + LM head + loss on the returning activation, backward to it.

        Stores nothing: the head's graph is freed right here and only the gradient goes back.
        """
        t0 = _start_time(ready_at)
        x = hidden.to(self.device).detach().requires_grad_(True)
        loss = self.module.head_loss(x, targets.to(self.device))
        loss.backward()
        assert x.grad is not None
        self._pad("loss", t0, hidden)
        return float(loss.detach()), x.grad.detach()

    def finish(self, key: Hashable, grad_output: torch.Tensor, *, ready_at: Optional[float] = None) -> None:
        """Data node: backward through stage-0 layers + embedding; the microbatch is complete."""
        t0 = _start_time(ready_at)
        state = self._in_flight.pop(key)
        state.outputs.backward(grad_output.to(self.device))
        self.visits += 1
        self._pad("backward", t0, grad_output)

    def drop(self, key: Hashable) -> bool:
        """Forget a microbatch that will never come back (failed hop)."""
        return self._in_flight.pop(key, None) is not None

    # ---------------------------------------------------------------- gradients and step
    def parameters(self) -> List[torch.nn.Parameter]:
        return list(self.module.parameters())

    def grads(self) -> List[torch.Tensor]:
        return [p.grad for p in self.module.parameters()]  # type: ignore[misc]

    def reset_grads(self) -> None:
        """Zero (not None) gradients, so AdamW steps every parameter even on an unvisited stage."""
        for p in self.module.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()
        self.visits = 0

    def mean_grads(self) -> None:
        """Sum over visiting microbatches -> mean over them (no-op when nothing visited)."""
        if self.visits > 1:
            for g in self.grads():
                g.div_(self.visits)

    def grad_squared_norm(self) -> float:
        return squared_norm(self.grads())

    def scale_grads(self, factor: float) -> None:
        if factor != 1.0:
            for g in self.grads():
                g.mul_(factor)

    def step(self) -> None:
        if self._in_flight:
            logger.warning("stage %d steps with %d microbatches still in flight", self.stage, len(self._in_flight))
            self._in_flight.clear()
        self.optimizer.step()
        self.reset_grads()

    def skip_step(self) -> None:
        """End the iteration without an optimizer step (a non-finite gradient is never applied)."""
        self._in_flight.clear()
        self.reset_grads()

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def checksum(self) -> float:
        """Cheap parameter fingerprint; replicas of a stage must agree (re-sync is issue #6)."""
        with torch.no_grad():
            return float(sum(p.double().sum() for p in self.module.parameters()))
