"""Schedule validity: every rule a coordinator's schedule must satisfy, checked without timing.

:func:`validate_schedule` raises :class:`ScheduleError` whose ``constraint`` names the first rule
violated. It is what validators run on a received schedule, what ``skippipe simulate`` runs on
a hand-written one, and what the tests run on everything the optimiser returns.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping, Sequence

from scheduler.errors import ScheduleError
from scheduler.routes import RouteLimits, sequence_violation
from scheduler.schedule import Schedule

__all__ = ["validate_schedule", "stage_visits", "deadlock_risk"]


def stage_visits(schedule: Schedule) -> list[int]:
    """Microbatch visits per stage (stage 0 counts every microbatch once)."""
    stage_of = {v: s for s, nodes in enumerate(schedule.stages) for v in nodes}
    visits = [0] * len(schedule.stages)
    for p in schedule.paths:
        for v in p.route:
            visits[stage_of[v]] += p.microbatches
    return visits


def deadlock_risk(
    routes_by_data_node: Mapping[int, Sequence[Sequence[int]]], memory: int
) -> list[int] | None:
    """A cycle of nodes that can deadlock on memory, or ``None`` if none can.

    A forward waits at node v only when v already holds ``memory`` microbatches. At most
    ``min(memory, k_d(v))`` microbatches of data node d can be at v at once (d itself admits at
    most ``memory`` in flight; ``k_d(v)`` of its microbatches visit v), so v can block only if the
    sum of those exceeds ``memory``. A microbatch holding a slot at u waits for v only along a
    route hop u -> v between two non-data nodes (loss, backward and the hop home never wait).
    So a deadlock needs a cycle of such hops through blocking-capable nodes; if that hop graph
    is acyclic, no timing can deadlock (the check is exact for the graph, conservative in time).
    """
    per_d: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for d, routes in routes_by_data_node.items():
        for r in routes:
            for v in r[1:]:
                per_d[v][d] += 1
    blocking = {v for v, counts in per_d.items() if sum(min(memory, k) for k in counts.values()) > memory}
    if not blocking:
        return None
    succ: dict[int, set[int]] = defaultdict(set)
    for routes in routes_by_data_node.values():
        for r in routes:
            for i in range(1, len(r) - 1):
                if r[i] in blocking and r[i + 1] in blocking:
                    succ[r[i]].add(r[i + 1])
    # iterative DFS cycle search, deterministic order
    colour: dict[int, int] = {}
    for start in sorted(succ):
        if colour.get(start):
            continue
        stack = [(start, iter(sorted(succ[start])))]
        colour[start] = 1
        trail = [start]
        while stack:
            v, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                colour[v] = 2
                stack.pop()
                trail.pop()
                continue
            c = colour.get(nxt, 0)
            if c == 1:
                return trail[trail.index(nxt) :] + [nxt]
            if c == 0:
                colour[nxt] = 1
                trail.append(nxt)
                stack.append((nxt, iter(sorted(succ.get(nxt, ())))))
    return None


def validate_schedule(
    schedule: Schedule,
    *,
    microbatches_per_data_node: int | Mapping[int, int] | None = None,
    limits: RouteLimits | None = None,
    n_nodes: int | None = None,
) -> None:
    """Raise :class:`ScheduleError` naming the first violated constraint; return None if valid.

    microbatches_per_data_node: if given (one count for all, or per data node), each data node
        must dispatch exactly that many microbatches; otherwise any count >= 0 is accepted.
    limits: reordering limits; defaults to ``schedule.limits``.
    n_nodes: node ids must be below it; defaults to the cost matrix size if there is one.
    """
    limits = schedule.limits if limits is None else limits
    stages = schedule.stages
    if not stages:
        raise ScheduleError("stages", "a schedule needs at least one stage")
    if n_nodes is None and schedule.cost is not None:
        n_nodes = schedule.cost.n_nodes
    stage_of: dict[int, int] = {}
    for s, nodes in enumerate(stages):
        if not nodes:
            raise ScheduleError("stages", f"stage {s} has no nodes")
        for v in nodes:
            if v < 0 or (n_nodes is not None and v >= n_nodes):
                raise ScheduleError("stages", f"node id {v} in stage {s} is outside 0..{(n_nodes or 1) - 1}")
            if v in stage_of:
                raise ScheduleError("stages", f"node {v} appears in stage {stage_of[v]} and stage {s}")
            stage_of[v] = s
    n_stages = len(stages)
    L = schedule.path_length
    if not 1 <= L <= n_stages:
        raise ScheduleError("path-length", f"path_length {L} must be in 1..{n_stages} (the number of stages)")
    if schedule.memory < 1:
        raise ScheduleError("memory", f"memory {schedule.memory} must be >= 1 in-flight microbatch")
    if not schedule.paths:
        raise ScheduleError("paths", "a schedule needs at least one path")
    data_nodes = set(stages[0])
    for i, p in enumerate(schedule.paths):
        where = f"path {i} (data node {p.data_node})"
        if p.data_node not in data_nodes:
            raise ScheduleError("data-node", f"{where}: {p.data_node} is not a stage-0 (data) node")
        if p.microbatches < 1:
            raise ScheduleError("microbatches", f"{where}: microbatches must be >= 1, got {p.microbatches}")
        r = p.route
        if len(r) != L:
            raise ScheduleError("route-length", f"{where}: route {list(r)} has {len(r)} nodes, path_length is {L}")
        if r[0] != p.data_node:
            raise ScheduleError("route-start", f"{where}: route must start (and end) at its data node, starts at {r[0]}")
        seq = []
        for v in r[1:]:
            if v not in stage_of:
                raise ScheduleError("route-node", f"{where}: node {v} is in no stage")
            if stage_of[v] == 0:
                raise ScheduleError("route-node", f"{where}: node {v} is a data node; only the route's own data node, first, may be stage 0")
            seq.append(stage_of[v])
        if len(set(seq)) != len(seq):
            raise ScheduleError("repeated-stage", f"{where}: route {list(r)} visits stages {[0] + seq}, a stage twice")
        bad = sequence_violation(seq, limits)
        if bad is not None:
            raise ScheduleError(bad[0], f"{where}: route {list(r)} (stages {[0] + seq}) {bad[1]}")
    if microbatches_per_data_node is not None:
        for d in stages[0]:
            want = microbatches_per_data_node if isinstance(microbatches_per_data_node, int) else microbatches_per_data_node.get(d, 0)
            got = schedule.microbatches_of(d)
            if got != want:
                raise ScheduleError("microbatch-count", f"data node {d} dispatches {got} microbatches, expected {want}")
    visits = stage_visits(schedule)
    if n_stages > 1:
        inner = visits[1:]
        if max(inner) - min(inner) > 1:
            lo, hi = inner.index(min(inner)) + 1, inner.index(max(inner)) + 1
            raise ScheduleError(
                "stage-balance",
                f"stage {hi} gets {max(inner)} microbatch visits but stage {lo} gets {min(inner)}; "
                "every non-zero stage must get an equal share (+-1)",
            )
    cycle = deadlock_risk(schedule.dispatch_order(), schedule.memory)
    if cycle is not None:
        raise ScheduleError(
            "memory-deadlock",
            f"routes hop around the cycle {cycle} through nodes that can fill their {schedule.memory} memory slots; "
            "microbatches could wait on each other forever",
        )
