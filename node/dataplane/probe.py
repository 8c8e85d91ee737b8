"""The stage probe: a small forward that only a holder of a stage's current weights answers right.

A peer that wants to enter a schedule epoch is asked, with its admission challenge, to run its stage
on an input derived from the challenger's fresh nonce (:func:`probe_input`: 1 x :data:`PROBE_TOKENS`
x ``d_model``, standard normal) and to send back a short sketch of what the stage *added* to it
(:func:`output_sketch`: the RMS of ``forward(x) - x`` and its projections on
:data:`PROBE_PROJECTIONS` random unit directions, all seeded by the nonce). The sketch is of the
residual change, not of the output: every stage's output is ``x`` plus its branches, so the output of
any weights at all (random, zero) is close to ``x`` and would pass.

A live replica of the same stage computes the same on its own weights (:func:`stage_sketch`) and
accepts when the two agree within :data:`PROBE_TOLERANCE` (:func:`sketches_close`: relative
Euclidean distance). A joiner holds the state it downloaded a few iterations ago, so the tolerance
must admit that lag and refuse weights that are not the stage's. Measured on the ``tiny`` model
(stages 1 and 3, AdamW at lr 1e-3, the whole model trained 200 steps on a patterned token sequence first,
20 nonces; ``tests/node_units/test_stage_probe.py`` repeats a short version), the distance to the live
replica's sketch was, mean (worst): 0.02 (0.04) after 1 step, 0.09 (0.20) after 5, 0.15 (0.24) after
10, 0.23 (0.45) after 20 and 0.31 (0.60) after 40 steps; a re-initialised stage (another seed) 1.0 (best
0.77), the run's initial weights (a node that never downloaded) 0.95 (best 0.80), zeroed weights 1.0.
:data:`PROBE_TOLERANCE` = 0.5 admits a joiner up to about 20 steps behind (a candidate refreshes its proof
every 10 steps: :mod:`node.train.proof`) and refuses weights that are not the stage's by a margin of
0.27 or more. Early in a run the stage is still close to its initial weights, which then pass too: they
*are* nearly the stage's weights.

Those figures are with 8 projections over 20 nonces. Over 300 nonces (same set-up, 200 steps, then 10 and
20 steps behind) 8 projections left tails on both sides of the tolerance: 20 steps behind, worst 0.63 (3 of
300 refused); re-initialised weights best 0.61, the initial weights best 0.51. A daemon test saw a candidate
with re-initialised weights admitted once: every challenge is a fresh draw, and a refused candidate asks
again. With 32 projections (:data:`PROBE_PROJECTIONS`) the same 300 nonces gave 20 steps behind worst 0.44
(none refused), re-initialised best 0.82, initial best 0.83: the sketch is 33 numbers instead of 9, and the
forward, not the projections, is what a probe costs.

Every number of a peer's sketch is validated (:func:`check_sketch`: a list of exactly
:data:`SKETCH_LEN` finite floats); the forward runs under ``no_grad`` on the caller's compute thread.
"""

from __future__ import annotations

import hashlib
import math
from typing import List, Optional, Sequence, Tuple

import torch

__all__ = ["PROBE_TOKENS", "PROBE_PROJECTIONS", "PROBE_TOLERANCE", "SKETCH_LEN", "probe_input", "output_sketch",
           "stage_sketch", "check_sketch", "sketches_close"]

#: Tokens of the probe input: enough positions that attention mixes several of them (a stage's
#: attention weights matter), few enough that a forward costs next to nothing even for a large stage.
PROBE_TOKENS = 4
#: Random directions the residual change is projected on: with the RMS, 33 numbers that two different
#: weight sets match only by accident (8 left tails on both sides of the tolerance: module docstring), small
#: enough for a challenge reply.
PROBE_PROJECTIONS = 32
#: Length of a sketch: the RMS, then the projections.
SKETCH_LEN = 1 + PROBE_PROJECTIONS
#: Largest relative distance between a candidate's sketch and a live replica's that is accepted (see
#: the module docstring for the measured figures: at worst 0.24 after 10 steps and 0.45 after 20; at best
#: 0.77 for re-initialised weights, 1.0 for zeroed ones).
PROBE_TOLERANCE = 0.5
#: Floor of the reference sketch's norm in :func:`sketches_close` (a stage whose branches add nothing
#: measurable cannot tell weights apart; it must not divide by zero either).
MIN_REFERENCE_NORM = 1e-12


def _generator(nonce: bytes, purpose: bytes) -> torch.Generator:
    seed = int.from_bytes(hashlib.sha256(purpose + nonce).digest()[:8], "little") & ((1 << 63) - 1)
    return torch.Generator().manual_seed(seed)


def probe_input(nonce: bytes, d_model: int, tokens: int = PROBE_TOKENS) -> torch.Tensor:
    """The probe's input for ``nonce``: (1, ``tokens``, ``d_model``) float32, standard normal (the scale
    of the activations a stage sees after its predecessors' norms)."""
    return torch.randn(1, tokens, d_model, generator=_generator(nonce, b"probe-input"), dtype=torch.float32)


def output_sketch(x: torch.Tensor, out: torch.Tensor, nonce: bytes) -> List[float]:
    """RMS of ``out - x`` and its projections on :data:`PROBE_PROJECTIONS` unit directions seeded by ``nonce``."""
    delta = (out.detach().float().cpu() - x.detach().float().cpu()).reshape(-1)
    dirs = torch.randn(PROBE_PROJECTIONS, delta.numel(), generator=_generator(nonce, b"probe-dirs"))
    dirs = dirs / dirs.norm(dim=1, keepdim=True)
    rms = float(delta.pow(2).mean().sqrt())
    return [rms] + [float(v) for v in dirs @ delta]


def stage_sketch(module: torch.nn.Module, nonce: bytes, d_model: int) -> List[float]:
    """``module``'s sketch for ``nonce`` (a forward under ``no_grad`` in the module's device and dtype)."""
    x = probe_input(nonce, d_model)
    param = next(module.parameters(), None)
    device, dtype = (param.device, param.dtype) if param is not None else (torch.device("cpu"), torch.float32)
    with torch.no_grad():
        out = module(x.to(device=device, dtype=dtype))
    return output_sketch(x, out, nonce)


def check_sketch(answer: object) -> Optional[List[float]]:
    """A peer's sketch as a list of :data:`SKETCH_LEN` finite floats, or None when it is anything else."""
    if not isinstance(answer, (list, tuple)) or len(answer) != SKETCH_LEN:
        return None
    out = []
    for v in answer:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
            return None
        out.append(float(v))
    return out


def sketches_close(theirs: Sequence[float], ours: Sequence[float],
                   tolerance: float = PROBE_TOLERANCE) -> Tuple[bool, float]:
    """Whether ``theirs`` is within ``tolerance`` of ``ours`` (relative Euclidean distance), and the distance."""
    if len(theirs) != len(ours):
        return False, math.inf
    diff = math.sqrt(sum((a - b) ** 2 for a, b in zip(theirs, ours)))
    norm = max(math.sqrt(sum(b * b for b in ours)), MIN_REFERENCE_NORM)
    distance = diff / norm
    return distance <= tolerance, distance
