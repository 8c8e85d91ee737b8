"""Committing an iteration once its microbatches are done: average, exchange norms, clip, step.

1. **Averaging.** Each replica turns its summed gradient into the mean over the microbatches that
   visited it, and the stage's replicas all-reduce it weighted by those counts (:mod:`averaging`).
   Under WAN emulation hivemind's all-reduce runs over the real (loopback) network, so the phase is
   padded to the emulated all-reduce time of the replica group's links
   (:func:`scheduler.simulator.allreduce_time_s` of the gradient bytes; docs/emulation.md).
2. **Norm exchange.** Every member sends its numbers (its stage's squared gradient norm, loss
   sums, parameter checksum) directly to every member of the epoch as a
   :class:`protocol.messages.NormReport` over the data plane, stores the same numbers as a
   :class:`node.net.records.NormRecord` in the DHT, and waits for every member's; the DHT records
   are read only for members whose report did not arrive within ``norm_direct_grace_s``. The global
   norm is the square root of the sum over stages of the lower median of the stage's reports, with
   non-finite and absurd reports of a member left out (:func:`node.train.screening.robust_squared_norm`:
   every node computes the same number from the same reports, and no one member can freeze or
   unclip the step). A member silent for
   ``norm_exchange_timeout_s`` is suspected and left out: a hung node must not stop the swarm.
3. **Clip and step** by ``min(1, clip / norm)``; a non-finite norm skips the step. A replica whose
   checksum differs from its stage's canonical replica (a failed all-reduce) copies that replica's
   state instead of stepping, but only when a strict majority of the stage's replicas backs it, or,
   between two replicas, within bounds (:mod:`node.train.resync`); otherwise it keeps its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import replace
from typing import Awaitable, Callable, Dict, Mapping, Optional, Tuple

from node.net.records import NormRecord, read_norm_records, write_norm_record
from protocol.messages import NormReport
from node.train.averaging import groupmates_went_on
from node.train.common import DoneFromNorm, IterationState, IterationStats, NodeLog
from node.train.precision import loss_scales_agree
from node.train.resync import (TIE_EVERY_ITERATIONS, ResyncAction, ResyncDecision, not_averaged_after, reachable_source,
                               resync_decision, within_tie_bound)
from node.train.runtime import clip_coefficient
from node.train.relay_link import reaches_or_relayed
from node.train.timing import emulated_allreduce_s
from node.train.screening import AveragingScreen, robust_squared_norm

__all__ = ["IterationCommit", "global_squared_norm", "norm_report", "record_of_report"]

logger = logging.getLogger(__name__)

#: One "re-sync refused" log line per this many refusals: replicas that disagree for good (a liar kept
#: out) would otherwise log at every iteration.
REFUSED_LOG_EVERY = 50


def global_squared_norm(records: Mapping[str, NormRecord]) -> float:
    """Sum over stages of the lower median of the stage's accepted reports (see robust_squared_norm)."""
    return robust_squared_norm(records).total_sq


def norm_report(run_id: str, iteration: int, peer_id: str, record: NormRecord) -> NormReport:
    """The direct message carrying ``record`` (the same numbers as the DHT record)."""
    return NormReport(run_id=run_id, epoch=record.epoch, iteration=iteration, peer_id=peer_id, stage=record.stage,
                      sq=float(record.sq), checksum=float(record.checksum), loss_sum=float(record.loss_sum),
                      n_mb=record.n_mb, tokens=record.tokens, dropped=record.dropped,
                      avg_group=tuple(record.avg_group), epochs=tuple(record.epochs),
                      loss_scale=float(record.loss_scale))


def record_of_report(msg: NormReport) -> NormRecord:
    """The record a :class:`NormReport` carries (inverse of :func:`norm_report`)."""
    return NormRecord(stage=msg.stage, sq=msg.sq, checksum=msg.checksum, epoch=msg.epoch, loss_sum=msg.loss_sum,
                      n_mb=msg.n_mb, tokens=msg.tokens, dropped=msg.dropped, avg_group=tuple(msg.avg_group),
                      epochs=tuple(msg.epochs), loss_scale=msg.loss_scale)


class IterationCommit:
    """Averaging, norm exchange, clipping, resync and step of one trainer."""

    def __init__(self, cfg, *, peer_id: str, node_name: str, epochs, progress, health, resources, sender,
                 compute: Callable[..., Awaitable], expected_state: Callable[[], object], p2p=None, dht=None,
                 faults=None, emulation=None):
        """``epochs``, ``progress``, ``health``, ``resources``, ``sender``: the trainer's epoch tracker,
        :class:`node.train.progress.IterationProgress`, peer health, stage resources (runtime, averager) and hop
        sender; ``await compute(fn)`` runs device work on the compute thread; ``expected_state()``: the shapes a
        downloaded state must have; ``p2p``/``dht``: for a re-sync and the norm records; ``faults``: an optional
        fault injector; ``emulation``: the optional WAN emulation (averaging is padded to its all-reduce time)."""
        self.cfg = cfg
        self.peer_id, self.node_name = peer_id, node_name
        self.epochs, self.progress, self.health, self.resources, self.sender = epochs, progress, health, resources, sender
        self.compute, self.expected_state = compute, expected_state
        self.p2p, self.dht, self.faults, self.emulation = p2p, dht, faults, emulation
        self.via: Optional[Callable[[str], Optional[str]]] = None  # a replica's state handler: through a relay?
        self.log = NodeLog(logger, node_name)
        self.resyncs = 0
        #: re-syncs refused: no majority, a tie's state too far from ours or too soon after the last copy
        self.resyncs_refused = 0
        self._last_tie_try = -TIE_EVERY_ITERATIONS  # iteration of the last download under a tie
        self._skipped_steps = 0  # steps we skipped since then (we know we are behind: a tie copy is due)
        self._not_averaged: set = set()  # stage-mates (and we) whose round failed since the stage was in sync
        #: iteration -> peer -> the record its direct NormReport carried
        self._reports: Dict[int, Dict[str, NormRecord]] = {}
        self._report_arrived: Optional[asyncio.Event] = None
        self._writes: set = set()  # DHT writes of our norm records still under way
        #: members whose numbers came from the DHT instead of their direct report (all iterations)
        self.norms_from_dht = 0
        #: WAN emulation: seconds the averaging phase was padded to its emulated all-reduce time, and
        #: seconds the real all-reduce took beyond it (the host was slower than the emulated links)
        self.averaging_padded_s = 0.0
        self.averaging_overrun_s = 0.0
        #: bounds this replica's averaged gradients (a groupmate's poisoned contribution)
        self.screen = AveragingScreen()
        #: norm reports of members left out of the clip coefficient, and averaged results refused
        self.excluded_reports = 0
        self.averaging_outliers = 0

    # ------------------------------------------------------------------ direct norm reports
    def on_norm_report(self, msg: NormReport, sender: str) -> None:
        """Data-plane callback: a member's numbers for an iteration (the guard checked the sender)."""
        if (msg.run_id != self.cfg.run_id or sender != msg.peer_id or msg.iteration <= self.progress.committed
                or msg.iteration > self.progress.current + 1):
            return
        self._reports.setdefault(msg.iteration, {})[msg.peer_id] = record_of_report(msg)
        if self._report_arrived is not None:
            self._report_arrived.set()

    def direct_records(self, it: int) -> Dict[str, NormRecord]:
        """Iteration ``it``'s records of the members that reached us directly."""
        members = set(self.epochs.members)
        return {p: r for p, r in self._reports.get(it, {}).items() if p in members}

    def _forget_reports(self, it: int) -> None:
        for old in [k for k in self._reports if k <= it]:
            del self._reports[old]

    def _send_reports(self, it: int, record: NormRecord) -> None:
        if self.sender.dataplane is None:
            return
        msg = norm_report(self.cfg.run_id, it, self.peer_id, record)
        for peer in self.epochs.members:
            if peer != self.peer_id and self.health.is_alive(peer) and self.health.reaches(peer):
                self.sender.send_control(peer, msg)

    def _write_record(self, it: int, record: NormRecord) -> None:
        """Store our record in the DHT in the background (the fallback for members our report missed)."""

        async def write() -> None:
            try:
                await write_norm_record(self.dht, self.cfg.run_id, it, self.peer_id, record,
                                        ttl_s=self.cfg.norm_record_ttl_s)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the direct reports carry the numbers too
                self.log.warning("storing the norm record of iteration %d failed: %r", it, e)

        task = asyncio.create_task(write())
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def commit(self, it: int, st: IterationState, t0: float, t_mb: float,
                     behind: Tuple[float, float]) -> IterationStats:
        """Average, exchange norms, clip and step iteration ``it``; returns its statistics."""
        runtime = self.resources.runtime
        assert runtime is not None
        dropped = sum(int(d.dropped) for d in st.done.values())
        visits = runtime.visits  # before the step resets it
        averaged = await self._average(it)
        t_avg = time.perf_counter()
        # device work (norm, checksum) runs in the compute thread, never on the event loop
        sq, checksum = await self.compute(lambda: (runtime.grad_squared_norm(), runtime.checksum()))
        mine = NormRecord(
            stage=self.epochs.stage, sq=sq, checksum=checksum, epoch=self.epochs.epoch.epoch, loss_scale=runtime.loss_scale,
            loss_sum=float(sum(st.losses)), n_mb=len(st.losses), tokens=st.tokens if (self.epochs.stage == 0) else 0,
            dropped=st.dropped if (self.epochs.stage == 0) else 0,
            avg_group=tuple(self.resources.averager.last_group) if averaged and self.resources.averager is not None else ())
        if self.faults:  # rehearsing a bad member: the report says what the rule makes it say
            mine = replace(mine, sq=float(self.faults.tamper(it, "norm", mine.sq)))
        records = await self._exchange_norms(it, mine)
        verdict = robust_squared_norm(records)
        self._blame_reports(it, verdict.excluded)
        total_sq = verdict.total_sq
        coef = clip_coefficient(total_sq, self.cfg.optim.clip_norm)
        t_norm = time.perf_counter()
        decision = self._resync_decision(records, mine.checksum)  # a failed round shows in the next checksums
        own_failed = self.peer_id in self._not_averaged
        in_sync = decision.action is ResyncAction.KEEP and not decision.why  # in step with the stage's majority again
        self._skipped_steps = 0 if in_sync else self._skipped_steps
        self._not_averaged = not_averaged_after(self._not_averaged, records, self.epochs.replicas(self.epochs.stage), in_sync)
        # a member whose own report was left out steps on nothing (its gradient is the outlier)
        finite = math.isfinite(total_sq) and math.isfinite(mine.sq) and self.peer_id not in verdict.excluded
        # fp16: a member whose loss scale differs from the canonical data node's skips, like on an overflow,
        # and is re-synced; step()/skip_step() update the scale (halved on a skip)
        finite = finite and loss_scales_agree(records, runtime.loss_scale)

        def step() -> None:
            if not finite:  # a poisoned gradient is never applied (replicas that stepped re-sync us)
                self.log.warning("non-finite gradient norm at iteration %d; stage %d skips this step", it, self.epochs.stage)
                runtime.skip_step()
                self._skipped_steps += 1
            else:
                if averaged:
                    self.screen.accepted(mine.sq)
                runtime.scale_grads(coef)
                runtime.step()
            self.progress.state_iteration = it

        resynced = None if decision.source is None else await self._resync(decision, it, own_round_failed=own_failed)
        if resynced is None:
            await self.compute(step)
        n_mb = sum(r.n_mb for r in records.values())
        return IterationStats(
            iteration=it, epoch=self.epochs.epoch.epoch, loss=sum(r.loss_sum for r in records.values()) / max(n_mb, 1),
            microbatches=n_mb, tokens=sum(r.tokens for r in records.values()),
            seconds=time.perf_counter() - t0, grad_norm=math.sqrt(total_sq), clip_coef=coef,
            active_nodes=len(records), local_visits=visits, averaged=averaged,
            microbatch_s=t_mb - t0, averaging_s=t_avg - t_mb, norm_exchange_s=t_norm - t_avg,
            step_s=time.perf_counter() - t_norm, dropped=dropped, retried=st.retried,
            resynced=resynced is True, compute_overrun_s=behind[0], late_frames_s=behind[1])

    def _blame_reports(self, it: int, excluded: Mapping[str, str]) -> None:
        """Count the members whose norm reports were left out as faulty (banned after a few)."""
        for peer, why in sorted(excluded.items()):
            self.excluded_reports += 1
            if peer == self.peer_id:
                self.log.warning("our norm report of iteration %d was left out (%s); skipping our step", it, why)
            else:
                self.health.fault(peer, f"norm report of iteration {it}: {why}")

    # ------------------------------------------------------------------ averaging
    def prepare_averaging(self) -> None:
        """At an iteration's start: the averager finds its group while the microbatches run (StageAverager.prepare)."""
        if self.resources.averager is None:
            return
        if len(self._live_replicas()) < 2:
            return
        last = self.progress.history[-1].microbatch_s if self.progress.history else self.cfg.averaging.matchmaking_timeout_s
        self.resources.averager.prepare(expected_s=last)

    def _averaging_replicas(self) -> list:
        """The replicas our averager's group holds: every replica when a reducer serves the stage (the reducer
        connects them), else those a connection can exist to (as :func:`node.train.averaging.averaging_group`)."""
        averager = self.resources.averager
        if averager is not None and averager.reducer is not None:
            return list(averager.replicas)
        return [p for p in self.epochs.replicas(self.epochs.stage) if self.health.reaches(p)]

    def _live_replicas(self) -> list:
        averager = self.resources.averager
        if averager is not None and averager.reducer is not None and not self.health.is_alive(averager.reducer):
            return [self.peer_id]  # the reducer went away: nobody can average with us
        return [p for p in self._averaging_replicas() if self.health.is_alive(p)]

    async def _average(self, it: int) -> Optional[bool]:
        assert self.resources.runtime is not None
        group = self._averaging_replicas()
        live = self._live_replicas()
        await self.compute(self.resources.runtime.mean_grads)  # device work: in the compute thread
        if self.resources.averager is None or len(live) < 2:
            if self.resources.averager is not None:
                self.resources.averager.cancel_prepared()
                self.log.warning("stage %d averaging skipped at iteration %d: no other replica in the view (%s)",
                                 self.epochs.stage, it, ", ".join(p[-8:] for p in group if p != self.peer_id))
            return None
        epoch = self.epochs.epoch.epoch

        async def groupmates_gone_on() -> bool:
            known = {**(await self.norm_records(it) or {}), **self.direct_records(it)}
            records = {p: r.to_dict() for p, r in known.items()}
            return groupmates_went_on(self.peer_id, group, records, epoch, self.health.is_alive)

        runtime = self.resources.runtime
        if self.faults:  # rehearsing a bad member: a poisoned contribution
            rule = self.faults.corruption(it, "average")
            if rule is not None:
                await self.compute(lambda: [g.copy_(self.faults.corrupt_value(rule, g))
                                                     for g in runtime.grads() if g is not None])
        bound = self.screen.bound(await self.compute(runtime.grad_squared_norm))
        t0 = time.monotonic()
        ok = await self.resources.averager.average(runtime.grads(), weight=float(runtime.visits),
                                         abandon_when=groupmates_gone_on, max_norm=bound)
        await self._pad_averaging(live, time.monotonic() - t0)
        if not ok and self.resources.averager.last_outlier is not None:
            self._blame_average(it, live, self.resources.averager.last_outlier, bound)
        elif not ok:
            self.log.warning("stage %d averaging failed; stepping with the local mean gradient (replicas are "
                             "re-synced by checksum next iteration)", self.epochs.stage)
        return ok

    def _blame_average(self, it: int, live, norm: float, bound: Optional[float]) -> None:
        """An averaged gradient far above our own: with one groupmate, it sent the poison (banned now);
        with more, the culprit cannot be named and each honest replica keeps its own gradient."""
        self.averaging_outliers += 1
        reducer = self.resources.averager.reducer  # one reduced every part: it may be the one that poisoned the mean
        others = [p for p in live if p != self.peer_id] + [r for r in (reducer,) if r is not None]
        self.log.warning("stage %d averaging of iteration %d gave a gradient of norm %.3g (bound %.3g); stepping "
                         "with the local mean gradient", self.epochs.stage, it, norm, bound or math.nan)
        if len(others) == 1:
            self.health.fault(others[0], f"its averaging contribution of iteration {it} made the mean {norm:.3g} "
                                         f"(bound {bound:.3g})", ban_now=True)

    def emulated_allreduce_s(self, group) -> float:
        """The emulated all-reduce time of our gradients among ``group`` (:func:`node.train.timing.emulated_allreduce_s`)."""
        runtime = self.resources.runtime
        return 0.0 if runtime is None else emulated_allreduce_s(self.emulation, runtime.grads(), group, self.peer_id)

    async def _pad_averaging(self, group, took_s: float) -> None:
        """Under link emulation, wait until the averaging phase took its emulated all-reduce time."""
        target = self.emulated_allreduce_s(group)
        if target <= 0:
            return
        if took_s >= target:
            self.averaging_overrun_s += took_s - target
            return
        self.averaging_padded_s += target - took_s
        await asyncio.sleep(target - took_s)

    # ------------------------------------------------------------------ norm exchange
    async def norm_records(self, it: int) -> Optional[Dict[str, NormRecord]]:
        """Iteration ``it``'s norm records of the members from the DHT; None: nothing found (not "nobody published")."""
        members = set(self.epochs.members)
        records = await read_norm_records(self.dht, self.cfg.run_id, it, members=members)
        return None if records is None else {p: r for p, r in records.items() if p in members}

    async def _exchange_norms(self, it: int, record: NormRecord) -> Dict[str, NormRecord]:
        """Send our record for iteration ``it`` to every member, store it in the DHT, and collect
        every member's: direct reports first; the DHT only after ``norm_direct_grace_s`` and only
        while some member's report is missing (a lost report, a member whose data plane we lack).

        Records carry the sender's epoch, and only records of *our* epoch are returned: a member
        that switched epochs at another boundary (it missed an announcement) never mixes its
        numbers into ours. Records also carry pending epochs, so the union of what the members
        know reaches everyone at every barrier, and all switch at the same boundary."""
        mine = self.epochs.epoch.epoch
        record = replace(record, epochs=tuple(self.epochs.to_announce(it)))
        if self._report_arrived is None:
            self._report_arrived = asyncio.Event()
        self._send_reports(it, record)
        self._write_record(it, record)
        now = time.monotonic()
        deadline = now + self.cfg.norm_exchange_timeout_s
        indirect = not all(self.health.reaches(p) for p in self.epochs.members)  # its numbers: DHT only
        next_read = now + (self.cfg.norm_poll_s if indirect else self.cfg.norm_direct_grace_s)
        from_dht: Dict[str, NormRecord] = {}
        poll = self.cfg.norm_poll_s
        while True:
            self._report_arrived.clear()
            direct = self.direct_records(it)
            found = {**from_dht, **direct, self.peer_id: record}
            done = all(p in found or not self.health.is_alive(p) for p in self.epochs.members)
            if not done and time.monotonic() > deadline:
                missing = [p for p in self.epochs.members if p not in found and self.health.is_alive(p)]
                for p in missing:
                    self.health.suspect(p, f"no gradient norm for iteration {it} in "
                                           f"{self.cfg.norm_exchange_timeout_s:.0f}s")
                self.log.warning("going on without the norms of %s for iteration %d", [p[-8:] for p in missing], it)
                done = True
            if done:
                self.norms_from_dht += sum(1 for p in found if p not in direct and p != self.peer_id)
                self._forget_reports(it)
                self.epochs.learn(r.epochs for r in found.values())
                others = {p: r.epoch for p, r in found.items() if r.epoch != mine}
                if others:
                    self.log.warning("members %s finished iteration %d on other epochs %s (we are on %d); their "
                                     "numbers are left out", [p[-8:] for p in others], it,
                                     sorted(set(others.values())), mine)
                    ahead = max(others.values())
                    if ahead > mine and not self.epochs.knows(ahead):
                        await self.epochs.catch_up(ahead)
                return {p: r for p, r in found.items() if r.epoch == mine}
            now = time.monotonic()
            if now >= next_read:  # fallback: some report is late or lost
                from_dht = await self.norm_records(it) or from_dht
                next_read = time.monotonic() + poll
                poll = min(2 * poll, max(self.cfg.norm_poll_s, self.cfg.norm_poll_max_s))
                continue
            # wake on a report, or to re-check liveness and the fallback
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._report_arrived.wait(),
                                       max(0.0, min(next_read - now, self.cfg.liveness_poll_s)))

    async def maybe_done_from_norms(self, it: int, st: IterationState, last_poll: float) -> float:
        """A data node publishes its gradient norm only after its microbatches are done, so its norm
        record (its direct report, else its DHT record) stands in for an ``IterationDone`` we never got
        (sent while our data plane was not up yet, e.g. a joiner still downloading its state, or lost
        with a broken stream). Without this, such a node would wait forever while the swarm waits for its norm."""
        now = time.monotonic()
        if st.all_done.is_set() or now - last_poll < self.cfg.done_poll_s:
            return last_poll
        with contextlib.suppress(Exception):
            direct = self.direct_records(it)
            waiting = [p for p in self.epochs.data_node_peers if p not in st.done]
            records = direct if all(p in direct for p in waiting) else {
                **(await self.norm_records(it) or {}), **direct}
            for peer, r in records.items():
                if peer in self.epochs.data_node_peers and peer not in st.done:
                    self.log.info("iteration %d of data node %s is done (its norm record; no IterationDone "
                                  "reached us)", it, peer[-8:])
                    st.done[peer] = DoneFromNorm(r.dropped)
            self.progress.check_done(st)
        return time.monotonic()

    # ------------------------------------------------------------------ resync
    def _trusted_checksums(self, records: Mapping[str, NormRecord]) -> Dict[str, Tuple[int, float]]:
        """(stage, checksum) of this node and of every member it trusts: a replica this node banned or
        caught misbehaving (a poisoned round, a lying report) is neither a source nor part of a majority."""
        return {p: (r.stage, r.checksum) for p, r in records.items() if p == self.peer_id or self.health.trusted(p)}

    def _resync_decision(self, records: Mapping[str, NormRecord], mine: float) -> ResyncDecision:
        decision = reachable_source(resync_decision(self._trusted_checksums(records), mine, self.epochs.stage,
                                                    self.peer_id, self.cfg.resync_tolerance, self._not_averaged),
                                     reaches_or_relayed(self.health.reaches, self.via))
        if decision.action is ResyncAction.FOLLOW or decision.action is ResyncAction.TIE:
            self.log.warning("stage %d parameters differ from replica %s (checksum %.9g vs %.9g; %s); re-syncing",
                             self.epochs.stage, decision.source[-8:], mine, records[decision.source].checksum,
                             decision.why)
        elif decision.action is ResyncAction.REFUSE:
            self._refuse_resync("stage %d replicas disagree (%s): keeping our own state", self.epochs.stage,
                                decision.why)
        return decision

    def _refuse_resync(self, msg: str, *args) -> None:
        """Count a refused re-sync; log the first, then one in :data:`REFUSED_LOG_EVERY` (a lasting disagreement)."""
        self.resyncs_refused += 1
        if self.resyncs_refused % REFUSED_LOG_EVERY == 1:
            self.log.warning(msg + " (%d refused so far)", *args, self.resyncs_refused)

    async def _resync(self, decision: ResyncDecision, it: int, own_round_failed: bool = False) -> Optional[bool]:
        """Take the state of the stage's majority (or, under a tie, the other replica's) right after its
        step of ``it`` instead of stepping ourselves: True when loaded, False when no replica handed it over
        (we stepped on our own), None when a tie's state is refused (the caller steps as usual).
        ``own_round_failed``: we know why we differ, so a tie copy needs no wait (:mod:`node.train.resync`)."""
        from node.dataplane.state_transfer import StateTransferError, fetch_verified_state
        tie = decision.action is ResyncAction.TIE
        if tie:
            if it - self._last_tie_try < TIE_EVERY_ITERATIONS and not self._skipped_steps and not own_round_failed:
                self._refuse_resync("not copying replica %s: a tie was last tried at iteration %d (at most once per "
                                    "%d iterations unless we skipped a step); keeping our own state", decision.source[-8:],
                                    self._last_tie_try, TIE_EVERY_ITERATIONS)
                return None
            self._last_tie_try, skipped, self._skipped_steps = it, self._skipped_steps, 0
        peers = [decision.source] + [p for p in decision.backers if p not in (decision.source, self.peer_id)]
        try:
            snap, _ = await fetch_verified_state(self.p2p, self.cfg.run_id, peers, self.epochs.stage, it,
                                                 expected=self.expected_state(),
                                                 timeout_s=self.cfg.state_fetch_timeout_s, dht=self.dht, via=self.via)
        except StateTransferError as e:
            self.log.warning("re-sync failed (%s); stepping on our own", e)

            def step_unclipped() -> None:
                self.resources.runtime.step()
                self.progress.state_iteration = it

            await self.compute(step_unclipped)
            return False
        if tie:
            ok, steps = await self.compute(lambda: within_tie_bound(
                self.resources.runtime.module.state_dict(), snap.state["model"], self.cfg.optim.lr, skipped))
            if not ok:
                self._refuse_resync("not copying replica %s: its weights are %.3g learning-rate steps from ours "
                                    "(more than a failed averaging round explains); keeping our own state",
                                    decision.source[-8:], steps)
                return None
            self.log.info("copying replica %s under a tie: its weights are %.3g learning-rate steps from ours",
                          decision.source[-8:], steps)
        state = snap.state

        def load() -> None:
            self.resources.runtime.load_state_dict(state)
            self.resources.runtime.reset_grads()
            self.progress.state_iteration = it
            self._skipped_steps = 0

        await self.compute(load)
        self.resyncs += 1
        return True
