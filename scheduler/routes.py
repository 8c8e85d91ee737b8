"""Rules on the order of stages along a route: bounded skipping and bounded reordering.

A route visits stage 0 (its data node) and then ``path_length - 1`` distinct other stages. Going
to a stage below the highest one visited so far is a *swap* (reordering); going above it is a
*jump* of ``stage - highest``. The reference limits both (HEAD: at most 2 swaps, each to the
stage right below the highest, jump at most 4); here they are parameters of :class:`RouteLimits`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

__all__ = ["RouteLimits", "sequence_violation", "allowed_sequences"]


@dataclass(frozen=True)
class RouteLimits:
    """Limits on skipping and reordering along one route.

    max_swaps: steps that go below the highest stage visited so far; 2 as in the reference HEAD
        (0 gives skip-only routes, like the ICLR fork).
    max_jump: largest ``stage - highest visited so far`` in one step; 4 as in the reference HEAD
        (bounds how many consecutive stages a microbatch skips).
    max_swap_distance: largest ``highest visited - stage`` of one swap; 1 as in the reference
        HEAD (a swap only exchanges neighbouring stages).
    """

    max_swaps: int = 2
    max_jump: int = 4
    max_swap_distance: int = 1

    def to_json(self) -> dict:
        return {"max_swaps": self.max_swaps, "max_jump": self.max_jump, "max_swap_distance": self.max_swap_distance}

    @classmethod
    def from_json(cls, data: dict) -> "RouteLimits":
        return cls(int(data.get("max_swaps", 2)), int(data.get("max_jump", 4)), int(data.get("max_swap_distance", 1)))


def sequence_violation(stage_seq: Sequence[int], limits: RouteLimits) -> tuple[str, str] | None:
    """``None`` if the stages after stage 0 obey ``limits``, else ``(constraint, message)``.

    Does not check distinctness or stage range (the validator does that first).
    """
    highest = 0
    swaps = 0
    for s in stage_seq:
        if s > highest:
            if s - highest > limits.max_jump:
                return "max-jump", f"jumps from stage {highest} to {s} (max jump {limits.max_jump})"
            highest = s
        else:
            swaps += 1
            if swaps > limits.max_swaps:
                return "max-swaps", f"has {swaps} swaps (max {limits.max_swaps})"
            if highest - s > limits.max_swap_distance:
                return "max-swap-distance", (
                    f"swaps back from stage {highest} to {s} (max swap distance {limits.max_swap_distance})"
                )
    return None


def allowed_sequences(
    n_stages: int, path_length: int, limits: RouteLimits, max_count: int = 20000
) -> list[tuple[int, ...]]:
    """All orders of ``path_length - 1`` distinct non-zero stages allowed by ``limits``, in
    lexicographic order, at most ``max_count`` of them (enumeration is exponential in the path
    length; the cap keeps it bounded and deterministic)."""
    k = path_length - 1
    out: list[tuple[int, ...]] = []

    def rec(seq: list[int], used: set[int], highest: int, swaps: int) -> Iterator[None]:
        if len(out) >= max_count:
            return
        if len(seq) == k:
            out.append(tuple(seq))
            return
        for s in range(1, n_stages):
            if s in used:
                continue
            if s > highest:
                if s - highest > limits.max_jump:
                    continue
                nh, ns = s, swaps
            else:
                if swaps >= limits.max_swaps or highest - s > limits.max_swap_distance:
                    continue
                nh, ns = highest, swaps + 1
            seq.append(s)
            used.add(s)
            rec(seq, used, nh, ns)
            seq.pop()
            used.discard(s)

    rec([], set(), 0, 0)
    return out
