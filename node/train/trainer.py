"""The node side of swarm training: one :class:`TrainerNode` per swarm member.

A trainer needs only a hivemind ``P2P`` (data plane), a hivemind ``DHT`` sharing that p2pd
(averaging, norm exchange), its own peer id and the current :class:`protocol.ScheduleEpoch`;
how processes are started (daemon, local harness, tests) is not its business.

One iteration, as every node sees it:

1. **Microbatches.** A data node (stage 0) starts its microbatches, at most ``memory`` in flight:
   embedding + stage-0 layers, then the activation goes hop by hop along the path the schedule
   gives it (``ActivationMessage``); back at the data node the final norm, LM head and loss run
   there (targets never leave it), and the gradient retraces the path (``GradientMessage``).
   See :mod:`node.train.pipeline`; lost hops and microbatches: :mod:`node.train.recovery`.
2. **Completion.** When all its microbatches are back, a data node sends ``IterationDone`` (with
   how many of its microbatches each peer processed) to every member. A node knows iteration
   ``i`` is over when it has one from every data node of the epoch.
3. **Commit.** Averaging within each stage, the global-norm exchange under the DHT key
   ``<run>:gradnorm:<iteration>``, clipping and exactly one AdamW step (:mod:`node.train.commit`);
   checkpoint every K iterations (:mod:`node.train.state`). Messages of iteration ``i+1`` that
   arrive before the commit are queued, not applied.

Between iterations the trainer switches to a newly due schedule epoch (:mod:`node.train.epochs`)
and pauses while a stage has no live replica. :class:`TrainerNode` composes these parts; the
daemon runs it through :class:`node.train.service.TrainerService`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Callable, List, Optional, Tuple

from node.net.records import finished_key, norm_key, start_key
from node.train.averaging import StageAverager
from node.train.branch_scaling import training_branch_scale
from node.train.build import close_averaging, data_shard, hop_deadlines, microbatch_guard, rebuild_averaging
from node.train.reducer import StageReducers
from node.train.relay_link import state_via
from node.train.common import (IterationState, IterationStats, JoinFailed, LeftSchedule, Lifecycle, NodeKilled,
                               NodeLog, StageMoved, TrainerConfig, TrainingStalled, arrival_time)
from node.train.commit import IterationCommit
from node.train.data import TokenSplits
from node.train.epochs import EpochSource, EpochTracker
from node.train.health import PeerHealth, gone_peers
from node.train.model import build_stage
from node.train.pipeline import MicrobatchPipeline
from node.train.progress import IterationProgress, LifeView, StageResources, begun_elsewhere
from node.train.recovery import RouteRecovery
from node.train.runtime import StageRuntime
from node.train.screening import FrameRejections, screening_summary
from node.train.sender import HopSender
from node.train.state import StageState
from node.train.timing import deadline_links, measure_forward_s
from protocol import HopFailure, HopMessage, IterationDone, NormReport

__all__ = [
    "TrainerConfig",
    "IterationStats",
    "gone_peers",
    "arrival_time",
    "TrainerNode",
    "TrainingStalled",
    "JoinFailed",
    "NodeKilled",
    "LeftSchedule",
    "TrainingDisagreement",
    "training_summary",
    "summary_differences",
    "begun_elsewhere",
    "start_key",
    "finished_key",
    "norm_key",
]

logger = logging.getLogger(__name__)


def dispatch(msg: object, sender: str, run_id: str, me: str, *, progress: IterationProgress, commit: IterationCommit,
             recovery: RouteRecovery, pipeline: MicrobatchPipeline) -> None:
    """The one place a trainer's incoming messages are sorted: each goes to the part that owns it (messages of
    another run are dropped; a hop failure matters to the data node of its microbatch, and one *from* that data
    node says it gave the attempt up, so this node forgets it)."""
    if isinstance(msg, IterationDone):
        if msg.run_id == run_id:
            progress.on_iteration_done(msg)
    elif isinstance(msg, NormReport):  # the per-iteration barrier (node.train.commit)
        commit.on_norm_report(msg, sender)
    elif isinstance(msg, HopFailure):
        if msg.mb.run_id == run_id and msg.mb.data_node == me:
            recovery.on_hop_failure(msg, sender)
        elif msg.mb.run_id == run_id and msg.mb.data_node == sender:
            pipeline.forget(msg.mb)
    elif isinstance(msg, HopMessage) and msg.mb.run_id == run_id:
        pipeline.on_hop(msg)


class TrainerNode:
    """Trains one stage replica (or one data node) of the swarm; see the module docstring."""

    def __init__(self, *, p2p, dht, peer_id: str, epoch: EpochSource, config: TrainerConfig,
                 splits: Optional[TokenSplits] = None, node_name: Optional[str] = None,
                 on_iteration: Optional[Callable[[IterationStats], None]] = None, emulation=None,
                 alive: Optional[Callable[[str], bool]] = None, faults=None,
                 on_kill: Optional[Callable[[], None]] = None, link_estimate=None,
                 allow: Optional[Callable[[str], bool]] = None, metrics=None, join_at: Optional[int] = None,
                 verify_epoch: Optional[Callable[[object], bool]] = None, fetch_epochs=None, reaches=None, relay=None,
                 reachability: Optional[Callable[[str], str]] = None):
        """``alive(peer)``: membership oracle (the daemon's view: advert not expired, not OFFLINE); None =
        every member counts as alive until a send to it fails. ``faults``: optional
        :class:`node.train.faults.FaultInjector`. ``on_kill``: what an injected kill does (default: crash this
        trainer). ``link_estimate(a, b) -> (latency_s, bandwidth_Bps) | None`` feeds the deadlines.
        ``join_at``: join a run in progress at this iteration, downloading the stage's state first.
        ``verify_epoch(epoch)``: signature check of epochs learnt from members' records (None: trust
        members); ``async fetch_epochs()``: the signed epochs stored in the DHT, for a node that fell
        behind an epoch switch. ``metrics``: a :class:`node.train.host.TrainingMetrics`. ``reaches``: see PeerHealth.
        ``reachability(peer)``: a member's advertised one, for reducers (:mod:`node.train.reducer`)."""
        self.p2p, self.dht, self.peer_id = p2p, dht, str(peer_id)
        self.emulation = emulation  # optional node.dataplane.emulation.Emulation (WAN/compute emulation); None = off
        self.cfg = config
        self._splits = splits
        self.node_name = node_name or self.peer_id
        self.log = NodeLog(logger, self.node_name)
        self.on_iteration = on_iteration
        self.faults = faults
        self._on_kill = on_kill
        self._link_estimate = link_estimate
        self._allow, self._relay = allow, relay  # relay: node.dataplane.relay.Relay, or None
        self.metrics = metrics
        self.join_at = join_at
        self.resources = StageResources()
        self.reducers = StageReducers(dht, self.peer_id, config, reachability, self.log)
        self._forward_s = 0.0
        self.paused_reason: Optional[str] = None
        self.lifecycle = Lifecycle.RUNNING
        self._shutdown_started: Optional[float] = None  # monotonic time shutdown() began: resources go once
        self.left: Optional[str] = None
        self.moved: Optional[StageMoved] = None  # set when run() ended because an epoch moves this node's stage
        self.health = PeerHealth(self.peer_id, alive=alive, self_alive=lambda: not self.killed, ban_s=config.ban_s,
                                 ban_max_s=config.ban_max_s, metrics=metrics, node_name=self.node_name, reaches=reaches)
        self.epochs = EpochTracker(self.peer_id, config.run_id, epoch, verify=verify_epoch, fetch=fetch_epochs,
                                   node_name=self.node_name)
        self.progress = IterationProgress(lambda: self.epochs.data_node_peers, self.health.is_alive)
        self.sender = HopSender(self.health, killed=lambda: self.killed)
        self.life = life = LifeView(lambda: self.lifecycle, kill=self.kill)
        # each part gets what it uses; none holds the trainer
        common = dict(peer_id=self.peer_id, node_name=self.node_name, epochs=self.epochs, progress=self.progress)
        self.pipeline = MicrobatchPipeline(
            config, **common, resources=self.resources, sender=self.sender, life=life,
            memory_slots=lambda: self.memory_slots, faults=faults,
            emulated_links=emulation is not None and emulation.link_emulator is not None)
        self.recovery = RouteRecovery(config, **common, health=self.health, resources=self.resources,
                                      sender=self.sender, life=life, pipeline=self.pipeline,
                                      memory_slots=lambda: self.memory_slots, metrics=metrics)
        self.stage_state = StageState(config, **common, health=self.health, resources=self.resources, life=life,
                                      compute=self.pipeline.compute, p2p=p2p, dht=dht, faults=faults)
        self.commit = IterationCommit(config, **common, health=self.health, resources=self.resources,
                                      sender=self.sender, compute=self.pipeline.compute,
                                      expected_state=self.stage_state.expected, p2p=p2p, dht=dht, faults=faults,
                                      emulation=emulation)
        self.stage_state.via = self.commit.via = state_via(relay)  # state from a replica nobody can dial: relayed
        self.pipeline.route_with(self.recovery)
        self.recovery.watch_norms_with(self.commit.maybe_done_from_norms)

    # ------------------------------------------------------------------ what the parts share, as attributes
    @property
    def runtime(self) -> Optional[StageRuntime]:
        return self.resources.runtime

    @runtime.setter
    def runtime(self, runtime: Optional[StageRuntime]) -> None:
        self.resources.runtime = runtime

    @property
    def averager(self) -> Optional[StageAverager]:
        return self.resources.averager

    @property
    def dataplane(self):
        return self.sender.dataplane

    @dataplane.setter
    def dataplane(self, dataplane) -> None:
        self.sender.dataplane = dataplane

    @property
    def current_iteration(self) -> int:
        return self.progress.current

    @current_iteration.setter
    def current_iteration(self, it: int) -> None:
        self.progress.current = it

    @property
    def committed_iteration(self) -> int:
        return self.progress.committed

    @property
    def history(self) -> List[IterationStats]:
        return self.progress.history

    @history.setter
    def history(self, history: List[IterationStats]) -> None:
        self.progress.history = history

    # ------------------------------------------------------------------ views of the parts
    @property
    def epoch(self):
        return self.epochs.epoch

    @property
    def members(self) -> Tuple[str, ...]:
        return self.epochs.members

    @property
    def data_node_peers(self) -> List[str]:
        return self.epochs.data_node_peers

    @property
    def stage(self) -> int:
        return self.epochs.stage

    @property
    def is_data_node(self) -> bool:
        return self.stage == 0

    @property
    def memory_slots(self) -> int:
        return max(1, self.cfg.memory_slots or self.epochs.plan.memory)

    @property
    def killed(self) -> bool:
        return self.lifecycle is Lifecycle.KILLED

    @property
    def closed(self) -> bool:
        """No new work: shut down or killed."""
        return self.lifecycle in (Lifecycle.CLOSED, Lifecycle.KILLED)

    @property
    def draining(self) -> bool:
        return self.lifecycle is Lifecycle.DRAINING

    @property
    def stop_requested(self) -> bool:
        return self.lifecycle in (Lifecycle.STOPPING, Lifecycle.CLOSED)

    @property
    def reroutes(self) -> int:
        return self.recovery.reroutes

    @property
    def skips(self) -> int:
        return self.recovery.skips

    @property
    def resyncs(self) -> int:
        return self.commit.resyncs

    @property
    def overcommits(self) -> int:
        return self.pipeline.overcommits

    # ------------------------------------------------------------------ setup
    def _bind_epoch(self, epoch) -> None:
        self.epochs.bind(epoch)
        if self.runtime is not None:
            self._apply_epoch()

    def _apply_epoch(self) -> None:
        """What the bound epoch decides besides routes: hop deadlines and this stage's training branch scale."""
        links = deadline_links(self.emulation, self._link_estimate, self.peer_id)
        self.resources.deadlines = hop_deadlines(self.cfg, self.epochs, self._forward_s, links)
        self.runtime.branch_scale = training_branch_scale(self.cfg.branch_scaling, self.epochs.plan, self.stage)

    async def setup(self) -> None:
        """Build the stage, restore a checkpoint (or a live replica's state), start averager and data plane.

        Must run on the main thread's event loop (the averager forks and installs signal handlers).
        """
        self._bind_epoch(self.epochs.adopted())
        module = await asyncio.to_thread(build_stage, self.cfg.model, self.stage, self.cfg.seed)  # heartbeats go on
        self.runtime = StageRuntime(module, self.cfg.optim, self.cfg.device,  # optimizer imports: node_cmd did them
                                    padder=self.emulation.padder if self.emulation is not None else None,
                                    precision=self.cfg.precision)  # autocast + fp16 loss scale
        self._forward_s = await self.pipeline.compute(
            lambda: measure_forward_s(self.runtime, self.cfg, self.stage, self.emulation))
        self._apply_epoch()
        have_checkpoint = await asyncio.to_thread(self.stage_state.restore)
        self.progress.current = self.progress.committed + 1
        await self.stage_state.serve(allow=self._allow)
        joining = self.join_at is not None and self.join_at > 0
        if joining:
            # members route our first iteration's microbatches to us as soon as they start it: listen
            # (and queue them) while the state downloads, instead of failing their sends
            self.progress.current = self.join_at
            await self._start_dataplane()
            await self.stage_state.join(self.join_at, have_checkpoint=have_checkpoint)
        await self._make_shard()
        await self._build_averager()
        if not joining:
            await self._start_dataplane()
        self.pipeline.start_worker()

    async def _start_dataplane(self) -> None:
        from node.dataplane.transport import DataPlane

        kwargs = {k: v for k, v in (("allow", self._allow), ("metrics", self.metrics), ("relay", self._relay)) if v is not None}
        kwargs["guard"] = microbatch_guard(self.cfg, self.epochs, self.peer_id, self.progress)
        rejected = FrameRejections(self.cfg, self.peer_id, self.epochs, self.life, self.health, self.resources,
                                   self.sender, self.recovery)
        self.sender.dataplane = DataPlane(self.p2p, self.cfg.run_id, self.on_message,
                                   emulator=self.emulation.link_emulator if self.emulation is not None else None,
                                   wire=self.cfg.wire,  # the run's codec for hop tensors
                                   on_rejected=rejected, **kwargs)
        await self.sender.dataplane.start()

    async def _make_shard(self) -> None:
        self.resources.shard, self._splits = await asyncio.to_thread(data_shard, self.cfg, self.epochs, self._splits)

    async def _build_averager(self) -> None:
        await rebuild_averaging(self.resources, self.reducers, self.dht, self.cfg, self.epochs, self.health.reaches)

    # ------------------------------------------------------------------ epochs and pauses
    def offer_epoch(self, epoch) -> None:
        """Remember an adopted epoch, to be applied at its start iteration."""
        self.epochs.offer(epoch)

    def follow_epochs(self, source: EpochSource) -> None:
        """Take adopted epochs from ``source`` from now on (the host's current epoch)."""
        self.epochs.follow(source)

    async def _maybe_switch_epoch(self) -> None:
        """Apply the newest schedule epoch once its start iteration is reached (a stage move raises StageMoved)."""
        if not self.epochs.switch(self.current_iteration):
            return
        if self.runtime is not None:
            self._apply_epoch()
        await self._make_shard()
        await self._build_averager()
        self.log.info("switched to schedule epoch %d at iteration %d (%d members)", self.epoch.epoch,
                      self.current_iteration, len(self.members))

    def missing_stages(self) -> List[int]:
        """Stages of the current epoch without a live replica (training cannot go on without them)."""
        return [s for s in range(len(self.epochs.plan.stages))
                if not any(self.health.is_alive(p) for p in self.epochs.replicas(s))]

    async def _wait_for_stages(self) -> None:
        """Pause at an iteration boundary while a stage has no live replica; resume on a new epoch."""
        while True:
            await self._maybe_switch_epoch()
            missing, begun = self.missing_stages(), self.progress.begun_elsewhere(self.peer_id)
            if not missing or begun or self.stop_requested or self.closed:
                if self.paused_reason is not None:
                    self.log.info("resuming at iteration %d", self.current_iteration)
                self.paused_reason = None
                return
            reason = f"stage(s) {missing} have no live replica"
            if reason != self.paused_reason:
                self.log.warning("training paused before iteration %d: %s (waiting for a node holding them)",
                                 self.current_iteration, reason)
            self.paused_reason = reason
            await asyncio.sleep(self.cfg.pause_poll_s)

    def switch_iteration(self, lead_s: float = 0.0) -> int:
        """First iteration a newly issued epoch can start at without any member having begun it,
        at least ``lead_s`` seconds of training from now (a joiner's set-up time).

        Members are at most one iteration apart (an iteration commits only after every member
        published its norm), so ``current + 2`` is safe; while paused nobody runs, so ``current``."""
        if self.paused_reason is not None:
            return self.current_iteration
        recent = [s.seconds for s in self.history[-5:]]
        per_it = max(sum(recent) / len(recent), 1e-3) if recent else 1.0
        return self.current_iteration + 2 + (math.ceil(lead_s / per_it) if lead_s > 0 else 0)

    # ------------------------------------------------------------------ messages: dispatched here, and only here
    def on_message(self, msg: object, sender: str) -> None:
        """Data-plane callback: every message a peer sent this node goes to the part that owns it."""
        if not self.killed:
            dispatch(msg, sender, self.cfg.run_id, self.peer_id, progress=self.progress, commit=self.commit,
                     recovery=self.recovery, pipeline=self.pipeline)

    def iteration_state(self, iteration: int) -> IterationState:
        return self.progress.state(iteration)

    def screening(self) -> dict:
        """What the screening checks caught (for the training RPC)."""
        return screening_summary(dataplane=self.dataplane, health=self.health, commit=self.commit, faults=self.faults)

    def _emulation_behind(self) -> Tuple[float, float]:
        """(compute overrun seconds, late-frame seconds) so far; both 0 without emulation."""
        padder = self.runtime.padder if self.runtime is not None else None
        overrun = padder.overrun_s if padder is not None else 0.0
        return float(overrun), float(self.dataplane.late_s if self.dataplane is not None else 0.0)

    # ------------------------------------------------------------------ iteration
    async def run_iteration(self) -> IterationStats:
        """Run and commit iteration ``self.current_iteration``."""
        if self.closed:
            raise RuntimeError("trainer is shut down")
        await self._wait_for_stages()
        progress = self.progress
        it = progress.current
        t0 = time.perf_counter()
        behind0 = self._emulation_behind()
        st = progress.state(it)
        self.commit.prepare_averaging()
        self.pipeline.open, self.pipeline.opened = True, it
        if progress.first < 0:
            progress.first = it
        if self.is_data_node:
            self.recovery.start_microbatches(it, st)
        self.recovery.start_monitor(it)
        self.pipeline.release_early(it)

        try:
            await asyncio.wait_for(st.all_done.wait(), self.cfg.iteration_timeout_s)
        except asyncio.TimeoutError:
            missing = [p[-8:] for p in self.data_node_peers if p not in st.done]
            raise TrainingStalled(f"{self.node_name}: iteration {it} incomplete after "
                                  f"{self.cfg.iteration_timeout_s:.0f}s; no IterationDone from {missing}")
        finally:
            self.pipeline.open = False
            self.recovery.cancel_monitor()
        if self.killed:
            raise NodeKilled(f"{self.node_name} was killed")
        await self.pipeline.idle.wait()  # a job that started before the close finishes before we average
        self.pipeline.clear()
        t_mb = time.perf_counter()
        behind = tuple(b - a for a, b in zip(behind0, self._emulation_behind()))
        stats = await self.commit.commit(it, st, t0, t_mb, behind)
        progress.committed_at(it, stats)
        if self.stage_state.due(it):
            await self.save_checkpoint()
        if self.on_iteration is not None:
            self.on_iteration(stats)
        return stats

    async def run(self, iterations: int) -> List[IterationStats]:
        """Train until ``iterations`` iterations are committed in total (resume counts earlier ones).

        Returns early when stopped, or when a new epoch leaves this node out (``self.left`` is set)."""
        out = []
        self.left = None
        while self.current_iteration < iterations and not self.stop_requested:
            try:
                out.append(await self.run_iteration())
            except LeftSchedule as e:
                self.left, self.moved = str(e), e if isinstance(e, StageMoved) else None
                self.log.info("leaves training: %s", e)
                break
        return out

    def drain(self) -> None:
        """Keep training until an epoch without this node starts (the host announced it is leaving)."""
        if self.lifecycle is Lifecycle.RUNNING:
            self.lifecycle = Lifecycle.DRAINING

    def request_stop(self) -> None:
        """Finish the current iteration, then return from :meth:`run`."""
        if self.lifecycle in (Lifecycle.RUNNING, Lifecycle.DRAINING):
            self.lifecycle = Lifecycle.STOPPING

    # ------------------------------------------------------------------ checkpoints / shutdown
    async def save_checkpoint(self) -> None:
        await self.stage_state.save()

    def kill(self) -> None:
        """Die now, without a word to anyone (fault injection)."""
        self.lifecycle = Lifecycle.KILLED
        if self._on_kill is not None:
            self._on_kill()
        self.pipeline.wakeup.set()
        for st in self.progress.iterations.values():
            st.all_done.set()

    async def shutdown(self) -> None:
        """Clean stop: save the last committed step, close the data plane and the averager."""
        if self._shutdown_started is not None:
            return
        self._shutdown_started = time.monotonic()
        if not self.killed:
            await self.stage_state.save(closing=True)  # a full disk is logged: the rest must still close
            self.lifecycle = Lifecycle.CLOSED
        await self.recovery.stop_monitor()
        await self.pipeline.close()
        await self.sender.close()
        if self.sender.dataplane is not None:
            await self.sender.dataplane.close()
            self.sender.dataplane = None
        await self.stage_state.close()
        await close_averaging(self.resources, self.reducers)
        self.pipeline.stop_compute()


# the agreement's names, re-exported: callers import the trainer's public names from this one module (the
# daemon side, TrainerService, lives in node.train.service, which imports this module)
from node.train.agreement import TrainingDisagreement, summary_differences, training_summary  # noqa: E402
