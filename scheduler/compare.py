"""Run the four variants of one setting in the same simulator: full pipeline (DT-FM), random
skip, SkipPipe without collision awareness (no TC2) and SkipPipe. Used by ``skippipe plan`` and
``bench/schedule_search.py``."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from scheduler.baselines import full_pipeline, random_skip
from scheduler.bounds import LowerBound, iteration_lower_bound
from scheduler.cost import CostMatrix
from scheduler.paths import PathReport, normalise_request, search_paths
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
    """All variants of one setting; ``report`` is SkipPipe's path-search report and ``bound`` a
    lower bound on the iteration time of any valid schedule of the setting (the full pipeline
    solves a different problem, path length = every stage, so the bound does not apply to it)."""

    variants: Mapping[str, VariantResult]
    report: PathReport
    bound: LowerBound

    def time_s(self, name: str) -> float:
        return self.variants[name].sim.iteration_time_s

    def ratio(self, name: str, baseline: str = "full_pipeline") -> float:
        return self.time_s(name) / self.time_s(baseline)

    def gap(self, name: str = "skippipe") -> float:
        """``time / bound - 1`` of a skipping variant."""
        return self.bound.gap(self.time_s(name))

    def to_json(self) -> dict:
        """Per variant: iteration time, ratio to the full pipeline and (skipping variants) the
        gap to the bound. No wall times: this part is a function of the inputs and seed."""
        out = {}
        for name in self.variants:
            out[name] = {"iteration_time_s": self.time_s(name), "ratio_vs_full": self.ratio(name)}
            if name != "full_pipeline":
                out[name]["gap_to_bound"] = self.gap(name)
        return out


def compare_variants(
    stages: Sequence[Sequence[int]],
    cost: CostMatrix,
    path_length: int,
    microbatches_per_data_node: int | Mapping[int, int] | Sequence[int],
    memory: int,
    seed: int = 0,
    budget_s: float = 60.0,
    *,
    limits: RouteLimits = RouteLimits(),
    **path_options,
) -> Comparison:
    """Schedule and simulate every variant over the same allocation and global batch, and
    bound the iteration time of the skipping problem (:mod:`scheduler.bounds`). ``budget_s``:
    wall-clock safety cap of the path search (see :func:`scheduler.paths.schedule_paths_report`)."""
    out: dict[str, VariantResult] = {}

    def timed(name: str, fn):
        t = time.perf_counter()
        sched = fn()
        wall = time.perf_counter() - t
        out[name] = VariantResult(name, sched, simulate(sched), wall)

    timed("full_pipeline", lambda: full_pipeline(stages, cost, microbatches_per_data_node, memory))
    timed("random_skip", lambda: random_skip(stages, cost, path_length, microbatches_per_data_node, memory, seed, limits=limits))
    t = time.perf_counter()
    found = search_paths(stages, cost, path_length, microbatches_per_data_node, memory, seed, budget_s, limits=limits,
                         **path_options)
    wall = time.perf_counter() - t
    out["skippipe_no_tc2"] = VariantResult("skippipe_no_tc2", found.blind, simulate(found.blind), 0.0)
    out["skippipe"] = VariantResult("skippipe", found.schedule, simulate(found.schedule), wall)
    st, counts = normalise_request(stages, cost, path_length, microbatches_per_data_node, memory)
    bound = iteration_lower_bound(st, cost, path_length, counts, memory, limits=limits,
                                  max_sequences=path_options.get("max_sequences", 20000))
    return Comparison(out, found.report, bound)
