"""Run the four variants of one setting in the same simulator: full pipeline (DT-FM), random
skip, SkipPipe without collision awareness (no TC2) and SkipPipe. Used by ``skippipe plan`` and
``bench/scheduler.py``."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from scheduler.baselines import full_pipeline, random_skip
from scheduler.cost import CostMatrix
from scheduler.paths import PathReport, schedule_paths_report
from scheduler.routes import RouteLimits
from scheduler.schedule import Schedule
from scheduler.simulator import SimResult, simulate

__all__ = ["VARIANTS", "VariantResult", "Comparison", "compare_variants"]

#: Variant names in report order.
VARIANTS = ("full_pipeline", "random_skip", "skippipe_no_tc2", "skippipe")


@dataclass(frozen=True)
class VariantResult:
    """One variant's schedule, its simulation and the wall time spent making it."""

    name: str
    schedule: Schedule
    sim: SimResult
    wall_s: float


@dataclass(frozen=True)
class Comparison:
    """All variants of one setting; ``report`` is SkipPipe's path-search report."""

    variants: Mapping[str, VariantResult]
    report: PathReport

    def time_s(self, name: str) -> float:
        return self.variants[name].sim.iteration_time_s

    def ratio(self, name: str, baseline: str = "full_pipeline") -> float:
        return self.time_s(name) / self.time_s(baseline)

    def to_json(self) -> dict:
        return {
            name: {"iteration_time_s": v.sim.iteration_time_s, "wall_s": v.wall_s, "ratio_vs_full": self.ratio(name)}
            for name, v in self.variants.items()
        }


def compare_variants(
    stages: Sequence[Sequence[int]],
    cost: CostMatrix,
    path_length: int,
    microbatches_per_data_node: int | Mapping[int, int] | Sequence[int],
    memory: int,
    seed: int = 0,
    budget_s: float = 2.0,
    *,
    limits: RouteLimits = RouteLimits(),
    **path_options,
) -> Comparison:
    """Schedule and simulate every variant over the same allocation and global batch."""
    out: dict[str, VariantResult] = {}

    def timed(name: str, fn):
        t = time.perf_counter()
        sched = fn()
        wall = time.perf_counter() - t
        out[name] = VariantResult(name, sched, simulate(sched), wall)

    timed("full_pipeline", lambda: full_pipeline(stages, cost, microbatches_per_data_node, memory))
    timed("random_skip", lambda: random_skip(stages, cost, path_length, microbatches_per_data_node, memory, seed, limits=limits))
    timed(
        "skippipe_no_tc2",
        lambda: schedule_paths_report(
            stages, cost, path_length, microbatches_per_data_node, memory, seed, budget_s, limits=limits,
            collision_aware=False, **path_options
        )[0],
    )
    box: list[PathReport] = []

    def skippipe() -> Schedule:
        sched, rep = schedule_paths_report(
            stages, cost, path_length, microbatches_per_data_node, memory, seed, budget_s, limits=limits, **path_options
        )
        box.append(rep)
        return sched

    timed("skippipe", skippipe)
    return Comparison(out, box[0])
