"""SkipPipe scheduling: cost model, stage allocation, skip-aware path scheduling, simulator, baselines.

Pure functions over plain data: no I/O (except the clearly separated JSON loaders
``LinkProfile.load`` and ``load_schedule``), no network, no torch.

Modules, one job each:

* :mod:`scheduler.cost` - compute and transfer times (:class:`CostMatrix`) from a profile or
  live measurements.
* :mod:`scheduler.allocation` - which nodes hold which stage (:func:`allocate`).
* :mod:`scheduler.routes` - skipping/reordering rules (:class:`RouteLimits`).
* :mod:`scheduler.paths` - routes per microbatch for a fixed allocation (:func:`schedule_paths`).
* :mod:`scheduler.simulator` - discrete-event simulation of one iteration (:func:`simulate`).
* :mod:`scheduler.bounds` - a lower bound on any valid schedule's iteration time
  (:func:`iteration_lower_bound`).
* :mod:`scheduler.baselines` - full pipeline and random skip.
* :mod:`scheduler.schedule` / :mod:`scheduler.validate` - the schedule type, its JSON, validity.
* :mod:`scheduler.compare` - all variants of one setting side by side.
"""

from scheduler.allocation import AllocationResult, allocate
from scheduler.baselines import full_pipeline, random_skip
from scheduler.bounds import LowerBound, iteration_lower_bound
from scheduler.cost import CostMatrix, CostParams, LinkProfile, ModelShape, NodeSpec, build_cost, cost_from_measurements, nodes_round_robin
from scheduler.errors import ScheduleError
from scheduler.paths import PathReport, schedule_paths, schedule_paths_report
from scheduler.routes import RouteLimits
from scheduler.schedule import PathEntry, Schedule, load_schedule
from scheduler.simulator import SimResult, Task, simulate
from scheduler.validate import validate_schedule

__all__ = [
    "AllocationResult",
    "CostMatrix",
    "CostParams",
    "LinkProfile",
    "LowerBound",
    "ModelShape",
    "NodeSpec",
    "PathEntry",
    "PathReport",
    "RouteLimits",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "Task",
    "allocate",
    "build_cost",
    "cost_from_measurements",
    "full_pipeline",
    "iteration_lower_bound",
    "load_schedule",
    "nodes_round_robin",
    "random_skip",
    "schedule_paths",
    "schedule_paths_report",
    "simulate",
    "validate_schedule",
]
