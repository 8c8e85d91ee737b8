"""Compute precision of a stage, and the fp16 loss scale the data nodes agree on.

``--precision fp32|bf16|fp16``: the stage's forward and backward run under ``torch.autocast`` with
that dtype (fp32: no autocast); the master weights, their gradients and the optimizer state stay
float32 (:class:`node.train.runtime.StageRuntime`). bf16 has float32's exponent range and needs no
loss scaling. fp16 does: small gradients underflow to zero, so the loss is multiplied by a scale
before backward and the gradients are divided by it before anything else reads them.

**Agreement.** :class:`LossScaler` is deterministic: its scale depends only on how many steps were
skipped and when. Every member of a run starts from the same scale and updates it once per committed
iteration with the same fact, "the swarm skipped this step because its global gradient norm was
not finite" (every member computes that from the same norm records), so all data nodes multiply
by the same scale and every stage divides by it. The scale travels with a stage's state (state
transfer to joiners, re-syncs, checkpoints) and in each member's norm record: a member whose scale
differs from the data nodes' (:func:`loss_scales_agree`) treats the iteration as an overflow and
skips its step (it is then re-synced like any replica that did not step).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Dict, Mapping, Optional

__all__ = ["PRECISIONS", "LossScaler", "ScalerConfig", "autocast_dtype", "default_precision", "resolve_precision",
           "loss_scales_agree", "wire_round_trip", "resolve_device", "DEVICES"]

#: ``--device`` values: auto = cuda when a CUDA device is available, else cpu.
DEVICES = ("cpu", "cuda", "auto")


def resolve_device(name: str) -> str:
    """``--device`` checked and resolved ("auto" -> "cuda" or "cpu"); ``ValueError`` (one line) when the
    device cannot be used here."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"--device {name!r} is not a device ({str(e).splitlines()[0] if str(e) else e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name} requested but no CUDA device is available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif dev.type != "cpu":
        raise ValueError(f"--device {name}: only cpu, cuda[:N] and auto are supported")
    return name

PRECISIONS = ("fp32", "bf16", "fp16")


def autocast_dtype(precision: str):
    """The torch dtype ``precision`` computes in under autocast; None for fp32 (no autocast)."""
    import torch

    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {list(PRECISIONS)}")
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def default_precision(device: str) -> str:
    """bf16 on a CUDA device that supports it, else fp32 (CPU autocast works but is slower than fp32)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


def resolve_precision(precision: Optional[str], device: str) -> str:
    """``precision`` checked, or the device's default for None / "auto"."""
    if precision in (None, "auto"):
        return default_precision(device)
    autocast_dtype(precision)  # raises ValueError for an unknown name
    return precision


@dataclass(frozen=True)
class ScalerConfig:
    """torch.cuda.amp.GradScaler's defaults, except a lower ceiling (a scale above 2^24 only overflows)."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000  # finite steps in a row before the scale grows
    min_scale: float = 1.0
    max_scale: float = 2.0**24


class LossScaler:
    """Dynamic loss scale: halves on an overflow (that step is skipped), doubles after
    ``growth_interval`` finite steps in a row. Pure arithmetic, no torch: replicas and data nodes
    that see the same sequence of overflows hold bit-identical scales."""

    def __init__(self, cfg: ScalerConfig = ScalerConfig()):
        if not (cfg.min_scale > 0 and cfg.min_scale <= cfg.init_scale <= cfg.max_scale):
            raise ValueError("need 0 < min_scale <= init_scale <= max_scale")
        if not (0 < cfg.backoff_factor < 1 < cfg.growth_factor) or cfg.growth_interval < 1:
            raise ValueError("need 0 < backoff_factor < 1 < growth_factor and growth_interval >= 1")
        self.cfg = cfg
        self.scale = float(cfg.init_scale)
        self.good_steps = 0  # finite steps since the last change
        self.skipped = 0  # steps skipped for an overflow, in total

    def update(self, overflow: bool) -> None:
        """Record one committed iteration: ``overflow`` = the swarm skipped its step (non-finite norm)."""
        if overflow:
            self.scale = max(self.cfg.min_scale, self.scale * self.cfg.backoff_factor)
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.cfg.growth_interval:
            self.scale = min(self.cfg.max_scale, self.scale * self.cfg.growth_factor)
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped,
                "config": asdict(self.cfg)}

    def load_state_dict(self, state: Mapping) -> None:
        scale = float(state["scale"])
        if not (math.isfinite(scale) and self.cfg.min_scale <= scale <= self.cfg.max_scale):
            raise ValueError(f"loss scale {scale!r} outside [{self.cfg.min_scale}, {self.cfg.max_scale}]")
        self.scale, self.good_steps, self.skipped = scale, int(state["good_steps"]), int(state.get("skipped", 0))

    def __repr__(self) -> str:
        return f"LossScaler(scale={self.scale:g}, good_steps={self.good_steps}, skipped={self.skipped})"


def loss_scales_agree(records: Mapping[str, Mapping], mine: float) -> bool:
    """True unless the canonical data node's norm record carries a loss scale other than ``mine``.

    The canonical data node is the stage-0 member with the lowest peer id, the replica every other
    stage-0 replica re-syncs from; so a member that disagrees skips, is re-synced, and takes that
    scale with the state (two data nodes that disagreed could otherwise skip forever, both halving).
    Records without a ``loss_scale`` (older members) always agree."""
    def field(r, name, default=None):
        return r.get(name, default) if isinstance(r, Mapping) else getattr(r, name, default)

    theirs: Dict[str, float] = {p: float(field(r, "loss_scale")) for p, r in records.items()
                                if int(field(r, "stage", -1)) == 0 and field(r, "loss_scale") is not None}
    if not theirs:
        return True
    return theirs[min(theirs)] == mine


def wire_round_trip(t, compression: str):
    """``t`` as the receiving node gets it over a wire with frame codec ``compression``: a float32
    frame through :mod:`protocol.compression`'s very codec, back on ``t``'s device and dtype. The
    single-process trainers (reference, path trainer) apply it at every hop the swarm makes."""
    from protocol.compression import NO_COMPRESSION
    from protocol.tensor import TensorFrame

    if compression == NO_COMPRESSION:
        return t
    frame = TensorFrame.from_tensor(t.detach().float(), compression=compression)
    return frame.to_tensor().to(device=t.device, dtype=t.dtype)
