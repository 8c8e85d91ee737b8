"""Compute side of one node: its stage's layers, per-microbatch autograd state, and the optimizer.

A :class:`StageRuntime` keeps, for every microbatch in flight, exactly what its backward pass
needs (the input leaf and the output of the local graph) and drops both as soon as that backward
has run, so a node never holds an activation it no longer needs. Gradients of all microbatches
that visit the node accumulate (summed) in the parameters' ``.grad``; :meth:`mean_grads` turns the
sum into the mean over the visiting microbatches before the replicas average it.

All methods are synchronous and CPU/GPU bound: the trainer calls them from one worker thread per
node, never concurrently, so autograd state is never shared between threads (and the event loop
never waits on the GPU).

Devices: everything a stage computes lives on ``device``. Tensors handed in (decoded frames, data
batches) are moved there by :class:`HostToDevice`: on CUDA through pinned (page-locked) host memory
with a non-blocking copy, elsewhere as they are. Activations and gradients leave a stage as float32
(the *boundary dtype*, whatever the compute precision), so the wire codecs of
:mod:`protocol.compression` and the data-plane guard see one dtype.

Precision (:mod:`node.train.precision`): ``precision="bf16"``/``"fp16"`` runs the stage's forward
(and so its backward) under ``torch.autocast``; parameters, their gradients and the AdamW state stay
float32 (the master weights). fp16 adds a :class:`~node.train.precision.LossScaler`: the data node
multiplies the loss by its scale, every stage divides its gradients by it in :meth:`mean_grads`, a
non-finite gradient makes :meth:`grad_squared_norm` infinite (so the swarm skips the step) and
:meth:`step`/:meth:`skip_step` update the scale.

The optimizer arithmetic (:func:`make_optimizer`, :func:`clip_coefficient`) lives here so that the
swarm and the single-process reference use literally the same code.

Compute emulation (off unless a :class:`node.dataplane.emulation.ComputePadder` is given): each step
is padded, in the calling compute thread, to ``s/sample/layer x samples x layers x factor`` with
the cost model's factors (forward 1, backward 1.5, loss 0.25), so the node is busy as long as the
emulated hardware would be. The target counts from ``ready_at`` when the caller gives it (the
monotonic time the step could have started: input arrived, node free), else from the call.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Dict, Hashable, Iterable, List, Optional, Tuple

import torch

from node.train.compute_meter import ComputeMeter
from node.train.model import StageModule
from node.train.precision import LossScaler, autocast_dtype
from node.train.timing import synchronize

__all__ = ["OptimConfig", "StageRuntime", "HostToDevice", "make_optimizer", "import_optimizer_machinery",
           "clip_coefficient", "squared_norm",
           "BOUNDARY_DTYPE"]

#: dtype of every activation and gradient a stage hands out (and of the frames on the wire before their codec)
BOUNDARY_DTYPE = torch.float32

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


def import_optimizer_machinery() -> None:
    """Create (and drop) one optimizer. The first ``torch.optim`` optimizer of a process imports
    ``torch._dynamo`` and ``sympy``: seconds on an idle core, over ten on a loaded one. A training daemon
    does it before its event loop starts: on the loop it stalled the heartbeats (found by the loop's stall
    report), and in a worker thread beside the busy loop it took several times longer (the set-up before
    the first iteration went from 12 s to 42-90 s in the 12-daemon chaos test)."""
    make_optimizer([torch.nn.Parameter(torch.zeros(1))], OptimConfig())


def squared_norm(tensors: Iterable[torch.Tensor]) -> float:
    """Sum of squares in float64, so the order of stages barely matters for the global norm. Summed on
    the tensors' device and read back once: on a GPU each read is a wait for the device."""
    parts = [t.detach().double().pow(2).sum() for t in tensors]
    return float(torch.stack(parts).sum()) if parts else 0.0


def clip_coefficient(total_squared_norm: float, clip_norm: float) -> float:
    """Factor to multiply every gradient with (1.0 when no clipping is needed)."""
    if clip_norm <= 0:
        return 1.0
    norm = math.sqrt(max(total_squared_norm, 0.0))
    return min(1.0, clip_norm / (norm + CLIP_EPS))


class HostToDevice:
    """Moves tensors onto one device. From CPU to CUDA the tensor is staged in pinned memory
    (torch's caching host allocator: a block is reused only once the copy out of it has finished)
    and copied with ``non_blocking=True``, so the copy overlaps with host work; the compute that
    uses it is queued behind the copy on the same stream. Other moves are plain ``.to``; a tensor
    already on the device is returned as is."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self.copies = 0  # host-to-device copies made (tests and metrics)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if t.device == self.device or (self.device.index is None and t.device.type == self.device.type):
            return t
        self.copies += 1
        if self.pinned and t.device.type == "cpu":
            src = t if t.is_pinned() else t.pin_memory()
            return src.to(self.device, non_blocking=True)
        return t.to(self.device)


@dataclass
class _InFlight:
    inputs: Optional[torch.Tensor]  # leaf whose .grad goes back upstream (None for the embedding start)
    outputs: torch.Tensor


class StageRuntime:
    """One stage's module plus the autograd state of the microbatches currently inside it."""

    def __init__(self, module: StageModule, optim: OptimConfig, device="cpu", padder=None, precision: str = "fp32"):
        """``padder``: optional :class:`node.dataplane.emulation.ComputePadder`; None (default) = real compute only.
        ``precision``: "fp32", "bf16" or "fp16" (autocast; see the module docstring)."""
        self.device = torch.device(device)
        self.module = module.to(self.device)
        self.padder = padder
        #: this stage's measured compute speed (published in the node's advert for the coordinator)
        self.meter = ComputeMeter()
        self.n_layers = len(module.layers)
        self.stage = module.stage
        self.optim_cfg = optim
        self.precision = precision
        self._amp_dtype = autocast_dtype(precision)
        if self._amp_dtype is not None and self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"precision {precision} needs autocast, which device {self.device} lacks; use fp32")
        self.scaler: Optional[LossScaler] = LossScaler() if precision == "fp16" else None
        self.to_device = HostToDevice(self.device)
        self.optimizer = make_optimizer(self.module.parameters(), optim)
        self._in_flight: Dict[Hashable, _InFlight] = {}
        self.visits = 0  # microbatches whose backward ran here this iteration
        self.peak_in_flight = 0  # most microbatches ever held at once (memory-slot check)
        self._overflow = False  # fp16: a gradient this stage computed this iteration was not finite
        #: residual-branch scale of this stage's forwards while training (node.train.branch_scaling; the
        #: epoch's visit share sets it); the module itself stays the plain model
        self.branch_scale = 1.0
        self.reset_grads()

    @property
    def loss_scale(self) -> float:
        """The factor the data node multiplies its loss with (1.0 unless fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def _autocast(self):
        if self._amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self._amp_dtype)

    def _leaving(self, t: torch.Tensor) -> torch.Tensor:
        """An activation or gradient as it leaves the stage: detached, float32."""
        return t.detach().to(BOUNDARY_DTYPE)

    def _gradient_out(self, g: torch.Tensor) -> torch.Tensor:
        """With a loss scale, a non-finite input gradient is sent as zeros and marks the iteration an
        overflow (the swarm then skips its step): a receiver's guard would refuse it, dropping the
        microbatch, while the overflow is the loss scaler's to handle."""
        if self.scaler is not None and not bool(torch.isfinite(g).all()):
            self._overflow = True
            g = torch.zeros_like(g)
        return self._leaving(g)

    # ---------------------------------------------------------------- forward / backward
    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def forward(self, key: Hashable, hidden: torch.Tensor, *, ready_at: Optional[float] = None) -> torch.Tensor:
        """Apply this stage's layers; returns the activation to send on (detached)."""
        began = time.monotonic()
        t0 = _start_time(ready_at)
        x = self.to_device(hidden).detach().to(BOUNDARY_DTYPE).requires_grad_(True)
        with self._autocast():
            y = self.module(x) if self.branch_scale == 1.0 else self.module(x, branch_scale=self.branch_scale)
        self._hold(key, _InFlight(x, y))
        self._pad("forward", t0, hidden, began)
        return self._leaving(y)

    def _pad(self, kind: str, started_at: float, batch: torch.Tensor, began: float) -> None:
        """Time the step for :attr:`meter`, then pad it to its emulated time (if emulated). The meter gets the
        step's own compute (from ``began``, when the compute thread took it up; on a GPU after waiting for the
        queued kernels, else the clock would measure their launch), or the emulated time when that is longer:
        not the wait before the step, which is the event loop's load (more microbatches, more messages) and would
        feed a busy node's share back into its measured speed."""
        samples = int(batch.shape[0])
        if kind in ComputeMeter.KINDS:
            if self.device.type != "cpu":
                synchronize(self.device)
            emulated = self.padder.target_s(kind, samples, self.n_layers) if self.padder is not None else 0.0
            self.meter.record(kind, max(time.monotonic() - began, emulated), samples, self.n_layers)
        if self.padder is not None:
            self.padder.pad_blocking(kind, started_at, samples, self.n_layers)

    def _hold(self, key: Hashable, state: _InFlight) -> None:
        if key in self._in_flight:
            raise KeyError(f"microbatch {key!r} is already in flight here")
        self._in_flight[key] = state
        self.peak_in_flight = max(self.peak_in_flight, len(self._in_flight))

    def backward(self, key: Hashable, grad_output: torch.Tensor, *, ready_at: Optional[float] = None) -> torch.Tensor:
        """Backward through the stored graph; returns d loss / d input and frees the microbatch."""
        began = time.monotonic()
        t0 = _start_time(ready_at)
        state = self._in_flight.pop(key)
        state.outputs.backward(self.to_device(grad_output).to(state.outputs.dtype))
        self.visits += 1
        assert state.inputs is not None and state.inputs.grad is not None
        self._pad("backward", t0, grad_output, began)
        return self._gradient_out(state.inputs.grad)

    def start(self, key: Hashable, tokens: torch.Tensor, *, ready_at: Optional[float] = None) -> torch.Tensor:
        """Data node: embedding + stage-0 layers for a new microbatch."""
        began = time.monotonic()
        t0 = _start_time(ready_at)
        with self._autocast():
            y = self.module.embed(self.to_device(tokens))
        self._hold(key, _InFlight(None, y))
        self._pad("forward", t0, tokens, began)
        return self._leaving(y)

    def loss_backward(self, hidden: torch.Tensor, targets: torch.Tensor, *,
                      ready_at: Optional[float] = None) -> Tuple[float, torch.Tensor]:
        """Data node: final norm + LM head + loss on the returning activation, backward to it.

        Stores nothing: the head's graph is freed right here and only the gradient goes back.
        """
        began = t0 = _start_time(ready_at)
        loss, grad = self.loss_and_grad(hidden, targets)
        self._pad("loss", t0, hidden, began)
        return float(loss), grad

    def loss_and_grad(self, hidden: torch.Tensor, targets: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """:meth:`loss_backward` without reading the loss back to the host: (loss on the device, gradient)."""
        x = self.to_device(hidden).detach().to(BOUNDARY_DTYPE).requires_grad_(True)
        with self._autocast():
            loss = self.module.head_loss(x, self.to_device(targets))
        (loss * self.scaler.scale if self.scaler is not None else loss).backward()
        assert x.grad is not None
        return loss.detach().float(), self._gradient_out(x.grad)

    def finish(self, key: Hashable, grad_output: torch.Tensor, *, ready_at: Optional[float] = None) -> None:
        """Data node: backward through stage-0 layers + embedding; the microbatch is complete."""
        began = time.monotonic()
        t0 = _start_time(ready_at)
        state = self._in_flight.pop(key)
        state.outputs.backward(self.to_device(grad_output).to(state.outputs.dtype))
        self.visits += 1
        self._pad("backward", t0, grad_output, began)

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
        self._overflow = False

    def mean_grads(self) -> None:
        """Sum over visiting microbatches -> mean over them (no-op when nothing visited); with a loss
        scale, also divided by it (before averaging, so the replicas exchange unscaled gradients)."""
        divisor = max(self.visits, 1) * self.loss_scale
        if divisor != 1:
            for g in self.grads():
                g.div_(divisor)

    def grad_squared_norm(self) -> float:
        if self._overflow:
            return math.inf
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
        if self.scaler is not None:
            self.scaler.update(overflow=False)

    def skip_step(self) -> None:
        """End the iteration without an optimizer step (a non-finite gradient is never applied)."""
        self._in_flight.clear()
        self.reset_grads()
        if self.scaler is not None:
            self.scaler.update(overflow=True)

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        state = {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.scaler is not None:
            state["loss_scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])

    def checksum(self) -> float:
        """Cheap parameter fingerprint; replicas of a stage must agree."""
        with torch.no_grad():  # summed on the device, read back once (one wait for a GPU, not one per parameter)
            return float(torch.stack([p.double().sum() for p in self.module.parameters()]).sum())
