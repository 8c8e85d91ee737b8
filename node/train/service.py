"""The trainer inside the daemon: a supervisor that agrees on the run, trains, re-joins and drains.

``Daemon(config, services=[TrainerService(...)])`` starts it with the daemon as its
:class:`node.train.host.TrainerHost`. The service pins an epoch and waits for the other members
(:class:`node.train.agreement.RunAgreement`), builds a :class:`node.train.trainer.TrainerNode`
on it and trains; when a newer epoch leaves this node out (a view that briefly lost it, a take-over
coordinator) it waits for one that includes it again and re-joins with a fresh copy of its stage's
state. On SIGTERM it drains: it keeps training until an epoch without it starts, so no in-flight
microbatch is lost.

Progress: the ``training`` RPC (``{"since": i, "limit": n}``) returns the state (a
:class:`ServiceState` value), the pinned epoch, stage, committed iteration and recent
:class:`node.train.common.IterationStats`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from dataclasses import asdict, replace
from typing import Callable, List, Optional

import torch

from node.errors import UserError
from node.spec import DEFAULT_AGREEMENT_TIMEOUT_S
from node.net.records import rejected_counts
from node.train.agreement import RepinEpoch, RunAgreement, training_summary
from node.train.checkpoint import CheckpointDiskFull
from node.train.common import IterationStats, JoinFailed, NodeLog, TrainerConfig
from node.train.epochs import parse_schedule, stage_index
from node.train.host import TrainerHost
from node.train.proof import StageAccess, StageProof, held_sketch, proof_for
from node.train.relay_link import reachability_of, relay_of
from node.train.staleness import norm_record_reader, run_unless_stale

__all__ = ["TrainerService", "ServiceState", "capped_join_boundary"]

logger = logging.getLogger(__name__)

#: Seconds a node whose join found its stage's replicas disagreeing answers admission "not ready" (doubling
#: with each such join up to MAX_JOIN_RETRY_S): replicas that disagree now will not agree a moment later,
#: and every epoch that names a node which cannot train makes the members wait for its gradient norm.
JOIN_RETRY_S = 60.0
#: Longest such back-off: an honest joiner still tries every ten minutes (the liar may have left).
MAX_JOIN_RETRY_S = 600.0


class ServiceState(str, enum.Enum):
    """What the service is doing; the values are what the ``training`` RPC reports."""

    WAITING = "waiting"  # for an epoch to pin (or to re-join)
    AGREEING = "agreeing"  # pinned; waiting for every member to confirm the same run
    TRAINING = "training"
    PAUSED = "paused"  # training, but a stage has no live replica (reported, never stored)
    LEFT = "left"  # a newer epoch left this node out
    DONE = "done"  # the run reached its last iteration
    ERROR = "error"
    STOPPED = "stopped"


def _kill_own_process_group() -> None:
    """Injected kill inside a daemon: die like a machine losing power, p2pd and DHT child included."""
    import os
    import signal

    if os.getpgid(0) == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def capped_join_boundary(earliest: int, wanted: int, iterations: int) -> int:
    """The start iteration of an epoch that adds a joiner: ``wanted`` (the join lead in iterations,
    measured from the recent iteration times, after ``earliest``), but never so far that the run
    ends first: at most half of the iterations left after ``earliest``, so a late joiner still
    joins while any are left. ``earliest`` itself (or beyond the run) when none are."""
    earliest, wanted = int(earliest), max(int(wanted), int(earliest))
    left = int(iterations) - earliest
    if left <= 0:
        return earliest
    return min(wanted, earliest + left // 2)


def measured_compute(trainer) -> Optional[float]:
    """For a node's advert: its stage's compute speed measured while training (None before enough steps, or
    while it has no stage); the coordinator plans with it instead of the start-up benchmark."""
    runtime = trainer.runtime if trainer is not None else None
    return runtime.meter.estimate() if runtime is not None else None


def drain_pointless(daemon, trainer) -> Optional[str]:
    """Why no epoch without this node will come (so waiting for one while draining is pointless), or None."""
    view = daemon.view
    if view is None or trainer is None or trainer.runtime is None:
        return "no swarm view"
    me = str(daemon.peer_id)
    online = [e for e in view.online() if e.peer_id != me]
    if not any(trainer.stage in e.advert.stages for e in online):
        return f"no other ONLINE node holds stage {trainer.stage}"
    if not any(0 in e.advert.stages for e in online):
        return "no other ONLINE data node to coordinate"
    return None


async def follow_stage_move(host: TrainerHost, trainer, epoch) -> None:
    """Tell ``host`` the stage ``epoch`` (the one this node is about to train on) gives it: an ``--auto`` node
    advertises the stage it trains, wherever an epoch moved it (the host keeps the advert of a node given
    ``--stages``). After ``trainer`` left because the epoch moved it (:class:`StageMoved`), the trainer built on
    ``epoch`` joins the new stage as a joiner does: its data plane up first, then the stage's verified state of
    the iteration before the epoch's first, from that stage's replicas; if that download fails, the join fails
    as a joiner's does (this node waits for a later epoch, the others train on). The old stage's checkpoint is
    kept as it is: checkpoints are kept per stage, so it stays a complete file of that stage at the last
    iteration this node committed there, which a ``--resume`` on that stage can still use; the new stage
    checkpoints to its own file."""
    me = str(host.peer_id)
    stage = stage_index(parse_schedule(epoch.schedule)).get(epoch.members.index(me)) if me in epoch.members else None
    if stage is None:
        return
    if trainer is not None and trainer.moved is not None:
        trainer.log.info("moving from stage %d to stage %d (schedule epoch %d, from iteration %d)",
                         trainer.moved.old_stage, stage, epoch.epoch, int(epoch.start_iteration))
    await host.move_stage(stage)


class TrainerService:
    """Runs a :class:`TrainerNode` inside the daemon; implements its ``DaemonService`` protocol
    (``async start(daemon)``, ``async stop()``)."""

    def __init__(self, config: TrainerConfig, iterations: int, *, node_name: Optional[str] = None,
                 on_iteration: Optional[Callable[[IterationStats], None]] = None, poll_s: float = 0.5,
                 min_members: int = 1, start_debounce_s: Optional[float] = None,
                 agreement_timeout_s: float = DEFAULT_AGREEMENT_TIMEOUT_S, threads: Optional[int] = None, emulation=None,
                 faults=None, drain_timeout_s: float = 60.0):
        self.emulation = emulation  # optional node.cli.emulation_args.EmulationSettings (peer locations: daemon view)
        self.faults = faults  # optional node.train.faults.FaultInjector (--inject)
        #: SIGTERM: how long this node keeps training until an epoch without it starts, before leaving anyway
        self.drain_timeout_s = drain_timeout_s
        self.config, self.iterations = config, iterations
        self.node_name, self.on_iteration, self.poll_s = node_name, on_iteration, poll_s
        self.min_members, self.start_debounce_s = max(1, int(min_members)), start_debounce_s
        self.agreement_timeout_s, self.threads = agreement_timeout_s, threads
        self.log = NodeLog(logger, node_name)
        self.trainer = None  # the TrainerNode of the current (or last) epoch
        self.proof: Optional[StageProof] = None  # this node's stage state while it is a candidate
        self.agreement: Optional[RunAgreement] = None
        self.stop_grace_s = 6.0  # how long stop() lets the current iteration finish after draining
        self.stop_timeout_s = self.drain_timeout_s + self.stop_grace_s  # the daemon waits this long for stop()
        self.done = asyncio.Event()
        self.error: Optional[BaseException] = None
        self.state = ServiceState.WAITING
        self.epoch = None  # the pinned ScheduleEpoch
        self.start_iteration: Optional[int] = None
        self._join_failures, self._join_retry_at = 0, 0.0  # disputed joins so far; 'not ready' until then
        self.daemon: Optional[TrainerHost] = None
        #: the training flags a joiner must pass (the founder's banner prints them); set by the CLI
        self.join_flags: Optional[List[str]] = None
        self._task: Optional[asyncio.Task] = None
        self._history_before: List[IterationStats] = []  # iterations committed before a re-join
        self._stopping = asyncio.Event()
        #: why training waits (a join that cannot proceed yet and is retried), shown in the training RPC
        self.waiting_reason: Optional[str] = None

    def _config_for(self, run) -> TrainerConfig:
        """Our configuration in ``run``: the run's stage count (founder's --num-stages, sent in hello)
        decides; layers per stage stay."""
        if run is not None and run.num_stages != self.config.model.n_stages:
            return replace(self.config, model=replace(self.config.model, n_stages=run.num_stages).validate())
        return self.config

    def run_summary(self, run) -> dict:
        """What this node would train in ``run`` (the daemon compares it with the run's in ``hello`` and
        advertises its digest, before this service starts)."""
        return training_summary(self._config_for(run), self.iterations)

    async def start(self, daemon: TrainerHost) -> None:
        if self.threads:
            torch.set_num_threads(int(self.threads))
        run = daemon.run
        if run is not None and run.num_stages != self.config.model.n_stages:
            self.log.info("model: %d stages for this run (instead of %d)", run.num_stages, self.config.model.n_stages)
            self.config = self._config_for(run)
        self.agreement = RunAgreement(daemon, self.config.run_id, training_summary(self.config, self.iterations),
                                      min_members=self.min_members, start_debounce_s=self.start_debounce_s,
                                      agreement_timeout_s=self.agreement_timeout_s, poll_s=self.poll_s,
                                      node_name=self.node_name)
        self.attach(daemon)
        self.proof = proof_for(self.config, daemon, self.node_name, wanted=lambda: not self._trains())
        if self.proof is not None:
            self.proof.start()
        self._task = asyncio.create_task(self._main(daemon), name="trainer-service")

    def attach(self, daemon: TrainerHost) -> None:
        """Give the daemon this service's hooks: the ``training`` RPC, the coordinator's progress and blocker,
        admission's committed iteration, the measured compute speed (adverts) and the adopted epochs."""
        self.daemon = daemon
        daemon.register_rpc("training", self._rpc_training)
        daemon.training_progress = self.switch_iteration
        daemon.training_iteration = self.committed_iteration
        daemon.coordination_blocker = self.coordination_blocker
        daemon.training_ready = self.ready_to_join
        daemon.measured_compute = lambda: measured_compute(self.trainer)
        daemon.on_schedule_epoch.append(self._offer_epoch)
        # a candidate proves its stage before an epoch names it (node.train.proof, node.swarm.admission)
        daemon.training_sketch = lambda stage, nonce: held_sketch(stage, nonce, self.trainer, self._trains(),
                                                                  self.proof, self.config.model.d_model)

    def _trains(self) -> bool:
        return self.state in (ServiceState.TRAINING, ServiceState.PAUSED) and self.trainer is not None

    def switch_iteration(self, lead_s: float = 0.0) -> Optional[int]:
        """For the coordinator: the iteration a new epoch should start at (None before training).

        After the last iteration it is the run's end, so an epoch issued then (for a late joiner)
        says the run is over instead of looking like a fresh start (0) that would gather members
        at the start barrier until it timed out."""
        if self._trains():
            earliest = self.trainer.switch_iteration(0.0)
            wanted = self.trainer.switch_iteration(lead_s) if lead_s > 0 else earliest
            return capped_join_boundary(earliest, wanted, self.iterations)
        if self.state is ServiceState.DONE:
            return self.iterations
        return None

    def _join_backoff(self, disputed: bool) -> float:
        """Seconds this node answers 'not ready' after a failed join (0 unless the replicas disagreed)."""
        if not disputed:
            return 0.0
        self._join_failures += 1
        backoff = min(JOIN_RETRY_S * 2 ** (self._join_failures - 1), MAX_JOIN_RETRY_S)
        self._join_retry_at = time.monotonic() + backoff
        return backoff

    def ready_to_join(self) -> bool:
        """For admission challenges: False during the back-off after a join that found its stage's replicas
        disagreeing (an epoch naming this node would only wait for a member that cannot train)."""
        return time.monotonic() >= self._join_retry_at

    def committed_iteration(self) -> Optional[int]:
        """For admission challenges: the iteration this node's trainer last committed, None while it is
        not training (a joiner still loading its state answers None, a stale trainer its old iteration)."""
        return int(self.trainer.committed_iteration) if self._trains() else None

    def coordination_blocker(self) -> Optional[str]:
        """Why this daemon must not coordinate now (the coordinator's ``blocker`` hook), or None.

        A node joining a run in progress computes an epoch's start iteration from its own trainer,
        which knows nothing of the run before its data plane is up (it would issue an epoch that
        starts at 0, or drop members it cannot reach yet); founders before the start barrier and
        nodes that train or finished may coordinate."""
        daemon = self.daemon
        if daemon is None:
            return None
        if self.state in (ServiceState.TRAINING, ServiceState.PAUSED):
            t = self.trainer
            if t is not None and t.dataplane is None:
                return "data plane not up yet"
            return None
        if self.state in (ServiceState.DONE, ServiceState.STOPPED, ServiceState.ERROR):
            return None
        epoch = daemon.current_epoch
        if epoch is None:
            return None  # nobody trains yet: founders issue the first epoch
        me = str(daemon.peer_id)
        if int(epoch.start_iteration) == 0 and me in epoch.members:
            return None  # at the start barrier with everyone else
        return "joining the run in progress: data plane not up yet"

    def _offer_epoch(self, epoch) -> None:
        if self.trainer is not None:
            self.trainer.offer_epoch(epoch)

    @property
    def debounce_s(self) -> float:
        return self.agreement.debounce_s if self.agreement is not None else (
            self.start_debounce_s if self.start_debounce_s is not None else 3.0)  # 3 heartbeats of 1 s

    def _on_iteration(self, stats: IterationStats) -> None:
        metrics = self.daemon.metrics
        if metrics is not None:
            try:
                metrics.set_iteration(stats.iteration, stats.loss, stats.tokens / max(stats.seconds, 1e-9))
            except Exception:  # noqa: BLE001 - metrics never break training
                self.log.debug("metrics update failed", exc_info=True)
        if self.on_iteration is not None:
            self.on_iteration(stats)

    async def _main(self, daemon: TrainerHost) -> None:
        try:
            epoch = await self.agreement.choose_epoch()
            first = True
            while True:
                try:
                    left_at = await self._train_on(daemon, epoch, first)
                except JoinFailed as e:
                    # the replica we need is busy or gone: the coordinator will issue another epoch
                    # (it starts later, so there is a newer state to fetch); try that one
                    backoff = self._join_backoff(e.disputed)
                    self.log.warning("%s; waiting for a later epoch to try again%s", e,
                                     f" (answering 'not ready' for {backoff:.0f} s)" if backoff else "")
                    self.waiting_reason = f"join failed, retrying with a later epoch: {e}"
                    left_at = max(int(epoch.start_iteration), 1)
                except RepinEpoch as e:
                    # members pinned another run (left out now) or a newer epoch: pin the next one
                    self.log.warning("%s; pinning the next schedule epoch", e)
                    self.state, self.waiting_reason = ServiceState.WAITING, str(e)
                    await self.trainer.shutdown()
                    epoch = await self.agreement.choose_epoch(after=(epoch.epoch, 0), stopping=self._stopping)
                    if epoch is None:
                        self.state = ServiceState.STOPPED
                        break
                    continue
                first = False
                if left_at is None:
                    break
                # left out of an epoch (a view that briefly lost us, a take-over coordinator): wait
                # for one that includes us again and re-join it with a fresh copy of our stage's state
                self.state = ServiceState.WAITING
                self.log.info("waiting for a schedule epoch that includes this node again (left at iteration %d)",
                              left_at)
                epoch = await self.agreement.choose_epoch(after=(self.trainer.epoch.epoch, left_at),
                                                          stopping=self._stopping)
                await self.trainer.shutdown()
                if epoch is None:  # stopped while waiting
                    self.state = ServiceState.STOPPED
                    break
        except asyncio.CancelledError:
            self.state = ServiceState.STOPPED
            raise
        except BaseException as e:
            if isinstance(e, UserError):
                self.log.error("training stopped: %s", e)
            else:
                self.log.exception("training stopped with an error")
            self.error, self.state = e, ServiceState.ERROR
            if isinstance(e, CheckpointDiskFull) and self.trainer is not None:
                # the hops queued here go back to their data nodes now, not at their deadlines
                self.trainer.pipeline.refuse_all("its checkpoint disk is full")
            if self.daemon is not None:  # the swarm must stop counting on this node (and on its state)
                with contextlib.suppress(Exception):
                    await self.daemon.report_failure(str(e).splitlines()[0] if str(e) else type(e).__name__)
            if isinstance(e, CheckpointDiskFull) and self.trainer is not None:
                # a node that leaves for a full disk is otherwise sound: close its data plane and averager,
                # so its peers' hops to it fail at once (and re-route) instead of running into deadlines
                with contextlib.suppress(Exception):
                    await self.trainer.shutdown()
        finally:
            self.done.set()

    async def _train_on(self, daemon: TrainerHost, epoch, first: bool) -> Optional[int]:
        """Build a trainer on ``epoch`` (joining mid-run if it starts later than 0) and train.

        Returns the iteration at which a newer epoch left this node out, if it should re-join later;
        None when training is over (done, stopped, draining)."""
        from node.train.trainer import TrainerNode

        self.epoch, self.state, self.agreement.waiting = epoch, ServiceState.AGREEING, None
        self.log.info("training pins schedule epoch %d (%d members)", epoch.epoch, len(epoch.members))
        for peer in epoch.members:
            if peer != str(daemon.peer_id) and not await daemon.ensure_connected(peer):
                self.log.warning("cannot connect to schedule member %s yet", peer[-8:])
        join_at = int(epoch.start_iteration) or None
        await follow_stage_move(daemon, self.trainer, epoch)
        past_end = join_at is not None and join_at >= self.iterations
        if past_end or await self.agreement.run_finished():
            # the coordinator plans for membership changes even after the run's last iteration, so a
            # late joiner can be handed an epoch that starts past the end, or at 0 when it coordinates
            # itself: no replica trains any more, and waiting for one (a state to download, a start
            # barrier) would never end
            if past_end:
                await self.agreement.check_joining_config()
            self.state = ServiceState.DONE
            self.log.warning("the run ended at iteration %d before this node could join (epoch %d starts at "
                             "iteration %d): nothing to train", self.iterations - 1, epoch.epoch, join_at or 0)
            return None
        pinned = epoch

        def epoch_source():
            return daemon.current_epoch or pinned

        self.trainer = TrainerNode(
            p2p=daemon.p2p, dht=daemon.dht, peer_id=str(daemon.peer_id), epoch=lambda: pinned, config=self.config,
            node_name=self.node_name, on_iteration=self._on_iteration, emulation=self._emulation(daemon),
            alive=daemon.peer_alive, reaches=daemon.reaches_directly, reachability=reachability_of(daemon), faults=self.faults, on_kill=_kill_own_process_group,
            link_estimate=daemon.link_estimate, allow=StageAccess(daemon), metrics=daemon.metrics,
            join_at=join_at, verify_epoch=daemon.verify_epoch, fetch_epochs=daemon.fetch_epochs,
            relay=relay_of(daemon, StageAccess(daemon)))
        if not first and self._history_before:
            self.trainer.history = list(self._history_before)
        if join_at is not None:
            await self.agreement.check_joining_config()
            self.log.info("joining the run in progress at iteration %d (epoch %d)", join_at, epoch.epoch)
        await self.trainer.setup()
        self.trainer.follow_epochs(epoch_source)  # from now on: follow the daemon's adopted epochs
        if self.start_iteration is None:  # the first training, also after a failed join (JoinFailed)
            self.start_iteration = self.trainer.current_iteration
        if join_at is None:
            await self.agreement.confirm(epoch, self.trainer.current_iteration)
        self.state, self.waiting_reason = ServiceState.TRAINING, None
        self.log.info("training stage %d from iteration %d to %d", self.trainer.stage, self.trainer.current_iteration,
                      self.iterations)
        await run_unless_stale(self.trainer, self.iterations, lambda: daemon.current_epoch, str(daemon.peer_id),
                               norm_record_reader(daemon.dht, self.config.run_id))
        await self.trainer.save_checkpoint()
        self._history_before = list(self.trainer.history)
        if self.trainer.left is not None:
            self.state = ServiceState.LEFT
            self.log.info("training left at iteration %d: %s", self.trainer.committed_iteration, self.trainer.left)
            if not self.trainer.draining and not self.trainer.stop_requested \
                    and self.trainer.current_iteration < self.iterations:
                return self.trainer.current_iteration
            return None
        done = self.trainer.current_iteration >= self.iterations
        self.state = ServiceState.DONE if done else ServiceState.STOPPED
        self.log.info("training %s at iteration %d", self.state.value, self.trainer.committed_iteration)
        if done:
            await self.agreement.say_finished(self.iterations - 1)
        return None

    def _emulation(self, daemon: TrainerHost):
        if self.emulation is None:
            return None
        from node.dataplane.emulation import daemon_peer_locations

        return self.emulation.build(daemon_peer_locations(daemon))

    def progress(self, since: int = -1, limit: int = 100) -> dict:
        """The ``training`` RPC's answer: state, position and the iterations after ``since`` (at most ``limit``)."""
        t = self.trainer
        history = [asdict(s) for s in (t.history if t is not None else []) if s.iteration > since][-limit:]
        state = self.state
        if state is ServiceState.TRAINING and t is not None and t.paused_reason:
            state = ServiceState.PAUSED
        return {
            "peer_id": str(self.daemon.peer_id) if self.daemon is not None else "",
            "node_name": self.node_name,
            "run_id": self.config.run_id,
            # what an exporter needs to rebuild the model from the stages' state (skippipe export --peer)
            "model": self.config.model.to_dict(),
            "data": asdict(self.config.data),
            "state": state.value,
            "error": str(self.error) if self.error is not None else None,
            "paused": t.paused_reason if t is not None else None,
            "left": t.left if t is not None else None,
            "draining": bool(t.draining) if t is not None else False,
            "recovery": ({"reroutes": t.reroutes, "skips": t.skips, "resyncs": t.resyncs,
                          "retried": sum(s.retried for s in t.history), "dropped": sum(s.dropped for s in t.history),
                          # where this data node's microbatch deadlines come from (observed round trips or the cost model)
                          "deadlines": t.recovery.observed.report(),
                          # late microbatches sent again on other replicas: sent, won (the hedge came back first),
                          # discarded (attempts given up because another attempt of the microbatch came back first)
                          "hedges": t.recovery.hedges.report()}
                         if t is not None else None),
            # the epoch training runs on now (it changes at iteration boundaries), else the pinned one
            "epoch": (t.epoch.epoch if t is not None and t.epoch is not None
                      else self.epoch.epoch if self.epoch is not None else None),
            "members": (len(t.members) if t is not None and t.epoch is not None
                        else len(self.epoch.members) if self.epoch is not None else None),
            "pinned_epoch": self.epoch.epoch if self.epoch is not None else None,
            "min_members": self.min_members,
            "stage": t.stage if t is not None and t.runtime is not None else None,
            "is_data_node": bool(t.is_data_node) if t is not None and t.runtime is not None else None,
            "start_iteration": self.start_iteration,
            "committed_iteration": t.committed_iteration if t is not None else None,
            # a joiner: whom its stage state came from, and which replicas backed or disputed it
            "state_source": (t.stage_state.trusted.to_dict()
                             if t is not None and t.stage_state.trusted is not None else None),
            "iterations": self.iterations,
            "overcommits": t.overcommits if t is not None else 0,
            # per-member DHT records this node ignored (forged, unsealed, of a non-member...), by reason
            "rejected_records": (rejected_counts(self.daemon.dht)
                                 if self.daemon is not None and self.daemon.dht is not None else {}),
            # why a join (or the start) cannot proceed yet, while it waits and retries
            "waiting_reason": self.waiting_reason or (self.agreement.waiting if self.agreement is not None else None),
            # a bad member as this node saw it: refused frames by reason, faults counted per member,
            # members banned now, norm reports left out, averaged results refused; and for rehearsals
            # (--inject corrupt@...) how often this node's own rules are still to fire
            "screening": t.screening() if t is not None else None,
            "history": history,
        }

    async def _rpc_training(self, params: dict) -> dict:
        try:
            since = int(params.get("since", -1))
            limit = max(1, int(params.get("limit", 100)))
        except (TypeError, ValueError):
            raise ValueError("since and limit must be integers") from None
        return self.progress(since, limit)

    async def stop(self) -> None:
        """Graceful leave: keep training until an epoch without this node starts (the coordinator
        issues one once our advert says DRAINING), so no in-flight microbatch is lost; after
        ``drain_timeout_s`` finish the current iteration and leave anyway."""
        self._stopping.set()
        running = self._task is not None and not self._task.done()
        if self.trainer is not None and self.state is ServiceState.TRAINING and running:
            self.trainer.drain()
            self.log.info("draining: training on until a schedule epoch without this node starts (at most %.0f s)",
                          self.drain_timeout_s)
            deadline = time.monotonic() + self.drain_timeout_s
            while not self._task.done() and time.monotonic() < deadline:
                reason = drain_pointless(self.daemon, self.trainer)
                if reason:
                    self.log.info("not draining: %s", reason)
                    break
                await asyncio.wait([self._task], timeout=0.5)
            if self._task.done() and self.trainer.left is None:
                self.log.info("draining ended: training reached its last iteration before an epoch "
                              "without this node started")
        if self.trainer is not None:
            self.trainer.request_stop()
        if self._task is not None and not self._task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout=self.stop_grace_s)
            except (asyncio.TimeoutError, Exception):
                self._task.cancel()
                with contextlib.suppress(BaseException):
                    await self._task
        if self.state in (ServiceState.WAITING, ServiceState.AGREEING, ServiceState.TRAINING):
            self.state = ServiceState.STOPPED
        if self.proof is not None:
            await self.proof.stop()
        if self.trainer is not None:
            await self.trainer.shutdown()
