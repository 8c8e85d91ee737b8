"""The schedule data type and its JSON form.

JSON (documented in ``docs/scheduler.md``)::

    {"stages": [[node ids]...], "path_length": L, "memory": m,
     "paths": [{"data_node": d, "route": [d, n1, ..., n_{L-1}], "microbatches": c}, ...],
     "cost": {"compute_s": [...], "link_s": [[...]]},
     "limits": {"max_swaps": 2, "max_jump": 4, "max_swap_distance": 1}}

``limits`` (and ``cost.backward_ratio`` / ``cost.loss_ratio``) are optional extensions;
missing, they take the defaults. A data node dispatches its microbatches entry by entry in the
order of ``paths`` (all ``c`` of one entry, then the next entry of that data node).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from scheduler.cost import CostMatrix
from scheduler.errors import ScheduleError
from scheduler.routes import RouteLimits

__all__ = ["PathEntry", "Schedule", "load_schedule"]


@dataclass(frozen=True)
class PathEntry:
    """``microbatches`` microbatches of ``data_node`` that all follow ``route``
    (``route[0] == data_node``; the loss is computed back at the data node and the backward pass
    retraces the route)."""

    data_node: int
    route: tuple[int, ...]
    microbatches: int = 1

    def to_json(self) -> dict:
        return {"data_node": self.data_node, "route": list(self.route), "microbatches": self.microbatches}


@dataclass(frozen=True)
class Schedule:
    """One iteration's plan: stage allocation, route per microbatch group, memory and costs."""

    stages: tuple[tuple[int, ...], ...]
    path_length: int
    memory: int
    paths: tuple[PathEntry, ...]
    cost: CostMatrix | None = None
    limits: RouteLimits = field(default_factory=RouteLimits)

    @property
    def data_nodes(self) -> tuple[int, ...]:
        return self.stages[0]

    def microbatches_of(self, data_node: int) -> int:
        return sum(p.microbatches for p in self.paths if p.data_node == data_node)

    def dispatch_order(self) -> dict[int, list[tuple[int, ...]]]:
        """Per data node, the route of each of its microbatches in dispatch order."""
        out: dict[int, list[tuple[int, ...]]] = {d: [] for d in self.stages[0]}
        for p in self.paths:
            out.setdefault(p.data_node, []).extend([p.route] * p.microbatches)
        return out

    def to_json(self) -> dict:
        """JSON-ready dict (what ``json.dumps`` and ``protocol.messages.ScheduleEpoch`` carry)."""
        out: dict[str, Any] = {
            "stages": [list(s) for s in self.stages],
            "path_length": self.path_length,
            "memory": self.memory,
            "paths": [p.to_json() for p in self.paths],
        }
        if self.cost is not None:
            out["cost"] = self.cost.to_json()
        out["limits"] = self.limits.to_json()
        return out

    @classmethod
    def from_json(cls, data: Mapping | str | bytes) -> "Schedule":
        """Parse (not validate) a schedule; use :func:`scheduler.validate.validate_schedule`."""
        if isinstance(data, (str, bytes)):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as e:
                raise ScheduleError("format", f"not valid JSON: {e}") from None
        if not isinstance(data, Mapping):
            raise ScheduleError("format", "a schedule is a JSON object")
        for key in ("stages", "path_length", "memory", "paths"):
            if key not in data:
                raise ScheduleError("format", f"missing key {key!r}")
        try:
            stages = tuple(tuple(_int(x, "stages") for x in s) for s in data["stages"])
            paths = tuple(
                PathEntry(
                    _int(p["data_node"], "data_node"),
                    tuple(_int(x, "route") for x in p["route"]),
                    _int(p.get("microbatches", 1), "microbatches"),
                )
                for p in data["paths"]
            )
            cost = CostMatrix.from_json(data["cost"]) if data.get("cost") is not None else None
            limits = RouteLimits.from_json(data["limits"]) if data.get("limits") is not None else RouteLimits()
            return cls(stages, _int(data["path_length"], "path_length"), _int(data["memory"], "memory"), paths, cost, limits)
        except ScheduleError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ScheduleError("format", f"malformed schedule: {e!r}") from None


def _int(x: Any, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise ScheduleError("format", f"{what} must hold integers, got {x!r}")
    return x


def load_schedule(path: str) -> Schedule:
    """Read a schedule JSON file (the only file I/O here)."""
    try:
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ScheduleError("format", f"cannot read {path}: {e.strerror or e}") from None
    return Schedule.from_json(text)
