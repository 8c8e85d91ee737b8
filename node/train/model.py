"""LLaMa-style decoder split into pipeline stages of consecutive layers.

SkipPipe sends each microbatch through a *subset* of the stages, possibly in a different order, so
every stage is a self-contained module: it owns its layers and computes rotary embeddings from the
sequence positions itself (attention is causal, so no mask travels between stages). Stage 0 is
special: it holds the token embedding, its own layers, the final RMSNorm and the LM head, because
the data node both starts and ends every microbatch (the loss is computed where the targets are).

Initial weights are a pure function of ``(seed, stage)``, so the swarm and the single-process
reference (:mod:`node.train.reference`) start from bit-identical parameters.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import asdict, dataclass, replace
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from node.errors import UserError

__all__ = [
    "ModelConfig",
    "MODEL_SIZES",
    "model_config",
    "load_model_config_file",
    "MODEL_FILE_KEYS",
    "RMSNorm",
    "DecoderLayer",
    "StageModule",
    "build_stage",
    "count_parameters",
]

logger = logging.getLogger(__name__)

#: Standard deviation of the normal initialisation of every weight matrix (GPT-2/LLaMa practice).
INIT_STD = 0.02
#: Base of the rotary position embedding frequencies.
ROPE_THETA = 10000.0
#: Epsilon inside RMSNorm.
NORM_EPS = 1e-5


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the whole model and of its split into stages."""

    vocab_size: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    context: int
    n_stages: int
    layers_per_stage: int

    @property
    def n_layers(self) -> int:
        return self.n_stages * self.layers_per_stage

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def validate(self) -> "ModelConfig":
        problems = []
        if min(self.vocab_size, self.d_model, self.n_heads, self.n_kv_heads, self.ffn_dim, self.context) <= 0:
            problems.append("all dimensions must be positive")
        if self.d_model % self.n_heads:
            problems.append(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % max(self.n_kv_heads, 1):
            problems.append(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            problems.append(f"head dim {self.head_dim} must be even for rotary embeddings")
        if self.n_stages < 1 or self.layers_per_stage < 1:
            problems.append("need at least one stage and one layer per stage")
        if problems:
            raise UserError("invalid model config: " + "; ".join(problems))
        return self

    def to_dict(self) -> Dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, int]) -> "ModelConfig":
        return cls(**{k: int(v) for k, v in d.items()}).validate()


#: Named sizes. ``tiny`` keeps CPU tests quick; ``500m`` is the paper's LLaMa-500M configuration
#: (d 1024, 24 layers, 16 heads, FFN 4096, context 1024, 6 stages x 4 layers, 32k vocabulary).
MODEL_SIZES: Dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=256, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=176, context=64,
                        n_stages=6, layers_per_stage=1),
    "small": ModelConfig(vocab_size=256, d_model=256, n_heads=8, n_kv_heads=4, ffn_dim=688, context=256,
                         n_stages=6, layers_per_stage=2),
    "500m": ModelConfig(vocab_size=32000, d_model=1024, n_heads=16, n_kv_heads=16, ffn_dim=4096, context=1024,
                        n_stages=6, layers_per_stage=4),
}


def model_config(size: str = "tiny", **overrides: int) -> ModelConfig:
    """A named size, optionally with explicit dimensions overridden (``vocab_size=...`` etc.)."""
    if size not in MODEL_SIZES:
        raise UserError(f"unknown model size {size!r}; choose one of {', '.join(MODEL_SIZES)}")
    return replace(MODEL_SIZES[size], **{k: v for k, v in overrides.items() if v is not None}).validate()


#: Keys of a ``--model-config`` JSON file -> ModelConfig fields (the ModelConfig names work too).
MODEL_FILE_KEYS: Dict[str, str] = {
    "layers": "n_layers", "d_model": "d_model", "heads": "n_heads", "kv_heads": "n_kv_heads", "ffn": "ffn_dim",
    "vocab": "vocab_size", "context": "context", "stages": "n_stages",
}
_FIELD_KEYS = {"vocab_size", "d_model", "n_heads", "n_kv_heads", "ffn_dim", "context", "n_stages",
               "layers_per_stage", "n_layers"}


def load_model_config_file(path: "str | os.PathLike", vocab_size: Optional[int] = None) -> ModelConfig:
    """A model shape from a JSON file: ``{"layers", "d_model", "heads", "kv_heads", "ffn", "vocab",
    "context", "stages"}`` (``kv_heads`` defaults to ``heads``; ``vocab`` may be left out and then
    comes from the tokenizer, ``vocab_size``). ``layers`` must split evenly into ``stages``.
    Every mistake is one UserError naming the file."""
    import json
    import pathlib

    p = pathlib.Path(path).expanduser()
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"--model-config {p}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--model-config {p}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"--model-config {p} is not valid JSON: {e.msg} at line {e.lineno}") from None
    if not isinstance(raw, dict):
        raise UserError(f"--model-config {p} must hold a JSON object")
    fields: Dict[str, int] = {}
    for key, value in raw.items():
        name = MODEL_FILE_KEYS.get(key, key)
        if name not in _FIELD_KEYS:
            raise UserError(f"--model-config {p}: unknown key {key!r} (known: {', '.join(MODEL_FILE_KEYS)})")
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"--model-config {p}: {key} must be a whole number, got {value!r}")
        if value <= 0:
            raise UserError(f"--model-config {p}: {key} must be positive, got {value}")
        fields[name] = value
    if "vocab_size" not in fields:
        if vocab_size is None:
            raise UserError(f"--model-config {p}: no vocab given and no tokenizer to take it from")
        fields["vocab_size"] = vocab_size
    elif vocab_size is not None and fields["vocab_size"] != vocab_size:
        raise UserError(f"--model-config {p}: vocab {fields['vocab_size']} differs from the tokenizer's vocabulary "
                        f"of {vocab_size} tokens (leave vocab out to take the tokenizer's)")
    fields.setdefault("n_kv_heads", fields.get("n_heads", 0))
    missing = [k for k, f in MODEL_FILE_KEYS.items() if f not in fields and not (f == "n_layers" and "layers_per_stage" in fields)]
    if missing:
        raise UserError(f"--model-config {p}: missing {', '.join(missing)}")
    n_layers = fields.pop("n_layers", None)
    if n_layers is not None:
        if n_layers % fields["n_stages"]:
            raise UserError(f"--model-config {p}: {n_layers} layers do not split evenly into {fields['n_stages']} stages")
        per = n_layers // fields["n_stages"]
        if fields.setdefault("layers_per_stage", per) != per:
            raise UserError(f"--model-config {p}: layers {n_layers} != stages x layers_per_stage")
    try:
        return ModelConfig(**fields).validate()
    except UserError as e:
        raise UserError(f"--model-config {p}: {e}") from None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = NORM_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(head_dim: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for the given sequence positions, shape (T, head_dim/2)."""
    # built on the positions' device: a CPU table here broke every stage placed on a GPU
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim
    inv_freq = 1.0 / (ROPE_THETA ** exponents)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :h/2], x[..., h/2:]) of a (B, H, T, head_dim) tensor."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention: ``n_kv_heads`` key/value heads shared by ``n_heads`` queries."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.n_kv_heads != self.n_heads:
            repeat = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, branch_scale: float = 1.0) -> torch.Tensor:
        if branch_scale == 1.0:  # the training path: no extra multiply, bit-identical to the plain block
            x = x + self.attn(self.attn_norm(x), cos, sin)
            return x + self.mlp(self.mlp_norm(x))
        x = x + branch_scale * self.attn(self.attn_norm(x), cos, sin)
        return x + branch_scale * self.mlp(self.mlp_norm(x))


class StageModule(nn.Module):
    """One pipeline stage: ``layers_per_stage`` decoder layers, plus embedding/head for stage 0.

    ``forward(hidden)`` applies this stage's layers to a (B, T, d) activation; RoPE tables are
    computed from positions ``0..T-1`` here, so stages can be visited in any order. Stage 0
    additionally has :meth:`embed` (tokens -> activation after its own layers) and
    :meth:`head_loss` (activation -> mean next-token cross-entropy).
    """

    def __init__(self, cfg: ModelConfig, stage: int):
        super().__init__()
        if not 0 <= stage < cfg.n_stages:
            raise UserError(f"stage {stage} out of range for a {cfg.n_stages}-stage model")
        self.cfg, self.stage = cfg, stage
        #: residual-branch scale at inference (1.0 = the plain model). A stage that training visited
        #: with probability p can be run with scale p at full depth, the stochastic-depth inference
        #: rule: the residual stream then has the magnitude the later stages saw in training.
        #: Not a parameter and not checkpointed: it is a choice of how to run the model.
        self.branch_scale = 1.0
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers_per_stage))
        self.embedding: Optional[nn.Embedding] = None
        self.final_norm: Optional[RMSNorm] = None
        self.lm_head: Optional[nn.Linear] = None
        if stage == 0:
            self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.final_norm = RMSNorm(cfg.d_model)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor, branch_scale: Optional[float] = None) -> torch.Tensor:
        """``branch_scale`` overrides :attr:`branch_scale` for this call (the trainer's training scale,
        node.train.branch_scaling), so the module itself stays the plain model for sketches and exports."""
        scale = self.branch_scale if branch_scale is None else float(branch_scale)
        t = hidden.shape[1]
        if t > self.cfg.context:
            raise ValueError(f"sequence length {t} exceeds context {self.cfg.context}")
        cos, sin = rotary_tables(self.cfg.head_dim, torch.arange(t, device=hidden.device))
        cos, sin = cos.to(hidden.device), sin.to(hidden.device)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, scale)
        return hidden

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.embedding is not None, "only stage 0 embeds tokens"
        return self.forward(self.embedding(tokens))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.final_norm is not None and self.lm_head is not None, "only stage 0 has the LM head"
        return self.lm_head(self.final_norm(hidden))

    def head_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (targets are already shifted by the data loader)."""
        logits = self.logits(hidden)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


def _init_weights(module: StageModule, generator: torch.Generator) -> None:
    """Normal(0, INIT_STD) for matrices, scaled down for residual outputs; norms start at 1."""
    residual_std = INIT_STD / math.sqrt(2 * module.cfg.n_layers)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, residual_std, generator=generator)
            else:
                p.normal_(0.0, INIT_STD, generator=generator)


def build_stage(cfg: ModelConfig, stage: int, seed: int = 0) -> StageModule:
    """Stage ``stage`` with initial weights determined only by ``(seed, stage)``."""
    module = StageModule(cfg, stage)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + stage)
    _init_weights(module, generator)
    return module


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
