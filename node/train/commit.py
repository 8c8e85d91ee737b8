"""Committing an iteration once its microbatches are done: average, exchange norms, clip, step.

1. **Averaging.** Each replica turns its summed gradient into the mean over the microbatches that
   visited it, and the stage's replicas all-reduce it weighted by those counts (:mod:`averaging`).
2. **Norm exchange.** Every member publishes a :class:`node.net.records.NormRecord` (its stage's
   squared gradient norm, loss sums, parameter checksum) and waits for every member's; the global
   norm is the square root of the sum over stages (one value per stage: the replica with the
   smallest peer id, so every node computes the same number). A member silent for
   ``norm_exchange_timeout_s`` is suspected and left out: a hung node must not stop the swarm.
3. **Clip and step** by ``min(1, clip / norm)``; a non-finite norm skips the step. A replica whose
   checksum differs from its stage's canonical replica (a failed all-reduce) copies that replica's
   state instead of stepping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Dict, Mapping, Optional, Tuple

from node.net.records import NormRecord, read_norm_records, write_norm_record
from node.train.averaging import groupmates_went_on
from node.train.common import DoneFromNorm, IterationState, IterationStats, NodeLog
from node.train.runtime import clip_coefficient

if TYPE_CHECKING:
    from node.train.trainer import TrainerNode

__all__ = ["IterationCommit", "resync_source", "global_squared_norm"]

logger = logging.getLogger(__name__)


def resync_source(replicas: Mapping[str, Tuple[int, float]], mine: float, stage: int, me: str,
                  tolerance: float) -> Optional[str]:
    """The replica to copy from when ours diverged (a failed all-reduce): the lowest peer id of our
    stage among ``replicas`` (peer -> (stage, checksum)); None when we agree with it (or are it).
    Only a replica with finite parameters can be a source (a NaN one would spread)."""
    ours = sorted(p for p, (s, checksum) in replicas.items() if s == stage and math.isfinite(checksum))
    if not ours or ours[0] == me:
        return None
    theirs = replicas[ours[0]][1]
    if math.isfinite(mine) and abs(theirs - mine) <= tolerance * max(1.0, abs(theirs)):
        return None
    return ours[0]


def global_squared_norm(records: Mapping[str, NormRecord]) -> float:
    """Sum over stages of the squared norm of the stage's lowest-id replica."""
    per_stage: Dict[int, Tuple[str, float]] = {}
    for peer, r in records.items():
        if r.stage not in per_stage or peer < per_stage[r.stage][0]:
            per_stage[r.stage] = (peer, r.sq)
    return sum(sq for _, sq in per_stage.values())


class IterationCommit:
    """Averaging, norm exchange, clipping, resync and step of one :class:`TrainerNode`."""

    def __init__(self, node: "TrainerNode"):
        self.node = node
        self.cfg = node.cfg
        self.log = NodeLog(logger, node.node_name)
        self.resyncs = 0

    async def commit(self, it: int, st: IterationState, t0: float, t_mb: float,
                     behind: Tuple[float, float]) -> IterationStats:
        """Average, exchange norms, clip and step iteration ``it``; returns its statistics."""
        node = self.node
        runtime = node.runtime
        assert runtime is not None
        dropped = sum(int(d.dropped) for d in st.done.values())
        averaged = await self._average(it)
        t_avg = time.perf_counter()
        mine = NormRecord(
            stage=node.stage, sq=runtime.grad_squared_norm(), checksum=runtime.checksum(), epoch=node.epoch.epoch,
            loss_sum=float(sum(st.losses)), n_mb=len(st.losses), tokens=st.tokens if node.is_data_node else 0,
            dropped=st.dropped if node.is_data_node else 0,
            avg_group=tuple(node.averager.last_group) if averaged and node.averager is not None else ())
        records = await self._exchange_norms(it, mine)
        total_sq = global_squared_norm(records)
        coef = clip_coefficient(total_sq, self.cfg.optim.clip_norm)
        t_norm = time.perf_counter()
        source = self._resync_source(records, mine.checksum)
        finite = math.isfinite(total_sq) and math.isfinite(mine.sq)

        def step() -> None:
            if not finite:  # a poisoned gradient is never applied (replicas that stepped re-sync us)
                self.log.warning("non-finite gradient norm at iteration %d; stage %d skips this step", it, node.stage)
                runtime.skip_step()
            else:
                runtime.scale_grads(coef)
                runtime.step()
            node.stage_state.state_iteration = it

        if source is not None:
            await self._resync(source, it)
        else:
            await node.pipeline.compute(step)
        n_mb = sum(r.n_mb for r in records.values())
        return IterationStats(
            iteration=it, epoch=node.epoch.epoch, loss=sum(r.loss_sum for r in records.values()) / max(n_mb, 1),
            microbatches=n_mb, tokens=sum(r.tokens for r in records.values()),
            seconds=time.perf_counter() - t0, grad_norm=math.sqrt(total_sq), clip_coef=coef,
            active_nodes=len(records), local_visits=runtime.visits, averaged=averaged,
            microbatch_s=t_mb - t0, averaging_s=t_avg - t_mb, norm_exchange_s=t_norm - t_avg,
            step_s=time.perf_counter() - t_norm, dropped=dropped, retried=st.retried,
            resynced=source is not None, compute_overrun_s=behind[0], late_frames_s=behind[1])

    # ------------------------------------------------------------------ averaging
    async def _average(self, it: int) -> Optional[bool]:
        node = self.node
        assert node.runtime is not None
        group = node.epochs.replicas(node.stage)
        live = [p for p in group if node.health.is_alive(p)]
        node.runtime.mean_grads()
        if node.averager is None or len(live) < 2:
            if node.averager is not None:
                self.log.warning("stage %d averaging skipped at iteration %d: no other replica in the view (%s)",
                                 node.stage, it, ", ".join(p[-8:] for p in group if p != node.peer_id))
            return None
        epoch = node.epoch.epoch

        async def groupmates_gone_on() -> bool:
            records = {p: r.to_dict() for p, r in (await self.norm_records(it) or {}).items()}
            return groupmates_went_on(node.peer_id, group, records, epoch, node.health.is_alive)

        ok = await node.averager.average(node.runtime.grads(), weight=float(node.runtime.visits),
                                         abandon_when=groupmates_gone_on)
        if not ok:
            self.log.warning("stage %d averaging failed; stepping with the local mean gradient (replicas are "
                             "re-synced by checksum next iteration)", node.stage)
        return ok

    # ------------------------------------------------------------------ norm exchange
    async def norm_records(self, it: int) -> Optional[Dict[str, NormRecord]]:
        """Iteration ``it``'s norm records of the members (peer id -> record), read from the DHT;
        None when the read found nothing (a miss under load is not "nobody published")."""
        records = await read_norm_records(self.node.dht, self.cfg.run_id, it, members=set(self.node.members))
        if records is None:
            return None
        members = set(self.node.members)
        return {p: r for p, r in records.items() if p in members}

    async def _exchange_norms(self, it: int, record: NormRecord) -> Dict[str, NormRecord]:
        """Publish our record for iteration ``it`` and collect every member's.

        Records carry the sender's epoch, and only records of *our* epoch are returned: a member
        that switched epochs at another boundary (it missed an announcement) never mixes its
        numbers into ours. Records also carry pending epochs, so the union of what the members
        know reaches everyone at every barrier, and all switch at the same boundary."""
        node = self.node
        mine = node.epoch.epoch
        record = replace(record, epochs=tuple(node.epochs.to_announce(it)))
        await write_norm_record(node.dht, self.cfg.run_id, it, node.peer_id, record, ttl_s=self.cfg.norm_record_ttl_s)
        deadline = time.monotonic() + self.cfg.norm_exchange_timeout_s
        found: Dict[str, NormRecord] = {}
        poll = self.cfg.norm_poll_s
        while True:
            found = await self.norm_records(it) or found
            done = all(p in found or not node.health.is_alive(p) for p in node.members)
            if not done and time.monotonic() > deadline:
                missing = [p for p in node.members if p not in found and node.health.is_alive(p)]
                for p in missing:
                    node.health.suspect(p, f"no gradient norm for iteration {it} in "
                                           f"{self.cfg.norm_exchange_timeout_s:.0f}s")
                self.log.warning("going on without the norms of %s for iteration %d", [p[-8:] for p in missing], it)
                done = True
            if done:
                node.epochs.learn(r.epochs for r in found.values())
                others = {p: r.epoch for p, r in found.items() if r.epoch != mine}
                if others:
                    self.log.warning("members %s finished iteration %d on other epochs %s (we are on %d); their "
                                     "numbers are left out", [p[-8:] for p in others], it,
                                     sorted(set(others.values())), mine)
                    ahead = max(others.values())
                    if ahead > mine and not node.epochs.knows(ahead):
                        await node.epochs.catch_up(ahead)
                return {p: r for p, r in found.items() if r.epoch == mine}
            await asyncio.sleep(poll)
            poll = min(2 * poll, max(self.cfg.norm_poll_s, self.cfg.norm_poll_max_s))

    async def maybe_done_from_norms(self, it: int, st: IterationState, last_poll: float) -> float:
        """A data node publishes its gradient norm only after its microbatches are done, so its norm
        record stands in for an ``IterationDone`` we never got (sent while our data plane was not
        up yet, e.g. a joiner still downloading its state, or lost with a broken stream). Without
        this, such a node would wait forever while the swarm waits for its norm."""
        node = self.node
        now = time.monotonic()
        if st.all_done.is_set() or now - last_poll < self.cfg.done_poll_s:
            return last_poll
        with contextlib.suppress(Exception):
            records = await self.norm_records(it)
            if records is not None:
                for peer, r in records.items():
                    if peer in node.data_node_peers and peer not in st.done:
                        self.log.info("iteration %d of data node %s is done (its norm record; no IterationDone "
                                      "reached us)", it, peer[-8:])
                        st.done[peer] = DoneFromNorm(r.dropped)
                node.check_done(st)
        return time.monotonic()

    # ------------------------------------------------------------------ resync
    def _resync_source(self, records: Mapping[str, NormRecord], mine: float) -> Optional[str]:
        node = self.node
        source = resync_source({p: (r.stage, r.checksum) for p, r in records.items()}, mine, node.stage,
                               node.peer_id, self.cfg.resync_tolerance)
        if source is not None:
            self.log.warning("stage %d parameters differ from replica %s (checksum %.9g vs %.9g); re-syncing",
                             node.stage, source[-8:], mine, records[source].checksum)
        return source

    async def _resync(self, source: str, it: int) -> None:
        """Take ``source``'s state right after its step of ``it`` instead of stepping ourselves."""
        from node.dataplane.state_transfer import StateTransferError, fetch_state

        node = self.node
        try:
            _, snap = await fetch_state(node.p2p, self.cfg.run_id, [source], node.stage, it,
                                        timeout_s=self.cfg.state_fetch_timeout_s)
        except StateTransferError as e:
            self.log.warning("re-sync failed (%s); stepping on our own", e)

            def step_unclipped() -> None:
                node.runtime.step()
                node.stage_state.state_iteration = it

            await node.pipeline.compute(step_unclipped)
            return
        state = await node.pipeline.compute(snap.state_dict)

        def load() -> None:
            node.runtime.load_state_dict(state)
            node.runtime.reset_grads()
            node.stage_state.state_iteration = it

        await node.pipeline.compute(load)
        self.resyncs += 1
