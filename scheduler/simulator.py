"""Discrete-event simulation of one training iteration under a schedule.

Model (the reference's ``com_sym.py`` model, event-driven instead of 1-second slots):

* Microbatch j of data node d with route ``[d, n1, ..., n_{L-1}]`` runs forward at d, n1, ...,
  n_{L-1}, the loss at d, then backward at n_{L-1}, ..., n1, d. Each step is a task; between
  two tasks on different nodes the activation (or gradient) travels for ``link_s[u][v]``.
* A node runs one task at a time, non-preemptively. When it is free it picks, among the tasks
  that have arrived, a backward first, then a loss, then a forward (earliest arrival first
  within a class, then dispatch order). Backward-first frees memory and shortens the critical
  path (the 1F1B rule of the reference runtime).
* Memory: a forward at node v takes one of v's ``memory`` slots (activations kept for the
  backward); the backward at v releases it. A forward that finds no free slot waits. At the
  data node this is the admission rule: it keeps at most ``memory`` of its microbatches in
  flight and starts the next (in dispatch order) when one finishes.
* Links do not share bandwidth by default (as in the reference). With ``link_busy_s`` (seconds a
  transfer occupies the directed link: bytes / bandwidth) transfers on one link queue for it,
  first come first served, and the rest of ``link_s`` (latency, per-hop overhead) follows. That is
  what a real link and :mod:`node.dataplane.emulation` do, and it matters where routes collide: on the
  geo-distributed profile a random-skip schedule's prediction moves from 17.3 s to 21.4 s with
  sharing, and the live in-process run measured 21.4 s (docs/emulation.md).
* Optional commit phase (``commit=`` :class:`CommitModel`): after the microbatches, each stage's
  replicas all-reduce their gradients (:func:`allreduce_time_s`: bytes of the stage's parameters
  over the slowest link of the replica group), then every member sends its norm to every member
  (one message over the slowest link between members). The runtime starts averaging after the
  iteration's global barrier (every data node's ``IterationDone``), so the commit adds the
  slowest stage's all-reduce plus the norm exchange to the microbatch phase:
  :attr:`SimResult.whole_iteration_s`. Without it the commit costs nothing (the reference's model).

The iteration time is when the last backward finishes at its data node. If microbatches wait
on each other's memory forever the result has ``deadlock=True`` and infinite time (valid
schedules cannot deadlock, see :func:`scheduler.validate.deadlock_risk`).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Mapping, Sequence

from scheduler.cost import CostMatrix
from scheduler.errors import ScheduleError
from scheduler.schedule import Schedule

__all__ = ["Task", "SimResult", "CommitModel", "allreduce_time_s", "commit_model", "simulate", "simulate_routes"]

#: Bytes of one norm message on the wire (its numbers, peer ids and envelope; no announced epochs).
NORM_REPORT_BYTES = 512


@dataclass(frozen=True)
class Task:
    """One busy interval of a node: ``kind`` is ``"F"`` (forward), ``"L"`` (loss) or ``"B"``
    (backward) of microbatch ``index`` (dispatch order) of ``data_node``."""

    start_s: float
    end_s: float
    kind: str
    data_node: int
    index: int


@dataclass(frozen=True)
class SimResult:
    """iteration_time_s: when the last microbatch finished its backward at its data node.
    finish_s: that time per data node (0 for data nodes without microbatches).
    busy_s: total task time per node. timelines: per node, its tasks in start order (empty
    tuples unless recorded). deadlock: some microbatches could never finish."""

    iteration_time_s: float
    finish_s: Mapping[int, float]
    busy_s: tuple[float, ...]
    timelines: tuple[tuple[Task, ...], ...]
    deadlock: bool = False
    #: with a :class:`CommitModel`: the slowest stage's all-reduce, and the norm exchange (else 0)
    averaging_s: float = 0.0
    norm_exchange_s: float = 0.0

    @property
    def whole_iteration_s(self) -> float:
        """Microbatch phase, then averaging, then the norm exchange (= ``iteration_time_s`` without a commit model)."""
        return self.iteration_time_s + self.averaging_s + self.norm_exchange_s


def allreduce_time_s(param_bytes: float, group: Sequence[int], latency_s: Sequence[Sequence[float]],
                     bandwidth_Bps: Sequence[Sequence[float]]) -> float:
    """Seconds for the replicas ``group`` (node ids) to all-reduce ``param_bytes`` of gradients.

    hivemind's butterfly all-reduce: each of the n peers reduces 1/n of the vector, so it sends and
    receives (n - 1)/n of the vector in the reduce-scatter and again in the all-gather. Over the
    slowest link of the group (lowest bandwidth, highest latency; a part waits for its slowest
    sender) that is ``2 (n - 1)/n * bytes / bandwidth + 2 * latency``. A lone replica: 0."""
    nodes = sorted(set(group))
    n = len(nodes)
    if n < 2:
        return 0.0
    if not (math.isfinite(param_bytes) and param_bytes >= 0):
        raise ScheduleError("cost", f"param_bytes = {param_bytes} must be finite and >= 0")
    pairs = [(u, v) for u in nodes for v in nodes if u != v]
    bandwidth = min(bandwidth_Bps[u][v] for u, v in pairs)
    latency = max(latency_s[u][v] for u, v in pairs)
    if not bandwidth > 0:
        raise ScheduleError("cost", f"bandwidth within replica group {nodes} must be > 0")
    return 2.0 * (n - 1) / n * param_bytes / bandwidth + 2.0 * latency


@dataclass(frozen=True)
class CommitModel:
    """The commit after an iteration's microbatches: ``allreduce_s[stage]`` (seconds for that stage's
    replicas to average, 0 for a lone replica) and ``norm_exchange_s`` (the norm barrier)."""

    allreduce_s: Mapping[int, float]
    norm_exchange_s: float = 0.0

    def __post_init__(self) -> None:
        for stage, s in self.allreduce_s.items():
            if not (math.isfinite(s) and s >= 0):
                raise ScheduleError("cost", f"allreduce_s[{stage}] = {s} must be finite and >= 0")
        if not (math.isfinite(self.norm_exchange_s) and self.norm_exchange_s >= 0):
            raise ScheduleError("cost", f"norm_exchange_s = {self.norm_exchange_s} must be finite and >= 0")

    @property
    def averaging_s(self) -> float:
        """Stages average in parallel: the slowest one."""
        return max(self.allreduce_s.values(), default=0.0)


def commit_model(stages: Sequence[Sequence[int]], stage_param_bytes: Sequence[float],
                 latency_s: Sequence[Sequence[float]], bandwidth_Bps: Sequence[Sequence[float]],
                 members: Sequence[int] | None = None, norm_bytes: float = NORM_REPORT_BYTES) -> CommitModel:
    """A :class:`CommitModel` from links: ``stages[k]`` lists the nodes holding stage k (their
    replica group), ``stage_param_bytes[k]`` the bytes of its parameters (= its gradient),
    ``latency_s``/``bandwidth_Bps`` per directed pair of nodes. The norm exchange is one message of
    ``norm_bytes`` over the slowest link between ``members`` (default: every node of ``stages``)."""
    if len(stage_param_bytes) != len(stages):
        raise ScheduleError("cost", f"{len(stage_param_bytes)} parameter sizes for {len(stages)} stages")
    allreduce = {k: allreduce_time_s(stage_param_bytes[k], group, latency_s, bandwidth_Bps)
                 for k, group in enumerate(stages)}
    nodes = sorted(set(members if members is not None else (v for g in stages for v in g)))
    pairs = [(u, v) for u in nodes for v in nodes if u != v]
    norm = max((latency_s[u][v] + norm_bytes / bandwidth_Bps[u][v] for u, v in pairs), default=0.0)
    return CommitModel(allreduce, norm)


def simulate(
    schedule: Schedule,
    cost: CostMatrix | None = None,
    *,
    record_timelines: bool = True,
    task_gap_s: float = 0.0,
    link_busy_s: Sequence[Sequence[float]] | None = None,
    commit: CommitModel | None = None,
) -> SimResult:
    """Simulate ``schedule`` with ``cost`` (default: the schedule's own). Does not validate;
    call :func:`scheduler.validate.validate_schedule` first for untrusted input. ``link_busy_s``,
    ``commit``: see :func:`simulate_routes`."""
    cost = schedule.cost if cost is None else cost
    if cost is None:
        raise ScheduleError("cost", "the schedule has no cost matrix and none was given")
    return simulate_routes(
        schedule.dispatch_order(), cost, schedule.memory, record_timelines=record_timelines, task_gap_s=task_gap_s,
        link_busy_s=link_busy_s, commit=commit,
    )


def simulate_routes(
    routes_by_data_node: Mapping[int, Sequence[Sequence[int]]],
    cost: CostMatrix,
    memory: int,
    *,
    record_timelines: bool = False,
    task_gap_s: float = 0.0,
    link_busy_s: Sequence[Sequence[float]] | None = None,
    commit: CommitModel | None = None,
) -> SimResult:
    """Simulate microbatches given as, per data node, the route of each microbatch in dispatch
    order.

    task_gap_s: idle time a node needs after each task before the next; 0 by default because
        per-transfer overheads are already in ``link_s`` (the reference used 0.09-0.13 s).
    link_busy_s: ``link_busy_s[u][v]`` = seconds one transfer occupies the link u -> v (the
        serialisation part of ``link_s[u][v]``, see :func:`scheduler.cost.link_busy_matrix`);
        a transfer that finds its link busy waits for it, then takes ``link_s[u][v]`` in all.
        None (default): links are never busy (the reference's model).
    commit: the averaging and norm exchange after the microbatches (:class:`CommitModel`, e.g. from
        :func:`commit_model`); the result's ``whole_iteration_s`` includes them. None: no commit phase.
    """
    n = cost.n_nodes
    if link_busy_s is not None:
        if len(link_busy_s) != n or any(len(row) != n for row in link_busy_s):
            raise ScheduleError("cost", f"link_busy_s must be {n}x{n} to match the cost matrix")
        for u, row in enumerate(link_busy_s):
            for v, x in enumerate(row):
                if not (math.isfinite(x) and 0 <= x <= cost.link_s[u][v]):
                    raise ScheduleError("cost", f"link_busy_s[{u}][{v}] = {x} must be in [0, link_s[{u}][{v}]]")
    link_free_at: dict[tuple[int, int], float] = {}
    F = cost.compute_s
    br, lr = cost.backward_ratio, cost.loss_ratio
    link = cost.link_s
    push, pop, replace = heapq.heappush, heapq.heappop, heapq.heapreplace

    # Per microbatch j: the node of each of its 2L+1 tasks, and L (its loss is task L). A task's
    # duration depends on its node and kind alone: forward F[v], loss F[v] x loss ratio, backward
    # F[v] x backward ratio.
    # Queues: the forwards waiting at a node, and its backwards and losses, are FIFOs: a node's
    # arrivals are handled in time order (then in the order they were sent on equal times), so the
    # earliest-arrival-then-dispatch-order rule is first in, first out; backwards go before losses.
    FB = [f * br for f in F]
    FL = [f * lr for f in F]
    mb_nodes: list[tuple[int, ...]] = []
    mb_owner: list[tuple[int, int]] = []
    mb_loss: list[int] = []
    fq: list[deque] = [deque() for _ in range(n)]
    bq: list[deque] = [deque() for _ in range(n)]
    lq: list[deque] = [deque() for _ in range(n)]
    for d in sorted(routes_by_data_node):
        for idx, r in enumerate(routes_by_data_node[d]):
            r = tuple(r)
            fq[r[0]].append((len(mb_nodes), 0))
            mb_nodes.append(r + r[:1] + r[::-1])
            mb_owner.append((d, idx))
            mb_loss.append(len(r))
    total = len(mb_nodes)
    seq = 0  # orders events of equal time: by when they were scheduled
    free = [memory] * n
    busy = [False] * n
    busy_s = [0.0] * n
    timelines: list[list[Task]] | None = [[] for _ in range(n)] if record_timelines else None
    done_at = [0.0] * total
    done = 0
    ev: list = []  # (time, seq, is_finish, node, mb, phase)

    touched = [v for v in range(n) if fq[v]]
    t = 0.0
    while True:
        for v in touched:  # start the next task on every idle node that something happened to
            if busy[v]:
                continue
            if bq[v]:
                j, p = bq[v].popleft()
            elif lq[v]:
                j, p = lq[v].popleft()
            elif fq[v] and free[v] > 0:
                j, p = fq[v].popleft()
                free[v] -= 1
            else:
                continue
            L2 = mb_loss[j]
            dur = F[v] if p < L2 else (FB[v] if p > L2 else FL[v])
            busy[v] = True
            busy_s[v] += dur
            if timelines is not None:
                kind = "F" if p < L2 else ("L" if p == L2 else "B")
                timelines[v].append(Task(t, t + dur, kind, mb_owner[j][0], mb_owner[j][1]))
            seq += 1
            push(ev, (t + dur + task_gap_s, seq, True, v, j, p))
        if not ev:
            break
        t = ev[0][0]
        touched = []
        while ev:
            e = ev[0]  # handled in place: a finish replaces itself by its transfer
            if e[0] != t:
                break
            _, _, is_finish, v, j, p = e
            L2 = mb_loss[j]
            if is_finish:
                busy[v] = False
                if p > L2:
                    free[v] += 1
                if p == 2 * L2:
                    pop(ev)
                    done_at[j] = t
                    done += 1
                else:
                    w = mb_nodes[j][p + 1]
                    seq += 1
                    if link_busy_s is not None and v != w:  # queue for the link behind earlier transfers
                        sent = max(t, link_free_at.get((v, w), t))
                        link_free_at[(v, w)] = sent + link_busy_s[v][w]
                        replace(ev, (sent + link[v][w], seq, False, w, j, p + 1))
                    else:
                        replace(ev, (t + link[v][w], seq, False, w, j, p + 1))
            else:
                pop(ev)
                if p < L2:
                    fq[v].append((j, p))
                elif p > L2:
                    bq[v].append((j, p))
                else:
                    lq[v].append((j, p))
            touched.append(v)
    finish: dict[int, float] = {d: 0.0 for d in routes_by_data_node}
    for j, (d, _) in enumerate(mb_owner):
        if done_at[j] > finish[d]:
            finish[d] = done_at[j]
    deadlock = done < total
    it = math.inf if deadlock else max(finish.values(), default=0.0)
    tl = tuple(tuple(x) for x in timelines) if timelines is not None else tuple(() for _ in range(n))
    if commit is None:
        return SimResult(it, finish, tuple(busy_s), tl, deadlock)
    return SimResult(it, finish, tuple(busy_s), tl, deadlock, commit.averaging_s, commit.norm_exchange_s)
