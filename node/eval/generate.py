"""Text generation from a gathered checkpoint, optionally with stages omitted.

Runs the stages like :func:`node.eval.omission.evaluate_kept`: stage 0's embedding and layers, the kept
stages in increasing order, then stage 0's final norm and LM head. No KV cache: every new token
re-runs the (at most ``context``-token) window, which is plenty for the model sizes trained here.
Sampling: temperature (0 = greedy), optional top-k, seeded.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from node.errors import UserError
from node.train.model import StageModule

__all__ = ["next_token_logits", "generate_ids"]


@torch.no_grad()
def next_token_logits(modules: Sequence[StageModule], ids: torch.Tensor, kept: Sequence[int],
                      branch_scale: Optional[float] = None) -> torch.Tensor:
    """Logits (B, T, vocab) of the model restricted to ``kept`` (stage 0 first, then in order); ``branch_scale``
    overrides the kept stages' residual-branch scale (node.train.branch_scaling.inference_branch_scale)."""
    h = modules[0].embed(ids)
    for s in kept[1:]:
        h = modules[s](h, branch_scale=branch_scale)
    return modules[0].logits(h)


@torch.no_grad()
def generate_ids(modules: Sequence[StageModule], prompt: List[int], kept: Sequence[int], max_new_tokens: int,
                 temperature: float = 1.0, top_k: Optional[int] = None, seed: int = 0,
                 branch_scale: Optional[float] = None) -> List[int]:
    """``prompt`` followed by ``max_new_tokens`` sampled tokens."""
    if max_new_tokens < 0:
        raise UserError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    if not temperature >= 0.0:
        raise UserError(f"--temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise UserError(f"--top-k must be at least 1, got {top_k}")
    if not prompt:
        raise UserError("the prompt is empty after tokenisation; give at least one character")
    context = modules[0].cfg.context
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    for _ in range(max_new_tokens):
        window = torch.tensor([ids[-context:]], dtype=torch.long)
        logits = next_token_logits(modules, window, kept, branch_scale)[0, -1].float()
        if temperature == 0.0:
            ids.append(int(torch.argmax(logits)))
            continue
        logits = logits / temperature
        if top_k is not None and top_k < logits.numel():
            threshold = torch.topk(logits, top_k).values[-1]
            logits = logits.masked_fill(logits < threshold, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        ids.append(int(torch.multinomial(probs, 1, generator=generator)))
    return ids
