"""Route recovery: a microbatch whose path loses a node is re-routed, recomputed or dropped, never hung.

On the way: a hop to a dead or suspected peer goes to another replica of that stage, else the
stage is skipped if the path's skip budget allows (``max_extra_skips`` beyond the schedule's own),
else the data node is told (``HopFailure``). At the data node, which sees each of its microbatches
from first forward to last backward: a microbatch past its deadline, routed through a node gone for
``left_grace_s``, or reported failed is recomputed on a fresh path (``max_retries`` times), else
dropped, and the step is re-weighted over the microbatches that completed. One that is late but not
yet past its deadline is *hedged*: started again on other replicas while the original stays alive,
the first back wins (:mod:`node.train.hedging`); a hedge counts as one of its recomputations.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import Awaitable, Callable, Dict, List, Optional, Tuple

from node.train.common import IterationState, NodeLog, Pending, mb_key, mb_name
from node.train.deadlines import ObservedBudgets
from node.train.hedging import HedgeCounters, hedge_after_s, hedges_allowed
from protocol import ActivationMessage, HopFailure, IterationDone, MicrobatchId

__all__ = ["RouteRecovery"]

logger = logging.getLogger(__name__)


class RouteRecovery:
    """Re-routing and skipping on every node; pending microbatches, retries and drops on a data node."""

    def __init__(self, cfg, *, peer_id: str, node_name: str, epochs, progress, health, resources, sender, life, pipeline,
                 memory_slots: Callable[[], int], metrics=None):
        """``epochs``, ``progress``, ``health``, ``resources``, ``sender``, ``life``: the trainer's epoch tracker,
        :class:`node.train.progress.IterationProgress`, peer health, stage resources, hop sender and life;
        ``pipeline``: where new microbatches and retries queue (:class:`node.train.pipeline.MicrobatchPipeline`);
        ``metrics``: optional counters. The monitor also asks the commit whether the iteration ended from the
        members' norms: :meth:`watch_norms_with` hands that over."""
        self.cfg = cfg
        self.peer_id, self.node_name = peer_id, node_name
        self.epochs, self.progress, self.health, self.resources = epochs, progress, health, resources
        self.sender, self.life, self.pipeline, self.metrics = sender, life, pipeline, metrics
        self._memory_slots = memory_slots
        self._done_from_norms: Optional[Callable[[int, IterationState, float], Awaitable[float]]] = None
        self.log = NodeLog(logger, node_name)
        self.pending: Dict[int, Pending] = {}  # data node: microbatch index -> its live attempt
        self._routes: List[List[int]] = []  # data node: this iteration's planned routes (node indices)
        self.reroutes = 0
        self.skips = 0
        self.drops = 0
        #: data node: round trips measured per route, which set its budgets once there are enough
        self.observed = ObservedBudgets(cfg.observed_deadlines)
        self.hedges = HedgeCounters()
        self._hedges_left = 0  # data node: hedges this iteration may still send
        self._queued_hedges: set = set()  # data node: (index, attempt) of hedges waiting for the worker
        self._monitor_task: Optional[asyncio.Task] = None

    def watch_norms_with(self, done_from_norms: Callable[[int, IterationState, float], Awaitable[float]]) -> None:
        """``await done_from_norms(it, st, last_poll)``: the commit's check for data nodes that finished (or
        left) as their norm records show; returns the time of its last DHT poll."""
        self._done_from_norms = done_from_norms

    def _count(self, what: str) -> None:
        metrics = self.metrics
        if metrics is None:
            return
        with contextlib.suppress(Exception):  # metrics never break training
            {"reroute": metrics.count_reroute, "skip": metrics.count_skip, "drop": metrics.count_drop}[what]()

    # ------------------------------------------------------------------ data node: start and finish
    def start_microbatches(self, it: int, st: IterationState) -> None:
        """Queue this data node's microbatches of iteration ``it``, on their planned routes where usable."""
        epochs = self.epochs
        self._routes = epochs.routes()
        self.pending.clear()
        self._queued_hedges.clear()
        st.remaining = len(self._routes)
        self._hedges_left = hedges_allowed(st.remaining, self.cfg.hedging)
        if st.remaining == 0:
            for peer in filter(self.health.reaches, epochs.members):
                self.sender.send_control(peer, IterationDone(self.cfg.run_id, epochs.epoch.epoch, it, self.peer_id, {}, 0))
        for j in range(len(self._routes)):
            route = tuple(epochs.members[n] for n in self._routes[j]) + (self.peer_id,)
            if not all(self.health.usable(r) for r in route):
                route = self.fresh_route(j) or route
            self.pipeline.starts.append((j, 0, route))

    def microbatch_finished(self, st: IterationState) -> None:
        """One of our microbatches completed or was dropped; the last one sends ``IterationDone``."""
        st.remaining -= 1
        self.pipeline.wakeup.set()
        if st.remaining == 0:
            done = IterationDone(self.cfg.run_id, self.epochs.epoch.epoch, self.progress.current, self.peer_id,
                                 dict(st.visits), st.dropped)
            for peer in self.epochs.members:
                if self.health.is_alive(peer) and self.health.reaches(peer):  # the others learn it from the norms
                    self.sender.send_control(peer, done)

    def budget_s(self, route) -> float:
        """The microbatch's deadline budget: from the round trips observed on ``route`` once there are enough
        (:class:`node.train.deadlines.ObservedBudgets`), else from the cost model; the cost model's budget of
        the first iteration this trainer runs is ``first_iteration_deadline_factor`` times longer (streams are
        opened, allocators warm up)."""
        deadlines = self.resources.deadlines
        budget, basis = self.observed.budget_s(tuple(route), deadlines.floors_s(route)), "observed"
        if budget is None:
            budget, basis = deadlines.microbatch_budget_s(route), "cost model"
            if self.progress.first_running():
                budget *= self.cfg.first_iteration_deadline_factor
        budget = min(budget, self.cfg.max_budget_fraction * self.cfg.iteration_timeout_s)
        self.observed.last = (basis, budget)
        return budget

    def completed(self, p: Pending) -> None:
        """Data node: microbatch ``p`` is back; its round trip is a sample of its route's budget."""
        self.observed.observe(tuple(p.route), time.monotonic() - p.started)

    # ------------------------------------------------------------------ data node: attempts and hedges
    def begin(self, index: int, attempt: int, route: Tuple[str, ...], now: float) -> bool:
        """The worker starts attempt ``attempt`` of microbatch ``index`` on ``route`` (its deadline and hedge
        time count from ``now``). False: a hedge whose microbatch was answered or given up meanwhile."""
        budget = self.budget_s(route)
        if (index, attempt) in self._queued_hedges:
            self._queued_hedges.discard((index, attempt))
            p = self.pending.get(index)
            hedge = None if p is None or p.loss_done else p if p.attempt == attempt else p.hedges.get(attempt)
            if hedge is None or hedge.started:
                return False
            hedge.started, hedge.deadline = now, now + budget  # a hedge is not hedged again (hedge_at stays inf)
            self.hedges.sent += 1
            return True
        fresh = Pending(index, attempt, route, now + budget, started=now)
        if self.cfg.hedging.enabled:
            fresh.hedge_at = now + hedge_after_s(budget, self.observed.samples(tuple(route)), self.cfg.hedging)
        self.pending[index] = fresh
        return True

    def answered(self, mb) -> Optional[Pending]:
        """Data node: an activation of attempt ``mb.attempt`` is back for its loss. The first attempt of a
        microbatch back wins: it becomes the microbatch's record and the others are discarded; None if this
        attempt was given up (late) or another one won."""
        p = self.pending.get(mb.index)
        if p is None or p.loss_done or mb.iteration != self.progress.current:
            return None
        winner = p if p.attempt == mb.attempt else p.hedges.get(mb.attempt)
        if winner is None or not winner.started:
            return None
        if p.hedges:
            now = time.monotonic()
            losers = [a for a in p.attempts() if a is not winner]
            for a in losers:
                self._drop_attempt(a, tell_route=True)
                if a.started:  # it took at least this long: a sample of its route, like a missed deadline
                    self.observed.observe(tuple(a.route), now - a.started)
            self.hedges.discarded += sum(1 for a in losers if a.started)  # a hedge still queued was never sent
            self.hedges.won += winner is not p
            self.log.info("%s answered first for microbatch %d of iteration %d; %d other attempt(s) discarded",
                          "the hedge" if winner is not p else "the original", mb.index, mb.iteration, len(losers))
            winner.highest_attempt = p.next_attempt() - 1
            winner.hedges, winner.hedged = {}, p.hedged
            self.pending[mb.index] = winner
        return winner

    def _drop_attempt(self, a: Pending, tell_route: bool = False) -> None:
        """Forget the local state of attempt ``a`` (its frames that still come are ignored); ``tell_route``:
        the nodes of its route forget it too (a forward never answered would hold a memory slot at each of
        them until the step: a hedge's loser is alive, not lost)."""
        epoch, it = self.epochs.epoch.epoch, self.progress.current
        key = (self.peer_id, epoch, it, a.index, a.attempt)
        self.resources.runtime.drop(key)
        self.pipeline.targets.pop(key, None)
        if tell_route and a.started and not a.loss_done:
            mb = MicrobatchId(self.cfg.run_id, epoch, it, self.peer_id, a.index, a.attempt)
            for hop, peer in enumerate(a.route[1:-1], start=1):
                if peer != self.peer_id:
                    self.sender.send_control(peer, HopFailure(mb, hop, self.peer_id, "discarded: another attempt "
                                                                                      "answered first"))

    def _give_up_attempt(self, p: Pending, a: Pending, why: str) -> None:
        """Attempt ``a`` of microbatch ``p`` failed: another live attempt carries on, else the microbatch fails."""
        if not p.hedges:
            self.fail_microbatch(p, why)
            return
        self.log.warning("attempt %d of microbatch %d failed (%s); its other attempt goes on", a.attempt, p.index, why)
        self._drop_attempt(a)
        if a is not p:
            p.hedges.pop(a.attempt, None)
            return
        successor = min(p.hedges.values(), key=lambda h: h.attempt)
        successor.highest_attempt = p.next_attempt() - 1
        del p.hedges[successor.attempt]
        successor.hedges, successor.hedged = p.hedges, p.hedged
        self.pending[p.index] = successor

    def _hedge(self, p: Pending, now: float) -> None:
        """Start microbatch ``p`` again on other replicas (if any), keeping the original alive."""
        route = self.hedge_route(p.route)
        if route is None:
            p.hedge_at = math.inf  # nowhere else to go: its deadline decides
            return
        attempt = p.next_attempt()
        p.highest_attempt, p.hedged, p.hedge_at = attempt, p.hedged + 1, math.inf
        p.hedges[attempt] = Pending(p.index, attempt, route, math.inf)  # started by begin()
        self._queued_hedges.add((p.index, attempt))
        self._hedges_left -= 1
        self.log.warning("microbatch %d of iteration %d not back after %.1fs; hedging it as attempt %d on %s",
                         p.index, self.progress.current, now - p.started, attempt, [r[-6:] for r in route])
        self.pipeline.hedges.append((p.index, attempt, route))
        self.pipeline.wakeup.set()

    def hedge_route(self, route: Tuple[str, ...]) -> Optional[Tuple[str, ...]]:
        """``route`` with every node replaced by another usable replica of its stage where there is one (the
        data node does not know which hop is late); None if no node could be replaced."""
        new: List[str] = [self.peer_id]
        for hop, peer in enumerate(route[1:-1], start=1):
            alt = self._alternative(tuple(new) + (peer,), hop, set(route))
            new.append(alt if alt is not None else peer)
        return None if new == list(route[:-1]) else tuple(new) + (self.peer_id,)

    # ------------------------------------------------------------------ routing
    def _min_path_stages(self) -> int:
        return max(1, self.epochs.plan.path_length - self.cfg.max_extra_skips)

    def _alternative(self, route: Tuple[str, ...], hop: int, avoid: set) -> Optional[str]:
        """Another usable replica of the stage of ``route[hop]``, not already on the route."""
        epochs = self.epochs
        try:
            stage = epochs.stage_of[epochs.members.index(route[hop])]
        except ValueError:
            return None
        on_route = set(route)
        options = [p for p in epochs.replicas(stage)
                   if p not in avoid and p not in on_route and self.health.usable(p)]
        if not options:
            return None
        # deterministic spread: the replica whose id hashes nearest to this microbatch
        return min(options, key=lambda p: (hash((p, route)) & 0xFFFF, p))

    async def send_forward(self, msg) -> None:
        """Send an activation to ``msg.route[msg.hop]``; on a dead hop re-route to another replica of
        that stage, else skip the stage if the path's skip budget allows, else tell the data node."""
        route, hop, failed = tuple(msg.route), msg.hop, set()
        while True:
            target = route[hop]
            if target == self.peer_id or (self.health.usable(target) and target not in failed):
                if await self.sender.send(target, ActivationMessage(msg.mb, hop, route, msg.tensor)):
                    return
            failed.add(target)
            if target == route[-1]:
                break  # the data node itself is gone: nobody is left to tell
            alt = self._alternative(route, hop, failed)
            if alt is not None:
                self.log.warning("re-routing %s hop %d from %s to %s", mb_name(msg.mb), hop, target[-8:], alt[-8:])
                route = route[:hop] + (alt,) + route[hop + 1:]
                self.reroutes += 1
                self._count("reroute")
                continue
            if len(route) - 2 >= self._min_path_stages() and hop < len(route) - 1:
                self.log.warning("skipping stage of %s for %s (no live replica)", target[-8:], mb_name(msg.mb))
                route = route[:hop] + route[hop + 1:]
                self.skips += 1
                self._count("skip")
                continue
            break
        report = HopFailure(msg.mb, hop, route[hop], "forward: no live replica and no skip budget")
        if msg.mb.data_node == self.peer_id:
            self.on_hop_failure(report)
        else:
            self.sender.send_control(msg.mb.data_node, report)
        self.resources.runtime.drop(mb_key(msg.mb))

    async def send_backward(self, msg) -> None:
        """Gradients cannot be re-routed (the autograd state lives on that node): report and drop."""
        target = msg.route[msg.hop]
        if await self.sender.send(target, msg):
            return
        if target != msg.mb.data_node:
            self.sender.send_control(msg.mb.data_node, HopFailure(msg.mb, msg.hop, target, "backward: peer unreachable"))

    # ------------------------------------------------------------------ data node: failures
    def on_hop_failure(self, msg, sender: Optional[str] = None) -> None:
        """Data node: a hop of one of our microbatches failed (reported by a node of its route)."""
        p = self.pending.get(msg.mb.index)
        a = None if p is None else p if p.attempt == msg.mb.attempt else p.hedges.get(msg.mb.attempt)
        if a is None or msg.mb.iteration != self.progress.current:
            return
        if sender is not None and sender != self.peer_id and not self._could_be_on_route(sender, p.route):
            self.log.warning("ignoring a hop failure about %s from %s, which is not on that route", mb_name(msg.mb),
                             sender[-8:])
            return
        if msg.peer_id != self.peer_id:
            self.health.suspect(msg.peer_id, f"hop {msg.hop} of {mb_name(msg.mb)}: {msg.reason}")
        self._give_up_attempt(p, a, f"hop failure at hop {msg.hop}: {msg.reason}")

    def _could_be_on_route(self, peer: str, route) -> bool:
        """``peer`` is on ``route`` or a replica of one of its stages (re-routing may have put it there)."""
        if peer in route:
            return True
        epochs = self.epochs
        index = {p: i for i, p in enumerate(epochs.members)}
        if peer not in index:
            return False
        stages = {epochs.stage_of.get(index[r]) for r in route if r in index}
        return epochs.stage_of.get(index[peer]) in stages

    def fail_microbatch(self, p: Pending, why: str) -> None:
        """Retry a microbatch whose forward failed on a fresh path, or drop it (never hang)."""
        it = self.progress.current
        st = self.progress.state(it)
        for a in p.attempts():
            self._drop_attempt(a)
        # hedges count as recomputations: attempt numbers past max_retries are not retried
        if not p.loss_done and p.next_attempt() <= self.cfg.max_retries:
            route = self.fresh_route(p.index)
            if route is not None:
                self.log.warning("microbatch %d of iteration %d failed (%s); recomputing as attempt %d on %s", p.index,
                                 it, why, p.attempt + 1, [r[-6:] for r in route])
                self.pending.pop(p.index, None)
                st.retried += 1
                self.pipeline.starts.append((p.index, p.next_attempt(), route))
                self.pipeline.wakeup.set()
                return
        self.log.warning("dropping microbatch %d of iteration %d (%s); the step is re-weighted over the "
                         "microbatches that completed", p.index, it, why)
        self.pending.pop(p.index, None)
        st.dropped += 1
        self.drops += 1
        self._count("drop")
        self.microbatch_finished(st)

    def fresh_route(self, index: int) -> Optional[Tuple[str, ...]]:
        """The planned route of microbatch ``index`` with dead or suspected nodes replaced by live
        replicas of their stages (or skipped within the skip budget); None if impossible."""
        planned = [self.epochs.members[n] for n in self._routes[index]]
        route: List[str] = [self.peer_id]
        for peer in planned[1:]:
            if self.health.usable(peer) and peer not in route:
                route.append(peer)
                continue
            alt = self._alternative(tuple(route + [peer]), len(route), set())
            if alt is not None and alt not in route:
                route.append(alt)
        if len(route) < self._min_path_stages():
            return None
        return tuple(route) + (self.peer_id,)

    # ------------------------------------------------------------------ monitor
    def start_monitor(self, it: int) -> None:
        self._monitor_task = asyncio.create_task(self._monitor(it), name=f"trainer-monitor-{self.node_name}")

    async def stop_monitor(self) -> None:
        task, self._monitor_task = self._monitor_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def cancel_monitor(self) -> None:
        if self._monitor_task is not None:
            self._monitor_task.cancel()

    async def _monitor(self, it: int) -> None:
        """Until iteration ``it`` closes: a data node fails its microbatches past their deadline or
        routed through a node that is gone; every node notices data nodes that are gone or done
        (their norm records); an iteration open for long logs what it waits for."""
        last_poll = time.monotonic()
        next_report = last_poll + self.cfg.stall_report_s
        while self.pipeline.open and self.progress.current == it and not self.life.closed:
            now = time.monotonic()
            try:
                data_node = self.epochs.stage == 0
                if data_node:
                    self.expire(now)
                st = self.progress.open_state(it)
                if st is not None:
                    self.progress.check_done(st)
                    # a data node waits for the others once its own microbatches are done
                    if (not data_node or st.remaining <= 0) and self._done_from_norms is not None:
                        last_poll = await self._done_from_norms(it, st, last_poll)
                if now > next_report:
                    next_report = now + self.cfg.stall_report_s
                    self._report_stall(it)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the monitor is what un-stalls an iteration: it must not die
                self.log.exception("iteration monitor failed; going on")
            await asyncio.sleep(self.cfg.liveness_poll_s)

    def expire(self, now: float) -> None:
        """Data node: fail its microbatches routed through a node gone for ``left_grace_s`` or past their
        deadline (each attempt of a hedged one on its own); hedge those past their hedge time."""
        routes = {r for p in self.pending.values() for a in p.attempts() for r in a.route}
        gone = self.health.gone(routes, now, self.cfg.left_grace_s)
        for p in list(self.pending.values()):
            for a in p.attempts():
                dead = [r for r in a.route if r in gone]
                if dead:
                    self._give_up_attempt(p, a, f"{dead[0][-8:]} left the swarm")
                    break
                if a.started and now > a.deadline:
                    # its real round trip is longer still: counted as this, a lasting slow-down raises the
                    # budgets of its route within a few misses
                    self.observed.observe(tuple(a.route), now - a.started)
                    self._give_up_attempt(p, a, f"deadline of {a.deadline - a.started:.1f}s passed")
                    break
            else:
                if (now >= p.hedge_at and not p.loss_done and self._hedges_left > 0
                        and p.hedged < self.cfg.hedging.max_per_microbatch):
                    self._hedge(p, now)

    def _report_stall(self, it: int) -> None:
        """Log what an iteration that has been open for long still waits for."""
        st = self.progress.open_state(it)
        now = time.monotonic()
        pending = [f"{p.index}.{p.attempt}({'bwd' if p.loss_done else 'fwd'}, {p.deadline - now:+.0f}s)"
                   for p in self.pending.values()]
        missing = [p[-8:] for p in self.epochs.data_node_peers if st is None or p not in st.done]
        starts, forwards, losses, grads = self.pipeline.queue_sizes()
        self.log.warning("iteration %d still open; remaining %s, pending %s, queued starts %d forwards %d losses %d "
                         "grads %d, in flight %s/%s, no IterationDone from %s", it,
                         None if st is None else st.remaining, pending, starts, forwards, losses, grads,
                         None if self.resources.runtime is None else self.resources.runtime.in_flight, self._memory_slots(),
                         missing)
