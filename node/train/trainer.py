"""The node side of swarm training: one :class:`TrainerNode` per swarm member.

A trainer needs only a hivemind ``P2P`` (data plane), a hivemind ``DHT`` sharing that p2pd
(averaging, norm exchange), its own peer id and the current :class:`protocol.ScheduleEpoch`;
how processes are started (daemon, local harness, tests) is not its business.

One iteration, as every node sees it:

1. **Microbatches.** A data node (stage 0) starts its microbatches, at most ``memory`` in flight:
   embedding + stage-0 layers, then the activation goes hop by hop along the path the schedule
   gives it (``ActivationMessage``); back at the data node the final norm, LM head and loss run
   there (targets never leave it), and the gradient retraces the path (``GradientMessage``).
   Every node runs one compute worker that always prefers backward work (gradients, then losses)
   over forwards, and accepts a forward only while it has a free memory slot; autograd state of a
   microbatch is dropped as soon as its backward ran.
2. **Completion.** When all its microbatches are back, a data node sends ``IterationDone`` (with
   how many of its microbatches each peer processed) to every member. A node knows iteration
   ``i`` is over when it has one from every data node of the epoch.
3. **Averaging.** Each replica turns its summed gradient into the mean over the microbatches that
   visited it, and the stage's replicas all-reduce it weighted by those counts (:mod:`averaging`),
   giving the mean over all microbatches that visited the stage.
4. **Global clipping.** Every node publishes its stage's squared gradient norm (plus, from data
   nodes, the loss sums) under the DHT key ``<run>:gradnorm:<iteration>``, subkey = its peer id,
   and waits until every member of the epoch has published; the global norm is the square root
   of the sum over stages (one value per stage: the replica with the smallest peer id, so every
   node computes the same number). All gradients are scaled by ``min(1, clip / norm)``.
5. **Step.** Exactly one AdamW step; the iteration is committed; checkpoint every K iterations.
   Messages of iteration ``i+1`` that arrive before the commit are queued, not applied.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple, Union

import torch

from node.train.averaging import AveragingConfig, StageAverager, averager_prefix, groupmates_went_on
from node.train.checkpoint import CheckpointStore
from node.train.data import DataConfig, DataShard, TokenSplits, load_splits
from node.train.deadlines import DeadlineConfig
from node.errors import UserError
from node.train.model import MODEL_SIZES, ModelConfig, build_stage
from node.train.runtime import OptimConfig, StageRuntime, clip_coefficient
from node.train.precision import loss_scales_agree

__all__ = [
    "TrainerConfig",
    "IterationStats",
    "gone_peers",
    "arrival_time",
    "SchedulePlan",
    "TrainerNode",
    "TrainingStalled",
    "NodeKilled",
    "LeftSchedule",
    "TrainerService",
    "TrainingDisagreement",
    "training_summary",
    "start_key",
    "finished_key",
    "norm_key",
]

logger = logging.getLogger(__name__)

EpochSource = Union["ScheduleEpoch", Callable[[], "ScheduleEpoch"]]  # noqa: F821


class TrainingStalled(RuntimeError):
    """An iteration could not complete in time even with recovery (e.g. a member hangs without dying)."""


class JoinFailed(TrainingStalled):
    """No live replica handed over the stage's state for a mid-run join (and no checkpoint)."""


@dataclass(frozen=True)
class TrainerConfig:
    run_id: str = "skippipe"
    model: ModelConfig = MODEL_SIZES["tiny"]
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()
    averaging: AveragingConfig = AveragingConfig()
    seed: int = 0  # model initialisation; the data seed is ``data.seed``
    device: str = "cpu"
    #: compute precision and wire format (issue: GPU); every member of a run must use the same ones
    precision: str = "fp32"  # fp32 | bf16 | fp16 (node.train.precision)
    wire: str = "fp32"  # fp32 | bf16 | fp16 | int8 (protocol.compression.WIRE_FORMATS)
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 10  # iterations; 0 = only on clean shutdown
    resume: bool = False
    memory_slots: Optional[int] = None  # in-flight microbatches per node; default: the schedule's
    #: a forward blocked by full memory slots this long with nothing else to do is admitted anyway:
    #: reordered paths can form a cycle of full nodes waiting on each other (see docs/training.md)
    memory_deadlock_grace_s: float = 5.0
    iteration_timeout_s: float = 600.0
    norm_exchange_timeout_s: float = 120.0
    #: the norm exchange polls the DHT for the members' records, first after ``norm_poll_s``, then
    #: at intervals doubling up to ``norm_poll_max_s``. Each poll is a ``latest=True`` DHT read that
    #: asks other peers; a fixed 20 ms poll on 9 daemons sharing 2 cores was a load of its own
    norm_poll_s: float = 0.02
    norm_poll_max_s: float = 0.25
    norm_record_ttl_s: float = 300.0
    #: per-hop budgets from the cost model (node.train.deadlines); the data node fails a microbatch past them
    deadlines: DeadlineConfig = DeadlineConfig()
    #: deadlines of a trainer's first iteration are this many times longer: every stream to a
    #: neighbour is opened then and allocators warm up; on a loaded box that took ~3x a steady hop
    first_iteration_deadline_factor: float = 3.0
    #: a microbatch whose forward failed is recomputed on a fresh path at most this often, then dropped
    max_retries: int = 1
    #: stages a path may lose to recovery beyond the schedule's own skips (the paper's omission
    #: results: a skip-trained model tolerates missing stages; 1 keeps paths within one of k)
    max_extra_skips: int = 1
    #: first back-off of a suspected peer (doubles per repeat up to ban_max_s); long enough to outlast
    #: the advert TTL, so a dead peer is out of the view before the ban ends
    ban_s: float = 30.0
    ban_max_s: float = 300.0
    liveness_poll_s: float = 0.25  # how often deadlines and membership are re-checked in an iteration
    #: a data node gives up the microbatches routed through a peer once that peer has been out of the
    #: view this long. On an overloaded host (20 daemons on 2 cores) a live peer's advert can lapse for
    #: a moment; failing its microbatches at once recomputes all of them while the originals still hold
    #: memory slots along their routes (a 20-daemon full-pipeline run lost 190 s that way). A peer that
    #: is really gone was already out of the view for a whole advert TTL; the microbatch deadlines
    #: still catch a hop that never answers.
    left_grace_s: float = 10.0
    #: a microbatch budget is capped at this fraction of ``iteration_timeout_s``: on an overloaded box
    #: the cost-model budget can exceed the iteration timeout, and then a lost microbatch would stop
    #: training (TrainingStalled) instead of being recomputed or dropped
    max_budget_fraction: float = 0.4
    #: an iteration still open after this long logs what it waits for (pending microbatches, queues,
    #: missing IterationDones), then again at this interval: a stall must be diagnosable from the log
    stall_report_s: float = 60.0
    #: how often a node still waiting for a data node's IterationDone looks for that data node's
    #: norm record in the DHT instead (a lost IterationDone must not stall the swarm)
    done_poll_s: float = 1.0
    pause_poll_s: float = 1.0  # how often a paused node re-checks for the missing stage
    state_fetch_timeout_s: float = 180.0  # joiners and re-syncs wait this long for a replica's state
    #: a joiner asks the live replicas this many times before giving up on the epoch (each ask waits
    #: up to the replica's own limit for the iteration before the join to be committed)
    state_fetch_attempts: int = 4
    #: relative checksum difference above which a replica counts as diverged. Not 0: hivemind's
    #: all-reduce applies the mean as local + (mean - local), so replicas of one round can differ in
    #: the last bit. Measured on `skippipe up`: such noise stays below 5e-7 on checksums of ~130, a
    #: failed round leaves ~0.07. At 1e-9 the noise alone forced a state download every iteration.
    resync_tolerance: float = 1e-6


@dataclass
class IterationStats:
    iteration: int
    epoch: int
    loss: float  # mean over all microbatches of all data nodes
    microbatches: int
    tokens: int
    seconds: float  # this node's wall time for the iteration, step included
    grad_norm: float  # global, before clipping
    clip_coef: float
    active_nodes: int  # members that published their norm this iteration
    local_visits: int
    averaged: Optional[bool]  # None: nothing to average (single replica or no visits)
    microbatch_s: float = 0.0  # until IterationDone from every data node
    averaging_s: float = 0.0
    norm_exchange_s: float = 0.0
    step_s: float = 0.0
    dropped: int = 0  # microbatches given up this iteration (all data nodes)
    retried: int = 0  # recomputations on a fresh path (this data node)
    resynced: bool = False  # this replica copied its state from the canonical replica instead of stepping
    # emulation only (0 otherwise): how far this node's real work fell behind the emulated timeline in the
    # microbatch phase (compute steps past their target; stamped frames received after their delivery time)
    compute_overrun_s: float = 0.0
    late_frames_s: float = 0.0


class SchedulePlan:
    """Reading of the scheduler's JSON (docs/CONTRACTS.md) for the trainer."""

    def __init__(self, schedule: dict):
        try:
            self.stages: List[List[int]] = [list(map(int, s)) for s in schedule["stages"]]
            self.memory: int = int(schedule.get("memory", 1))
            self.path_length: int = int(schedule.get("path_length", len(self.stages)))
            self.paths: List[dict] = list(schedule.get("paths", []))
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"malformed schedule: {e!r}")
        self.stage_of: Dict[int, int] = {}
        for s, nodes in enumerate(self.stages):
            for n in nodes:
                if n in self.stage_of:
                    raise UserError(f"schedule node {n} is in stages {self.stage_of[n]} and {s}")
                self.stage_of[n] = s
        self.data_nodes: List[int] = list(self.stages[0])
        for p in self.paths:
            route = [int(n) for n in p["route"]]
            if not route or route[0] != int(p["data_node"]) or route[0] not in self.data_nodes:
                raise UserError(f"schedule path {p} does not start at its data node")
            if any(n not in self.stage_of for n in route) or any(self.stage_of[n] == 0 for n in route[1:]):
                raise UserError(f"schedule path {p} visits an unknown node or stage 0 twice")
            if len({self.stage_of[n] for n in route}) != len(route):
                raise UserError(f"schedule path {p} visits a stage more than once")

    def routes_for(self, data_node: int) -> List[List[int]]:
        """One node-index route per microbatch of ``data_node``, in microbatch-index order."""
        out: List[List[int]] = []
        for p in self.paths:
            if int(p["data_node"]) == data_node:
                out.extend([[int(n) for n in p["route"]]] * int(p.get("microbatches", 1)))
        return out

    def replicas(self, stage: int) -> List[int]:
        return self.stages[stage]


def norm_key(run_id: str, iteration: int) -> str:
    """DHT key under which every member publishes its gradient norm for ``iteration``."""
    return f"{run_id}:gradnorm:{iteration}"


MbKey = Tuple[str, int, int, int, int]  # (data node peer id, epoch, iteration, index, attempt)


class NodeKilled(RuntimeError):
    """This trainer was killed by fault injection (in-process harness stand-in for a dead machine)."""


class LeftSchedule(RuntimeError):
    """The epoch that starts now no longer includes this node (it drained or was dropped)."""


@dataclass
class _Pending:
    """A data node's own microbatch in flight: which attempt, on which route, until when."""

    index: int
    attempt: int
    route: Tuple[str, ...]
    deadline: float
    loss_done: bool = False
    started: float = 0.0  # monotonic time of the attempt's first forward


@dataclass(frozen=True)
class _DoneFromNorm:
    """Stand-in for an ``IterationDone`` learnt from a data node's norm record."""

    dropped: int = 0


@dataclass
class _IterationState:
    done: Dict[str, object] = field(default_factory=dict)  # data node peer id -> IterationDone
    all_done: asyncio.Event = field(default_factory=asyncio.Event)
    # data-node side
    remaining: int = 0
    losses: List[float] = field(default_factory=list)
    visits: Dict[str, int] = field(default_factory=collections.Counter)
    tokens: int = 0
    dropped: int = 0
    retried: int = 0


class TrainerNode:
    """Trains one stage replica (or one data node) of the swarm; see the module docstring."""

    def __init__(self, *, p2p, dht, peer_id: str, epoch: EpochSource, config: TrainerConfig,
                 splits: Optional[TokenSplits] = None, node_name: Optional[str] = None,
                 on_iteration: Optional[Callable[[IterationStats], None]] = None, emulation=None,
                 alive: Optional[Callable[[str], bool]] = None, faults=None,
                 on_kill: Optional[Callable[[], None]] = None, link_estimate=None,
                 allow: Optional[Callable[[str], bool]] = None, metrics=None, join_at: Optional[int] = None,
                 verify_epoch: Optional[Callable[[object], bool]] = None, fetch_epochs=None):
        """``alive(peer)``: membership oracle (the daemon's view: advert not expired, not OFFLINE); None =
        every member counts as alive until a send to it fails. ``faults``: optional
        :class:`node.testing.faults.FaultInjector`. ``on_kill``: what an injected kill does (default: crash this
        trainer). ``link_estimate(a, b) -> (latency_s, bandwidth_Bps) | None`` feeds the deadlines.
        ``join_at``: join a run in progress at this iteration, downloading the stage's state first.
        ``verify_epoch(epoch)``: signature check of epochs learnt from members' records (None: trust
        members); ``async fetch_epochs()``: the signed epochs stored in the DHT, for a node that fell
        behind an epoch switch."""
        self.p2p, self.dht, self.peer_id = p2p, dht, str(peer_id)
        self.emulation = emulation  # optional node.dataplane.emulation.Emulation (WAN/compute emulation); None = off
        self._epoch_source = epoch
        self.cfg = config
        self._splits = splits
        self.node_name = node_name or self.peer_id
        self.on_iteration = on_iteration
        self._alive = alive
        self.faults = faults
        self._on_kill = on_kill
        self._link_estimate = link_estimate
        self._allow = allow
        self.metrics = metrics
        self.join_at = join_at
        self._verify_epoch = verify_epoch
        self._fetch_epochs = fetch_epochs
        self.runtime: Optional[StageRuntime] = None
        self.averager: Optional[StageAverager] = None
        self.dataplane = None
        self.state_server = None
        self.deadlines = None
        self.shard: Optional[DataShard] = None
        self.checkpoints: Optional[CheckpointStore] = None
        self.history: List[IterationStats] = []
        self.committed_iteration = -1
        self.current_iteration = -1
        self._state_iteration = -1  # iteration the runtime's weights belong to (set on the compute thread)
        self._last_saved = -1
        self._iters: Dict[int, _IterationState] = {}
        self._early: Dict[int, List[object]] = collections.defaultdict(list)
        self._grads: Deque[object] = collections.deque()
        self._returns: Deque[object] = collections.deque()
        self._forwards: Deque[object] = collections.deque()
        self._starts: Deque[Tuple[int, int, Tuple[str, ...]]] = collections.deque()
        # compute emulation: when each queued job could have started (monotonic; keyed by id of the
        # queued object), when the compute thread last finished, and the ready time of the running job
        self._ready_at: Dict[int, float] = {}
        self._free_since = 0.0
        self._job_ready_at: Optional[float] = None
        self._targets: Dict[MbKey, torch.Tensor] = {}
        self._pending: Dict[int, _Pending] = {}  # data node: microbatch index -> its live attempt
        self._offered: Dict[int, object] = {}  # epoch number -> adopted epoch not applied yet
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._open = False  # the current iteration accepts microbatch work
        self._opened = -1  # the last iteration that was opened (its later messages are late, not early)
        self._first_iteration = -1  # the first iteration this trainer ran
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="skippipe-compute")
        self._worker_task: Optional[asyncio.Task] = None
        self._monitor_task: Optional[asyncio.Task] = None
        self._send_tasks: set = set()
        self._suspects: Dict[str, Tuple[float, float]] = {}  # peer -> (banned until, current back-off)
        self._absent_since: Dict[str, float] = {}  # peer -> when this node first saw it out of the view
        self.overcommits = 0  # forwards admitted beyond the memory slots to break a cyclic wait
        self.reroutes = 0
        self.skips = 0
        self.resyncs = 0
        self.paused_reason: Optional[str] = None
        self.draining = False  # leave at the next epoch that excludes this node (SIGTERM)
        self._stop_requested = False
        self._closed = False
        self._shut = False
        self.killed = False
        self.left: Optional[str] = None

    # ------------------------------------------------------------------ liveness
    def is_alive(self, peer: str) -> bool:
        if peer == self.peer_id:
            return not self.killed
        return self._alive(peer) if self._alive is not None else True

    def suspected(self, peer: str) -> bool:
        entry = self._suspects.get(peer)
        return entry is not None and entry[0] > time.monotonic()

    def usable(self, peer: str) -> bool:
        return peer == self.peer_id or (self.is_alive(peer) and not self.suspected(peer))

    def suspect(self, peer: str, why: str) -> None:
        """Ban ``peer`` from new routes for a back-off that doubles on each repeat (capped)."""
        if peer == self.peer_id:
            return
        _, backoff = self._suspects.get(peer, (0.0, self.cfg.ban_s / 2))
        backoff = min(self.cfg.ban_max_s, backoff * 2)
        self._suspects[peer] = (time.monotonic() + backoff, backoff)
        logger.warning("%s: suspecting %s for %.0fs: %s", self.node_name, peer[-8:], backoff, why)
        if self.metrics is not None and hasattr(self.metrics, "count_failure"):
            with contextlib.suppress(Exception):
                self.metrics.count_failure("suspect")

    # ------------------------------------------------------------------ epoch / setup
    def _current_epoch(self):
        return self._epoch_source() if callable(self._epoch_source) else self._epoch_source

    def _bind_epoch(self, epoch) -> None:
        self.epoch = epoch
        self.plan = SchedulePlan(epoch.schedule)
        self.members: Tuple[str, ...] = tuple(epoch.members)
        if self.peer_id not in self.members:
            raise UserError(f"peer {self.peer_id} is not a member of schedule epoch {epoch.epoch}")
        self.index = self.members.index(self.peer_id)
        if self.index not in self.plan.stage_of:
            raise UserError(f"node index {self.index} holds no stage in schedule epoch {epoch.epoch}")
        self.data_node_peers = [self.members[n] for n in self.plan.data_nodes]
        self.memory_slots = max(1, self.cfg.memory_slots or self.plan.memory)
        if self.runtime is not None:
            self._build_deadlines()

    def _build_deadlines(self) -> None:
        from node.train.deadlines import HopDeadlines

        m = self.cfg.model
        act_bytes = 4 * self.cfg.data.microbatch_size * self.cfg.data.seq_len * m.d_model
        self.deadlines = HopDeadlines(self.epoch.schedule, self.members, [self._forward_s] * len(self.members),
                                      act_bytes, self._deadline_links(), self.cfg.deadlines)

    def _deadline_links(self):
        """Link estimates for the deadlines: the emulated links when links are emulated (the measured
        ones run over loopback and know nothing of the WAN the microbatches really cross), else measured."""
        between = getattr(self.emulation, "link_between", None)
        if between is None:
            return self._link_estimate
        measured = self._link_estimate

        def estimate(a: str, b: str):
            spec = between(a, b, self.peer_id)
            if spec is not None:
                return spec.latency_s, spec.bandwidth_Bps
            return measured(a, b) if measured is not None else None

        return estimate

    def _measure_forward_s(self) -> float:
        """Seconds of one microbatch forward through this stage (padded when compute is emulated)."""
        padder = getattr(self.emulation, "padder", None)
        if padder is not None:
            return padder.target_s("forward", self.cfg.data.microbatch_size, self.runtime.n_layers)
        m, d = self.cfg.model, self.cfg.data
        device = self.runtime.device
        x = torch.randn(d.microbatch_size, d.seq_len, m.d_model, device=device)
        times = []
        with torch.no_grad():
            for _ in range(3):
                t0 = time.perf_counter()
                if self.stage == 0:
                    self.runtime.module.head_loss(
                        x, torch.zeros(d.microbatch_size, d.seq_len, dtype=torch.long, device=device))
                else:
                    self.runtime.module(x)
                times.append(time.perf_counter() - t0)
        return sorted(times)[1]

    @property
    def stage(self) -> int:
        return self.plan.stage_of[self.index]

    @property
    def is_data_node(self) -> bool:
        return self.stage == 0

    async def setup(self) -> None:
        """Build the stage, restore a checkpoint (or a live replica's state), start averager and data plane.

        Must run on the main thread's event loop (the averager forks and installs signal handlers).
        """
        from node.dataplane.state_transfer import StateServer

        self._bind_epoch(self._current_epoch())
        module = build_stage(self.cfg.model, self.stage, self.cfg.seed)
        self.runtime = StageRuntime(module, self.cfg.optim, self.cfg.device,
                                    padder=getattr(self.emulation, "padder", None),
                                    precision=self.cfg.precision)  # precision: autocast + fp16 loss scale
        self._forward_s = await self._compute(self._measure_forward_s)
        self._build_deadlines()
        ckpt = None
        if self.cfg.checkpoint_dir:
            self.checkpoints = CheckpointStore(self.cfg.checkpoint_dir, self.cfg.run_id, self.stage, self.node_name)
            if self.cfg.resume:
                ckpt = self.checkpoints.load()
                if ckpt is not None:
                    self.runtime.load_state_dict(ckpt.state)
                    self.committed_iteration = self._last_saved = self._state_iteration = ckpt.iteration
                    logger.info("%s resumed stage %d at iteration %d", self.node_name, self.stage, ckpt.iteration)
        self.current_iteration = self.committed_iteration + 1
        self.state_server = StateServer(self.p2p, self.cfg.run_id, self._snapshot, allow=self._allow)
        await self.state_server.start()
        joining = self.join_at is not None and self.join_at > 0
        if joining:
            # members route our first iteration's microbatches to us as soon as they start it: listen
            # (and queue them) while the state downloads, instead of failing their sends
            self.current_iteration = self.join_at
            await self._start_dataplane()
            await self._join_state(self.join_at, have_checkpoint=ckpt is not None)
        self._make_shard()
        await self._build_averager()
        if not joining:
            await self._start_dataplane()
        self._worker_task = asyncio.create_task(self._worker(), name=f"trainer-worker-{self.node_name}")

    async def _start_dataplane(self) -> None:
        from node.dataplane.transport import DataPlane

        kwargs = {}
        if self._allow is not None:
            kwargs["allow"] = self._allow
        if self.metrics is not None:
            kwargs["metrics"] = self.metrics
        guard = self._make_guard()
        if guard is not None:
            kwargs["guard"] = guard
        self.dataplane = DataPlane(self.p2p, self.cfg.run_id, self._on_message,
                                   emulator=getattr(self.emulation, "link_emulator", None),
                                   wire=self.cfg.wire, **kwargs)  # wire: the run's codec for hop tensors
        await self.dataplane.start()

    def _make_guard(self):
        """Reject malformed, non-finite, replayed or out-of-epoch frames before they reach the worker."""
        try:
            from node.dataplane.guard import MicrobatchGuard
        except ImportError:
            return None
        d, m = self.cfg.data, self.cfg.model

        def position():
            # newer epochs pass: a neighbour may switch at an iteration boundary before we do
            return self.epoch.epoch, self.current_iteration

        try:
            def members():
                # senders of the current epoch and of announced ones (valid at a switch boundary)
                return set(self.members).union(*(e.members for e in self._offered.values()))

            from node.dataplane.guard import compressions_for_wire

            return MicrobatchGuard(run_id=self.cfg.run_id, hidden_shape=(d.microbatch_size, d.seq_len, m.d_model),
                                   position=position, self_id=self.peer_id, members=members,
                                   compressions=compressions_for_wire(self.cfg.wire))  # the run's wire codec only
        except TypeError:
            logger.debug("MicrobatchGuard has another signature; data plane runs unguarded")
            return None

    def _make_shard(self) -> None:
        if self.is_data_node:
            splits = self._splits if self._splits is not None else load_splits(self.cfg.data)
            self._splits = splits
            if splits.vocab_size > self.cfg.model.vocab_size:
                raise UserError(f"tokenizer vocab {splits.vocab_size} exceeds model vocab {self.cfg.model.vocab_size}")
            self.shard = DataShard(splits, self.cfg.data, self.plan.data_nodes.index(self.index),
                                   len(self.plan.data_nodes))

    async def _join_state(self, start: int, have_checkpoint: bool) -> None:
        """Mid-run join: take the stage's weights and optimizer state from a live replica (committed
        iteration ``start - 1``), else from our own checkpoint; never silently from scratch."""
        from node.dataplane.state_transfer import StateTransferError, fetch_state

        # live replicas first, but ask the others too: under load a live peer's advert can lapse for
        # a moment, and a dead one only costs a failed dial
        peers = sorted((self.members[n] for n in self.plan.replicas(self.stage) if self.members[n] != self.peer_id),
                       key=lambda p: not self.is_alive(p))
        snap, error = None, None
        for attempt in range(1, self.cfg.state_fetch_attempts + 1):
            try:
                peer, snap = await fetch_state(self.p2p, self.cfg.run_id, peers, self.stage, start - 1,
                                               timeout_s=self.cfg.state_fetch_timeout_s)
                break
            except StateTransferError as e:
                error = e
                # a live replica that is merely slow to commit ``start - 1`` (the swarm is busy with
                # another failure) hands the state over later: ask again, a bounded number of times
                if not any(self.is_alive(p) for p in peers) or attempt == self.cfg.state_fetch_attempts:
                    break
                logger.warning("%s: no state for stage %d yet (%s); asking again", self.node_name, self.stage, e)
                await asyncio.sleep(1.0)
        if snap is None:
            e = error
            if not have_checkpoint:
                raise JoinFailed(f"{self.node_name}: cannot join stage {self.stage} at iteration {start}: {e}; "
                                      "no checkpoint either (--checkpoint-dir DIR --resume)") from None
            logger.warning("%s: %s; continuing from the checkpoint of iteration %d", self.node_name, e,
                           self.committed_iteration)
            self.committed_iteration = self._state_iteration = start - 1
            self.current_iteration = start
            return
        state = await self._compute(snap.state_dict)
        await self._compute(lambda: self.runtime.load_state_dict(state))
        self.committed_iteration = self._state_iteration = snap.iteration
        self.current_iteration = snap.iteration + 1
        logger.info("%s joined stage %d with the state of iteration %d from %s", self.node_name, self.stage,
                    snap.iteration, peer[-8:])

    async def _snapshot(self, stage: int, min_iteration: int):
        """State server callback: this stage's state once iteration ``min_iteration`` is committed."""
        import io

        from node.dataplane.state_transfer import StateSnapshot

        if self.runtime is None or stage != self.stage:
            raise ValueError(f"stage {stage} is not held here")
        while self._state_iteration < min_iteration:
            if self._closed:
                raise ValueError("trainer is shutting down")
            await asyncio.sleep(0.05)

        def snap():
            buf = io.BytesIO()
            torch.save(self.runtime.state_dict(), buf)
            return StateSnapshot(self.stage, self._state_iteration, self.runtime.checksum(), buf.getvalue())

        return await self._compute(snap)

    async def _build_averager(self) -> None:
        if self.averager is not None:
            averager, self.averager = self.averager, None
            await asyncio.get_running_loop().run_in_executor(None, averager.shutdown)
        group = self.plan.replicas(self.stage)
        if len(group) > 1:
            assert self.runtime is not None
            self.averager = StageAverager(
                self.dht, self.runtime.grads(), prefix=averager_prefix(self.cfg.run_id, self.stage, self.epoch.epoch),
                group_size=len(group), cfg=self.cfg.averaging)
            await self.averager.start()

    def offer_epoch(self, epoch) -> None:
        """Remember an adopted epoch: a newer one may arrive before this one's start iteration, and
        every member must still switch to this one at its boundary."""
        if epoch is not None and epoch.run_id == self.cfg.run_id:
            self._offered[int(epoch.epoch)] = epoch

    def _due_epoch(self):
        """The newest known epoch whose start iteration has been reached, if newer than ours."""
        self.offer_epoch(self._current_epoch())
        due = [e for n, e in self._offered.items() if n > self.epoch.epoch
               and int(getattr(e, "start_iteration", 0)) <= self.current_iteration]
        for n in [n for n in self._offered if n <= self.epoch.epoch]:
            del self._offered[n]
        return max(due, key=lambda e: e.epoch) if due else None

    async def _maybe_switch_epoch(self) -> None:
        """Apply the newest schedule epoch once its start iteration is reached (same stage only)."""
        epoch = self._due_epoch()
        if epoch is None:
            return  # nothing new, or announced for a later boundary: every member switches there
        if self.peer_id not in epoch.members:
            raise LeftSchedule(f"schedule epoch {epoch.epoch} (from iteration {self.current_iteration}) "
                               "does not include this node")
        old_stage = self.stage
        old = self.epoch
        self._bind_epoch(epoch)
        if self.stage != old_stage:
            self._bind_epoch(old)
            raise UserError(f"epoch {epoch.epoch} moves this node from stage {old_stage} to "
                            f"{SchedulePlan(epoch.schedule).stage_of.get(epoch.members.index(self.peer_id))}; "
                            "changing stage needs a state transfer (not supported yet)")
        self._make_shard()
        await self._build_averager()
        logger.info("%s switched to schedule epoch %d at iteration %d (%d members)", self.node_name, epoch.epoch,
                    self.current_iteration, len(self.members))

    def missing_stages(self) -> List[int]:
        """Stages of the current epoch without a live replica (training cannot go on without them)."""
        return [s for s in range(len(self.plan.stages))
                if not any(self.is_alive(self.members[n]) for n in self.plan.replicas(s))]

    async def _wait_for_stages(self) -> None:
        """Pause at an iteration boundary while a stage has no live replica; resume on a new epoch."""
        while True:
            await self._maybe_switch_epoch()
            missing = self.missing_stages()
            if not missing or self._stop_requested or self._closed:
                if self.paused_reason is not None:
                    logger.info("%s: resuming at iteration %d", self.node_name, self.current_iteration)
                self.paused_reason = None
                return
            reason = f"stage(s) {missing} have no live replica"
            if reason != self.paused_reason:
                logger.warning("%s: training paused before iteration %d: %s (waiting for a node holding them)",
                               self.node_name, self.current_iteration, reason)
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

    # ------------------------------------------------------------------ messages
    def _state(self, iteration: int) -> _IterationState:
        if iteration not in self._iters:
            self._iters[iteration] = _IterationState()
        return self._iters[iteration]

    def _on_message(self, msg: object, sender: str) -> None:
        from protocol import ActivationMessage, GradientMessage, HopFailure, IterationDone

        if self.killed:
            return
        if isinstance(msg, IterationDone):
            if msg.run_id != self.cfg.run_id or msg.iteration <= self.committed_iteration:
                return
            st = self._state(msg.iteration)
            st.done[msg.data_node] = msg
            self._check_done(st)
            return
        if isinstance(msg, HopFailure):
            if msg.mb.run_id == self.cfg.run_id and msg.mb.data_node == self.peer_id:
                self._on_hop_failure(msg, sender)
            return
        if not isinstance(msg, (ActivationMessage, GradientMessage)) or msg.mb.run_id != self.cfg.run_id:
            return
        arrived = arrival_time(time.monotonic(), time.time(), msg.deliver_at_unix,
                               getattr(self.emulation, "link_emulator", None) is not None)
        if msg.route[msg.hop] != self.peer_id:
            logger.warning("%s: misrouted %s for %s", self.node_name, type(msg).__name__, msg.route[msg.hop][-8:])
            return
        it = msg.mb.iteration
        if it > self.current_iteration or (it == self.current_iteration and it > self._opened):
            # never apply iteration i+1 before step i is committed; and between the commit and the
            # start of the next iteration (an epoch switch, a pause) its messages wait here too
            self._early[it].append(msg)
            return
        if it < self.current_iteration or not self._open:
            logger.debug("%s: dropping late %s of iteration %d", self.node_name, type(msg).__name__, it)
            return
        self._enqueue(msg, arrived)

    def _check_done(self, st: _IterationState) -> None:
        """Iteration over: every data node of the epoch reported, or is gone."""
        if all(p in st.done or not self.is_alive(p) for p in self.data_node_peers):
            st.all_done.set()

    def _enqueue(self, msg: object, arrived: Optional[float] = None) -> None:
        """Queue a hop message for the compute worker; ``arrived`` (monotonic, default now) is when
        its work could have started at the earliest (compute emulation counts from then)."""
        from protocol import GradientMessage

        if msg.mb.epoch != self.epoch.epoch:
            logger.warning("%s: dropping %s of epoch %d during epoch %d", self.node_name, type(msg).__name__,
                           msg.mb.epoch, self.epoch.epoch)
            return
        self._ready_at[id(msg)] = time.monotonic() if arrived is None else arrived
        if isinstance(msg, GradientMessage):
            self._grads.append(msg)
        elif msg.hop == len(msg.route) - 1:  # activation back at its data node: loss
            self._returns.append(msg)
        else:
            self._forwards.append(msg)
        self._wakeup.set()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._send_tasks.add(task)
        task.add_done_callback(self._send_tasks.discard)

    async def _try_send(self, peer: str, msg: object) -> bool:
        from node.dataplane.transport import DataPlaneError

        if self.killed:
            return False
        try:
            await self.dataplane.send(peer, msg)
            return True
        except DataPlaneError as e:
            self.suspect(peer, f"send failed: {e}")
            return False
        except Exception as e:  # noqa: BLE001 - a broken peer must never break this node
            self.suspect(peer, f"send failed: {e!r}")
            return False

    def _send_control(self, peer: str, msg: object) -> None:
        self._spawn(self._try_send(peer, msg))

    # --------------------------------------------------------------- routing and recovery
    def _min_path_stages(self) -> int:
        return max(1, self.plan.path_length - self.cfg.max_extra_skips)

    def _alternative(self, route: Tuple[str, ...], hop: int, avoid: set) -> Optional[str]:
        """Another usable replica of the stage of ``route[hop]``, not already on the route."""
        try:
            stage = self.plan.stage_of[self.members.index(route[hop])]
        except ValueError:
            return None
        on_route = set(route)
        options = [self.members[n] for n in self.plan.replicas(stage)]
        options = [p for p in options if p not in avoid and p not in on_route and self.usable(p)]
        if not options:
            return None
        # deterministic spread: the replica whose id hashes nearest to this microbatch
        return min(options, key=lambda p: (hash((p, route)) & 0xFFFF, p))

    async def _send_forward(self, msg) -> None:
        """Send an activation to ``msg.route[msg.hop]``; on a dead hop re-route to another replica of
        that stage, else skip the stage if the path's skip budget allows, else tell the data node."""
        from protocol import ActivationMessage, HopFailure

        route, hop, failed = tuple(msg.route), msg.hop, set()
        while True:
            target = route[hop]
            if target == self.peer_id or (self.usable(target) and target not in failed):
                if await self._try_send(target, ActivationMessage(msg.mb, hop, route, msg.tensor)):
                    return
            failed.add(target)
            if target == route[-1]:
                break  # the data node itself is gone: nobody is left to tell
            alt = self._alternative(route, hop, failed)
            if alt is not None:
                logger.warning("%s: re-routing %s hop %d from %s to %s", self.node_name, _mb_name(msg.mb), hop,
                               target[-8:], alt[-8:])
                route = route[:hop] + (alt,) + route[hop + 1:]
                self.reroutes += 1
                self._count("reroute")
                continue
            if len(route) - 2 >= self._min_path_stages() and hop < len(route) - 1:
                logger.warning("%s: skipping stage of %s for %s (no live replica)", self.node_name, target[-8:],
                               _mb_name(msg.mb))
                route = route[:hop] + route[hop + 1:]
                self.skips += 1
                self._count("skip")
                continue
            break
        report = HopFailure(msg.mb, hop, route[hop], "forward: no live replica and no skip budget")
        if msg.mb.data_node == self.peer_id:
            self._on_hop_failure(report)
        else:
            self._send_control(msg.mb.data_node, report)
        self.runtime.drop(self._key(msg.mb))

    async def _send_backward(self, msg) -> None:
        """Gradients cannot be re-routed (the autograd state lives on that node): report and drop."""
        from protocol import HopFailure

        target = msg.route[msg.hop]
        if await self._try_send(target, msg):
            return
        if target != msg.mb.data_node:
            self._send_control(msg.mb.data_node, HopFailure(msg.mb, msg.hop, target, "backward: peer unreachable"))

    def _count(self, what: str) -> None:
        if self.metrics is not None and what == "reroute" and hasattr(self.metrics, "count_reroute"):
            with contextlib.suppress(Exception):
                self.metrics.count_reroute()

    def _on_hop_failure(self, msg, sender: Optional[str] = None) -> None:
        """Data node: a hop of one of our microbatches failed (reported by a node of its route)."""
        p = self._pending.get(msg.mb.index)
        if p is None or p.attempt != msg.mb.attempt or msg.mb.iteration != self.current_iteration:
            return
        if sender is not None and sender != self.peer_id and not self._could_be_on_route(sender, p.route):
            logger.warning("%s: ignoring a hop failure about %s from %s, which is not on that route", self.node_name,
                           _mb_name(msg.mb), sender[-8:])
            return
        if msg.peer_id != self.peer_id:
            self.suspect(msg.peer_id, f"hop {msg.hop} of {_mb_name(msg.mb)}: {msg.reason}")
        self._fail_microbatch(p, f"hop failure at hop {msg.hop}: {msg.reason}")

    def _could_be_on_route(self, peer: str, route) -> bool:
        """``peer`` is on ``route`` or a replica of one of its stages (re-routing may have put it there)."""
        if peer in route:
            return True
        stage_of = self.plan.stage_of
        index = {p: i for i, p in enumerate(self.members)}
        if peer not in index:
            return False
        stages = {stage_of.get(index[r]) for r in route if r in index}
        return stage_of.get(index[peer]) in stages

    def _fail_microbatch(self, p: _Pending, why: str) -> None:
        """Retry a microbatch whose forward failed on a fresh path, or drop it (never hang)."""
        it = self.current_iteration
        st = self._state(it)
        old_key = (self.peer_id, self.epoch.epoch, it, p.index, p.attempt)
        self.runtime.drop(old_key)
        self._targets.pop(old_key, None)
        if not p.loss_done and p.attempt < self.cfg.max_retries:
            route = self._fresh_route(p.index)
            if route is not None:
                logger.warning("%s: microbatch %d of iteration %d failed (%s); recomputing as attempt %d on %s",
                               self.node_name, p.index, it, why, p.attempt + 1, [r[-6:] for r in route])
                self._pending.pop(p.index, None)
                st.retried += 1
                self._starts.append((p.index, p.attempt + 1, route))
                self._wakeup.set()
                return
        logger.warning("%s: dropping microbatch %d of iteration %d (%s); the step is re-weighted over the "
                       "microbatches that completed", self.node_name, p.index, it, why)
        self._pending.pop(p.index, None)
        self._targets.pop(old_key, None)
        st.dropped += 1
        self._count("drop")
        self._microbatch_finished(st)

    def _fresh_route(self, index: int) -> Optional[Tuple[str, ...]]:
        """The planned route of microbatch ``index`` with dead or suspected nodes replaced by live
        replicas of their stages (or skipped within the skip budget); None if impossible."""
        planned = [self.members[n] for n in self._routes[index]]
        route: List[str] = [self.peer_id]
        for peer in planned[1:]:
            if self.usable(peer) and peer not in route:
                route.append(peer)
                continue
            alt = self._alternative(tuple(route + [peer]), len(route), set())
            if alt is not None and alt not in route:
                route.append(alt)
        if len(route) < self._min_path_stages():
            return None
        return tuple(route) + (self.peer_id,)

    def _microbatch_finished(self, st: _IterationState) -> None:
        from protocol import IterationDone

        st.remaining -= 1
        self._wakeup.set()
        if st.remaining == 0:
            done = IterationDone(self.cfg.run_id, self.epoch.epoch, self.current_iteration, self.peer_id,
                                 dict(st.visits), st.dropped)
            for peer in self.members:
                if self.is_alive(peer):
                    self._send_control(peer, done)

    async def _monitor(self, it: int) -> None:
        """Until iteration ``it`` closes: a data node fails its microbatches past their deadline or
        routed through a node that is gone; every node notices data nodes that are gone or done
        (their norm records); an iteration open for long logs what it waits for."""
        last_poll = time.monotonic()
        next_report = last_poll + self.cfg.stall_report_s
        while self._open and self.current_iteration == it and not self._closed:
            now = time.monotonic()
            try:
                if self.is_data_node:
                    gone = gone_peers({r for p in self._pending.values() for r in p.route}, self.is_alive,
                                      self._absent_since, now, self.cfg.left_grace_s)
                    for p in list(self._pending.values()):
                        dead = [r for r in p.route if r in gone]
                        if dead:
                            self._fail_microbatch(p, f"{dead[0][-8:]} left the swarm")
                        elif now > p.deadline:
                            self._fail_microbatch(p, f"deadline of {p.deadline - p.started:.1f}s passed")
                st = self._iters.get(it)
                if st is not None:
                    self._check_done(st)
                    # a data node waits for the others once its own microbatches are done
                    if not self.is_data_node or st.remaining <= 0:
                        last_poll = await self._maybe_done_from_norms(it, st, last_poll)
                if now > next_report:
                    next_report = now + self.cfg.stall_report_s
                    self._report_stall(it)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the monitor is what un-stalls an iteration: it must not die
                logger.exception("%s: iteration monitor failed; going on", self.node_name)
            await asyncio.sleep(self.cfg.liveness_poll_s)

    def _report_stall(self, it: int) -> None:
        """Log what an iteration that has been open for long still waits for."""
        st = self._iters.get(it)
        now = time.monotonic()
        pending = [f"{p.index}.{p.attempt}({'bwd' if p.loss_done else 'fwd'}, {p.deadline - now:+.0f}s)"
                   for p in self._pending.values()]
        missing = [p[-8:] for p in self.data_node_peers if st is None or p not in st.done]
        logger.warning("%s: iteration %d still open; remaining %s, pending %s, queued starts %d forwards %d "
                       "losses %d grads %d, in flight %s/%s, no IterationDone from %s", self.node_name, it,
                       None if st is None else st.remaining, pending, len(self._starts), len(self._forwards),
                       len(self._returns), len(self._grads),
                       None if self.runtime is None else self.runtime.in_flight, self.memory_slots, missing)

    # ------------------------------------------------------------------ compute worker
    def _next_job(self):
        """Backward first, then losses, then forwards and new microbatches while slots are free."""
        assert self.runtime is not None
        if self._grads:
            return self._do_backward, self._grads.popleft()
        if self._returns:
            return self._do_loss, self._returns.popleft()
        if self.runtime.in_flight < self.memory_slots:
            if self._forwards:
                return self._do_forward, self._forwards.popleft()
            if self._starts:
                return self._do_start, self._starts.popleft()
        return None

    async def _worker(self) -> None:
        while not self._closed:
            job = self._next_job()
            if job is None:
                self._idle.set()
                self._wakeup.clear()
                if not self._forwards:
                    await self._wakeup.wait()
                    continue
                try:
                    await asyncio.wait_for(self._wakeup.wait(), self.cfg.memory_deadlock_grace_s)
                    continue
                except asyncio.TimeoutError:
                    if not self._forwards:
                        continue
                    logger.warning("%s: memory slots full (%d) for %.0fs with %d forwards waiting; admitting one "
                                   "to break a possible cyclic wait", self.node_name, self.memory_slots,
                                   self.cfg.memory_deadlock_grace_s, len(self._forwards))
                    self.overcommits += 1
                    job = (self._do_forward, self._forwards.popleft())
            fn, arg = job
            # the job could start when its input arrived and the compute thread was free, whichever came
            # later; the time since (the host's dispatch latency) runs inside the emulated compute time
            ready = self._ready_at.pop(id(arg), None)
            self._job_ready_at = None if ready is None else max(ready, self._free_since)
            if not self._open:
                continue  # the iteration closed while this job waited: its result would be unused
            self._idle.clear()
            try:
                if await self._inject(fn, arg):
                    await fn(arg)
            except asyncio.CancelledError:
                raise
            except NodeKilled:
                return
            except Exception:
                logger.exception("%s: compute job failed", self.node_name)
            finally:
                self._idle.set()

    async def _inject(self, fn, arg) -> bool:
        """Apply a fault-injection rule to this job; False = the job is dropped."""
        if not self.faults:
            return True
        if fn == self._do_start:
            index, hop, direction, it = arg[0], 0, "forward", self.current_iteration
        else:
            index, hop, it = arg.mb.index, arg.hop, arg.mb.iteration
            direction = "backward" if fn in (self._do_backward,) else "forward"
        rule = self.faults.take(it, hop, direction, index)
        if rule is None:
            return True
        if rule.action == "delay":
            await asyncio.sleep(rule.delay_s)
            return True
        if rule.action == "drop":
            return False
        self.kill()
        raise NodeKilled(f"{self.node_name} killed by fault injection")

    def kill(self) -> None:
        """Die now, without a word to anyone (fault injection)."""
        self.killed = True
        if self._on_kill is not None:
            self._on_kill()
        self._closed = True
        self._wakeup.set()
        for st in self._iters.values():
            st.all_done.set()

    async def _compute(self, fn, *args):
        def run():
            try:
                return fn(*args)
            finally:
                self._free_since = time.monotonic()

        return await asyncio.get_running_loop().run_in_executor(self._executor, run)

    def _budget_s(self, route) -> float:
        """The microbatch's deadline budget; the first iteration this trainer runs gets
        ``first_iteration_deadline_factor`` times more (streams are opened, allocators warm up)."""
        budget = self.deadlines.microbatch_budget_s(route)
        if not (self.history or self.current_iteration != self._first_iteration):
            budget *= self.cfg.first_iteration_deadline_factor
        return min(budget, self.cfg.max_budget_fraction * self.cfg.iteration_timeout_s)

    def _key(self, mb) -> MbKey:
        return (mb.data_node, mb.epoch, mb.iteration, mb.index, mb.attempt)

    async def _do_start(self, job) -> None:
        from protocol import ActivationMessage, MicrobatchId, TensorFrame

        index, attempt, route = job
        it, epoch = self.current_iteration, self.epoch.epoch
        mb = MicrobatchId(self.cfg.run_id, epoch, it, self.peer_id, index, attempt)
        key = self._key(mb)
        assert self.shard is not None and self.runtime is not None
        inputs, targets = self.shard.batch(it, index)
        self._targets[key] = targets
        st = self._state(it)
        if attempt == 0:
            st.tokens += targets.numel()
        now = time.monotonic()
        self._pending[index] = _Pending(index, attempt, route, now + self._budget_s(route), started=now)
        ready = self._job_ready_at
        frame = await self._compute(lambda: TensorFrame.from_tensor(self.runtime.start(key, inputs, ready_at=ready)))
        self._spawn(self._send_forward(ActivationMessage(mb, 1, route, frame)))

    async def _do_forward(self, msg) -> None:
        from protocol import ActivationMessage, TensorFrame

        key = self._key(msg.mb)
        assert self.runtime is not None
        ready = self._job_ready_at
        frame = await self._compute(
            lambda: TensorFrame.from_tensor(self.runtime.forward(key, msg.tensor.to_tensor(), ready_at=ready)))
        self._spawn(self._send_forward(ActivationMessage(msg.mb, msg.hop + 1, msg.route, frame)))

    async def _do_loss(self, msg) -> None:
        from protocol import GradientMessage, TensorFrame

        p = self._pending.get(msg.mb.index)
        if p is None or p.attempt != msg.mb.attempt or p.loss_done:
            return  # an attempt that was already given up (late), or a duplicate
        key = self._key(msg.mb)
        targets = self._targets.pop(key)
        assert self.runtime is not None

        ready = self._job_ready_at

        def run():
            loss, grad = self.runtime.loss_backward(msg.tensor.to_tensor(), targets, ready_at=ready)
            return loss, TensorFrame.from_tensor(grad)

        loss, frame = await self._compute(run)
        if self._pending.get(msg.mb.index) is not p:
            return  # failed while the loss ran
        p.loss_done, p.route = True, tuple(msg.route)
        self._state(msg.mb.iteration).losses.append(loss)
        self._spawn(self._send_backward(GradientMessage(msg.mb, msg.hop - 1, msg.route, frame)))

    async def _do_backward(self, msg) -> None:
        from protocol import GradientMessage, TensorFrame

        key = self._key(msg.mb)
        assert self.runtime is not None
        ready = self._job_ready_at
        if msg.hop > 0:
            frame = await self._compute(
                lambda: TensorFrame.from_tensor(self.runtime.backward(key, msg.tensor.to_tensor(), ready_at=ready)))
            self._spawn(self._send_backward(GradientMessage(msg.mb, msg.hop - 1, msg.route, frame)))
            return
        # back at the data node: backward through stage 0, the microbatch is complete
        p = self._pending.get(msg.mb.index)
        if p is None or p.attempt != msg.mb.attempt:
            self.runtime.drop(key)
            return
        await self._compute(lambda: self.runtime.finish(key, msg.tensor.to_tensor(), ready_at=ready))
        if self._pending.get(msg.mb.index) is not p:
            return
        self._pending.pop(msg.mb.index, None)
        st = self._state(msg.mb.iteration)
        for peer in msg.route[:-1]:
            st.visits[peer] += 1
        self._microbatch_finished(st)

    # ------------------------------------------------------------------ iteration
    async def run_iteration(self) -> IterationStats:
        """Run and commit iteration ``self.current_iteration``."""
        if self._closed:
            raise RuntimeError("trainer is shut down")
        await self._wait_for_stages()
        it = self.current_iteration
        t0 = time.perf_counter()
        behind0 = self._emulation_behind()
        st = self._state(it)
        self._open, self._opened = True, it
        if self._first_iteration < 0:
            self._first_iteration = it
        if self.is_data_node:
            self._routes = self.plan.routes_for(self.index)
            self._pending.clear()
            st.remaining = len(self._routes)
            if st.remaining == 0:
                from protocol import IterationDone

                for peer in self.members:
                    self._send_control(peer, IterationDone(self.cfg.run_id, self.epoch.epoch, it, self.peer_id, {}, 0))
            for j in range(len(self._routes)):
                route = tuple(self.members[n] for n in self._routes[j]) + (self.peer_id,)
                if not all(self.usable(r) for r in route):
                    route = self._fresh_route(j) or route
                self._starts.append((j, 0, route))
        self._monitor_task = asyncio.create_task(self._monitor(it), name=f"trainer-monitor-{self.node_name}")
        for msg in self._early.pop(it, []):
            self._enqueue(msg)
        self._wakeup.set()

        try:
            await asyncio.wait_for(st.all_done.wait(), self.cfg.iteration_timeout_s)
        except asyncio.TimeoutError:
            missing = [p[-8:] for p in self.data_node_peers if p not in st.done]
            raise TrainingStalled(f"{self.node_name}: iteration {it} incomplete after "
                                  f"{self.cfg.iteration_timeout_s:.0f}s; no IterationDone from {missing}")
        finally:
            self._open = False
            if self._monitor_task is not None:
                self._monitor_task.cancel()
        if self.killed:
            raise NodeKilled(f"{self.node_name} was killed")
        await self._idle.wait()  # a job that started before the close finishes before we average
        self._grads.clear(), self._returns.clear(), self._forwards.clear(), self._starts.clear()
        self._ready_at.clear()
        assert self.runtime is not None
        dropped = sum(int(d.dropped) for d in st.done.values())

        t_mb = time.perf_counter()
        behind = tuple(b - a for a, b in zip(behind0, self._emulation_behind()))
        averaged = await self._average(it)
        t_avg = time.perf_counter()
        loss_sum = float(sum(st.losses))
        sq, checksum = await self._compute(lambda: (self.runtime.grad_squared_norm(), self.runtime.checksum()))
        record = {"stage": self.stage, "sq": sq, "loss_sum": loss_sum,
                  "avg_group": list(self.averager.last_group) if averaged and self.averager is not None else [],
                  "n_mb": len(st.losses), "tokens": st.tokens if self.is_data_node else 0,
                  "checksum": checksum, "dropped": st.dropped if self.is_data_node else 0,
                  "loss_scale": self.runtime.loss_scale}  # fp16: the data nodes' scale, checked below
        records = await self._exchange_norms(it, record)
        total_sq = self._global_squared_norm(records)
        coef = clip_coefficient(total_sq, self.cfg.optim.clip_norm)
        t_norm = time.perf_counter()
        source = self._resync_source(records, record["checksum"])

        finite = math.isfinite(total_sq) and math.isfinite(record["sq"])
        # --- precision (node.train.precision): a member whose fp16 loss scale differs from the data
        # nodes' skips like on an overflow; step()/skip_step() below update the scale (halve on a skip)
        finite = finite and loss_scales_agree(records, self.runtime.loss_scale)

        def step() -> None:
            if not finite:  # a poisoned gradient is never applied (replicas that stepped re-sync us)
                logger.warning("%s: non-finite gradient norm at iteration %d; stage %d skips this step",
                               self.node_name, it, self.stage)
                self.runtime.skip_step()
            else:
                self.runtime.scale_grads(coef)
                self.runtime.step()
            self._state_iteration = it

        if source is not None:
            await self._resync(source, it)
        else:
            await self._compute(step)
        self.committed_iteration = it
        self.current_iteration = it + 1
        del self._iters[it]
        for old in [k for k in self._iters if k < it]:
            del self._iters[old]
        n_mb = sum(int(r.get("n_mb", 0)) for r in records.values())
        stats = IterationStats(
            iteration=it, epoch=self.epoch.epoch,
            loss=sum(float(r.get("loss_sum", 0.0)) for r in records.values()) / max(n_mb, 1),
            microbatches=n_mb, tokens=sum(int(r.get("tokens", 0)) for r in records.values()),
            seconds=time.perf_counter() - t0, grad_norm=math.sqrt(total_sq), clip_coef=coef,
            active_nodes=len(records), local_visits=self.runtime.visits, averaged=averaged,
            microbatch_s=t_mb - t0, averaging_s=t_avg - t_mb, norm_exchange_s=t_norm - t_avg,
            step_s=time.perf_counter() - t_norm, dropped=dropped, retried=st.retried,
            resynced=source is not None, compute_overrun_s=behind[0], late_frames_s=behind[1])
        self.history.append(stats)
        if self.checkpoints and self.cfg.checkpoint_every > 0 and (it + 1) % self.cfg.checkpoint_every == 0:
            await self.save_checkpoint()
        if self.on_iteration is not None:
            self.on_iteration(stats)
        return stats

    async def _maybe_done_from_norms(self, it: int, st: _IterationState, last_poll: float) -> float:
        """A data node publishes its gradient norm only after its microbatches are done, so its norm
        record stands in for an ``IterationDone`` we never got (sent while our data plane was not
        up yet, e.g. a joiner still downloading its state, or lost with a broken stream). Without
        this, such a node would wait forever while the swarm waits for its norm."""
        now = time.monotonic()
        if st.all_done.is_set() or now - last_poll < self.cfg.done_poll_s:
            return last_poll
        with contextlib.suppress(Exception):
            records = await self._norm_records(it)
            if records is not None:
                for peer, r in records.items():
                    if peer in self.data_node_peers and peer not in st.done:
                        logger.info("%s: iteration %d of data node %s is done (its norm record; no IterationDone "
                                    "reached us)", self.node_name, it, peer[-8:])
                        st.done[peer] = _DoneFromNorm(int(r.get("dropped", 0)))
                self._check_done(st)
        return time.monotonic()

    def _resync_source(self, records: Dict[str, dict], mine: float) -> Optional[str]:
        """The replica to copy from when ours diverged (a failed all-reduce): the lowest live peer id of
        our stage; None when we agree with it (or are it)."""
        # only a replica with finite parameters can be a source (a NaN one would spread)
        replicas = sorted(p for p, r in records.items() if int(r["stage"]) == self.stage and "checksum" in r
                          and math.isfinite(float(r["checksum"])))
        if not replicas or replicas[0] == self.peer_id:
            return None
        theirs = float(records[replicas[0]]["checksum"])
        if math.isfinite(mine) and abs(theirs - mine) <= self.cfg.resync_tolerance * max(1.0, abs(theirs)):
            return None
        logger.warning("%s: stage %d parameters differ from replica %s (checksum %.9g vs %.9g); re-syncing",
                       self.node_name, self.stage, replicas[0][-8:], mine, theirs)
        return replicas[0]

    async def _resync(self, source: str, it: int) -> None:
        """Take ``source``'s state right after its step of ``it`` instead of stepping ourselves."""
        from node.dataplane.state_transfer import StateTransferError, fetch_state

        try:
            _, snap = await fetch_state(self.p2p, self.cfg.run_id, [source], self.stage, it,
                                        timeout_s=self.cfg.state_fetch_timeout_s)
        except StateTransferError as e:
            logger.warning("%s: re-sync failed (%s); stepping on our own", self.node_name, e)
            coef_free = lambda: (self.runtime.step(), setattr(self, "_state_iteration", it))  # noqa: E731
            await self._compute(coef_free)
            return
        state = await self._compute(snap.state_dict)

        def load() -> None:
            self.runtime.load_state_dict(state)
            self.runtime.reset_grads()
            self._state_iteration = it

        await self._compute(load)
        self.resyncs += 1

    def _emulation_behind(self) -> Tuple[float, float]:
        """(compute overrun seconds, late-frame seconds) so far; both 0 without emulation."""
        padder = getattr(self.runtime, "padder", None) if self.runtime is not None else None
        return (float(getattr(padder, "overrun_s", 0.0)), float(getattr(self.dataplane, "late_s", 0.0)))

    async def _average(self, it: int) -> Optional[bool]:
        assert self.runtime is not None
        group = [self.members[n] for n in self.plan.replicas(self.stage)]
        live = [p for p in group if self.is_alive(p)]
        await self._compute(self.runtime.mean_grads)  # device work: in the compute thread, not on the loop
        if self.averager is None or len(live) < 2:
            if self.averager is not None:
                logger.warning("%s: stage %d averaging skipped at iteration %d: no other replica in the view (%s)",
                               self.node_name, self.stage, it,
                               ", ".join(p[-8:] for p in group if p != self.peer_id))
            return None
        epoch = self.epoch.epoch

        async def groupmates_gone_on() -> bool:
            return groupmates_went_on(self.peer_id, group, await self._norm_records(it) or {}, epoch, self.is_alive)

        ok = await self.averager.average(self.runtime.grads(), weight=float(self.runtime.visits),
                                         abandon_when=groupmates_gone_on)
        if not ok:
            logger.warning("%s: stage %d averaging failed; stepping with the local mean gradient (replicas are "
                           "re-synced by checksum next iteration)", self.node_name, self.stage)
        return ok

    def _epochs_to_announce(self, it: int) -> List[bytes]:
        """Encoded epochs a member may not know yet: those announced to start after ``it``, and ours
        if it began at ``it`` or just before (a member that missed the switch learns it here)."""
        from protocol import encode

        out = [e for n, e in self._offered.items() if n > self.epoch.epoch and int(e.start_iteration) > it]
        if int(getattr(self.epoch, "start_iteration", 0)) >= it - 1 and self.epoch.epoch > 0:
            out.append(self.epoch)
        return [encode(e) for e in out]

    def _learn_epochs(self, records) -> None:
        """Offer the epochs other members announced in their norm records (checked by ``verify``)."""
        from protocol import ProtocolError, ScheduleEpoch, decode

        for r in records:
            for data in r.get("epochs", ()) if isinstance(r, dict) else ():
                try:
                    epoch = decode(data, expect=ScheduleEpoch)
                except (ProtocolError, TypeError, ValueError):
                    continue
                if epoch.epoch <= self.epoch.epoch or epoch.epoch in self._offered:
                    continue
                if self._verify_epoch is not None and not self._verify_epoch(epoch):
                    continue
                logger.info("%s: learnt schedule epoch %d (from iteration %d) from a member's record",
                            self.node_name, epoch.epoch, epoch.start_iteration)
                self.offer_epoch(epoch)

    async def _catch_up_epochs(self, ahead: int) -> None:
        """Members are on epoch ``ahead`` and we never saw it: look for it in the DHT."""
        if self._fetch_epochs is None:
            return
        with contextlib.suppress(Exception):
            for epoch in await self._fetch_epochs():
                if epoch.epoch > self.epoch.epoch and epoch.run_id == self.cfg.run_id:
                    self.offer_epoch(epoch)
        if ahead not in self._offered:
            logger.warning("%s: members train on schedule epoch %d, which this node cannot find yet", self.node_name,
                           ahead)

    async def _norm_records(self, it: int) -> Optional[Dict[str, dict]]:
        """Iteration ``it``'s norm records of the members (peer id -> record), read from the DHT;
        None when the read found nothing (a miss under load is not "nobody published")."""
        res = await self.dht.get(norm_key(self.cfg.run_id, it), latest=True, return_future=True)
        if res is None or not isinstance(res.value, dict):
            return None
        return {str(k): v.value for k, v in res.value.items() if str(k) in self.members and isinstance(v.value, dict)}

    async def _exchange_norms(self, it: int, record: dict) -> Dict[str, dict]:
        """Publish our record for iteration ``it`` and collect every member's.

        Records carry the sender's epoch, and only records of *our* epoch are returned: a member
        that switched epochs at another boundary (it missed an announcement) never mixes its
        numbers into ours. Records also carry pending epochs, so the union of what the members
        know reaches everyone at every barrier, and all switch at the same boundary. A member that
        stays silent past ``norm_exchange_timeout_s`` is suspected and left out (a hung node must
        not stop the swarm; a replica that drifted is re-synced by checksum)."""
        from node.compat import import_hivemind

        import_hivemind()
        from hivemind.utils import get_dht_time
        key = norm_key(self.cfg.run_id, it)
        mine = self.epoch.epoch
        record = dict(record, epoch=mine, epochs=self._epochs_to_announce(it))
        await self.dht.store(key, record, expiration_time=get_dht_time() + self.cfg.norm_record_ttl_s,
                             subkey=self.peer_id, return_future=True)
        deadline = time.monotonic() + self.cfg.norm_exchange_timeout_s
        found: Dict[str, dict] = {}
        poll = self.cfg.norm_poll_s
        while True:
            found = await self._norm_records(it) or found
            done = all(p in found or not self.is_alive(p) for p in self.members)
            if not done and time.monotonic() > deadline:
                missing = [p for p in self.members if p not in found and self.is_alive(p)]
                for p in missing:
                    self.suspect(p, f"no gradient norm for iteration {it} in {self.cfg.norm_exchange_timeout_s:.0f}s")
                logger.warning("%s: going on without the norms of %s for iteration %d", self.node_name,
                               [p[-8:] for p in missing], it)
                done = True
            if done:
                self._learn_epochs(found.values())
                others = {p: int(r.get("epoch", mine)) for p, r in found.items() if int(r.get("epoch", mine)) != mine}
                if others:
                    logger.warning("%s: members %s finished iteration %d on other epochs %s (we are on %d); their "
                                   "numbers are left out", self.node_name, [p[-8:] for p in others], it,
                                   sorted(set(others.values())), mine)
                    ahead = max(others.values())
                    if ahead > mine and ahead not in self._offered:
                        await self._catch_up_epochs(ahead)
                return {p: r for p, r in found.items() if int(r.get("epoch", mine)) == mine}
            await asyncio.sleep(poll)
            poll = min(2 * poll, max(self.cfg.norm_poll_s, self.cfg.norm_poll_max_s))

    def _global_squared_norm(self, records: Dict[str, dict]) -> float:
        per_stage: Dict[int, Tuple[str, float]] = {}
        for peer, r in records.items():
            s = int(r["stage"])
            if s not in per_stage or peer < per_stage[s][0]:
                per_stage[s] = (peer, float(r["sq"]))
        return sum(sq for _, sq in per_stage.values())

    async def run(self, iterations: int, stop_event: Optional[asyncio.Event] = None) -> List[IterationStats]:
        """Train until ``iterations`` iterations are committed in total (resume counts earlier ones).

        Returns early when stopped, or when a new epoch leaves this node out (``self.left`` is set)."""
        out = []
        self.left = None
        while self.current_iteration < iterations and not self._stop_requested:
            if stop_event is not None and stop_event.is_set():
                break
            try:
                out.append(await self.run_iteration())
            except LeftSchedule as e:
                self.left = str(e)
                logger.info("%s leaves training: %s", self.node_name, e)
                break
        return out

    def request_stop(self) -> None:
        """Finish the current iteration, then return from :meth:`run`."""
        self._stop_requested = True

    # ------------------------------------------------------------------ checkpoints / shutdown
    async def save_checkpoint(self) -> None:
        if self.checkpoints is None or self.committed_iteration < 0 or self.committed_iteration == self._last_saved:
            return
        assert self.runtime is not None
        it = self.committed_iteration
        state = await self._compute(self.runtime.state_dict)
        meta = {"run_id": self.cfg.run_id, "epoch": self.epoch.epoch, "model": self.cfg.model.to_dict(),
                "peer_id": self.peer_id, "checksum": self.runtime.checksum()}
        await self._compute(lambda: self.checkpoints.save(it, state, meta))
        self._last_saved = it

    async def shutdown(self) -> None:
        """Clean stop: save the last committed step, close the data plane and the averager."""
        if self._shut:
            return
        self._shut = True
        if not self.killed:
            await self.save_checkpoint()
        self._closed = True
        self._wakeup.set()
        for task in (self._worker_task, self._monitor_task):
            if task is not None:
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
        if self._send_tasks:
            await asyncio.wait(list(self._send_tasks), timeout=5)
        if self.dataplane is not None:
            await self.dataplane.close()
            self.dataplane = None
        if self.state_server is not None:
            await self.state_server.close()
            self.state_server = None
        if self.averager is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.averager.shutdown)
            self.averager = None
        self._executor.shutdown(wait=True)


def arrival_time(now_mono: float, now_unix: float, deliver_at_unix: Optional[float], emulates_links: bool) -> float:
    """When a hop message's work could have started (monotonic clock).

    A node that emulates links held a stamped message until its emulated delivery time, so it
    arrived then, not now: compute padding counts from there. A node that does not emulate links
    delivered it at once and ignores the stamp (as its data plane does)."""
    if deliver_at_unix is None or not emulates_links:
        return now_mono
    return now_mono - max(0.0, now_unix - deliver_at_unix)


def gone_peers(peers, is_alive: Callable[[str], bool], absent_since: Dict[str, float], now: float,
               grace_s: float) -> set:
    """The ``peers`` that have been out of the view for at least ``grace_s`` (``now`` monotonic).

    ``absent_since`` remembers when each peer was first seen absent and is updated in place: a peer
    seen alive again is forgotten, so a momentary lapse never adds up with a later one.
    """
    gone = set()
    for peer in peers:
        if is_alive(peer):
            absent_since.pop(peer, None)
            continue
        since = absent_since.setdefault(peer, now)
        if now - since >= grace_s:
            gone.add(peer)
    return gone


def _kill_own_process_group() -> None:
    """Injected kill inside a daemon: die like a machine losing power, p2pd and DHT child included."""
    import os
    import signal

    if os.getpgid(0) == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _mb_name(mb) -> str:
    return f"mb {mb.data_node[-6:]}/{mb.iteration}/{mb.index}.{mb.attempt}"


#: DHT key (one subkey per member) under which every trainer confirms the epoch it trains on.
def start_key(run_id: str) -> str:
    return f"{run_id}:trainstart"


#: DHT key (one subkey per member) under which a trainer that finished the run says so, for late joiners.
def finished_key(run_id: str) -> str:
    return f"{run_id}:trainfinished"


def training_summary(config: TrainerConfig, iterations: int) -> dict:
    """The hyper-parameters every member of a run must share (compared before training starts)."""
    from dataclasses import asdict

    return {"model": config.model.to_dict(), "optim": asdict(config.optim), "data": asdict(config.data),
            "averaging": asdict(config.averaging), "seed": config.seed, "iterations": int(iterations),
            "memory_slots": config.memory_slots, "precision": config.precision, "wire": config.wire}


def summary_differences(mine: dict, theirs: dict, prefix: str = "") -> List[str]:
    """``["optim.lr: 0.001 here, 0.003 there", ...]`` (nested dicts flattened)."""
    out = []
    for k in sorted(set(mine) | set(theirs)):
        a, b = mine.get(k), theirs.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(summary_differences(a, b, f"{prefix}{k}."))
        elif a != b and not (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and list(a) == list(b)):
            out.append(f"{prefix}{k}: {a!r} here, {b!r} there")
    return out


class TrainingDisagreement(UserError):
    """Members of the pinned epoch confirmed a different epoch, configuration or start iteration."""


class TrainerService:
    """Runs a :class:`TrainerNode` inside the daemon (``Daemon(config, services=[TrainerService(...)])``).

    Implements the daemon's ``DaemonService`` protocol (``async start(daemon)``, ``async stop()``).

    **Epoch agreement.** The service pins one schedule epoch for the whole run (switching needs a
    coordinator-announced switch iteration, issue #6). It pins the daemon's *current* epoch once
    that epoch (a) contains this peer, (b) has at least ``min_members`` members and (c) has stayed
    the current epoch for ``start_debounce_s`` (default 3 heartbeats). It then builds its stage,
    and publishes one confirmation ``{epoch, config, start}`` under the DHT key
    ``<run>:trainstart`` (subkey = its peer id). Each node pins exactly once, and nobody runs an
    iteration before *every* member of its pinned epoch has confirmed that same epoch, the same
    training configuration (:func:`training_summary`) and the same start iteration. So if any node
    trains on epoch E, all members of E train on E; a member that pinned something else turns the
    wait into a :class:`TrainingDisagreement` naming who and what differs, never a silent split.
    Confirmations made before the pinned epoch was issued (an earlier session) are ignored.

    Progress: the ``training`` RPC (``{"since": i, "limit": n}``) returns the state
    (``waiting``/``agreeing``/``training``/``done``/``error``/``stopped``), the pinned epoch,
    stage, committed iteration and recent :class:`IterationStats`.
    """

    def __init__(self, config: TrainerConfig, iterations: int, *, node_name: Optional[str] = None,
                 on_iteration: Optional[Callable[[IterationStats], None]] = None, poll_s: float = 0.5,
                 min_members: int = 1, start_debounce_s: Optional[float] = None,
                 agreement_timeout_s: float = 600.0, threads: Optional[int] = None, emulation=None,
                 faults=None, drain_timeout_s: float = 60.0):
        self.emulation = emulation  # optional node.cli.emulation_args.EmulationSettings (peer locations: daemon view)
        self.faults = faults  # optional node.testing.faults.FaultInjector (--inject)
        #: SIGTERM: how long this node keeps training until an epoch without it starts, before leaving anyway
        self.drain_timeout_s = drain_timeout_s
        self.config, self.iterations = config, iterations
        self.node_name, self.on_iteration, self.poll_s = node_name, on_iteration, poll_s
        self.min_members, self.start_debounce_s = max(1, int(min_members)), start_debounce_s
        self.agreement_timeout_s, self.threads = agreement_timeout_s, threads
        self.trainer: Optional[TrainerNode] = None
        self.stop_grace_s = 6.0  # how long stop() lets the current iteration finish after draining
        self.stop_timeout_s = self.drain_timeout_s + self.stop_grace_s  # the daemon waits this long for stop()
        self.done = asyncio.Event()
        self.error: Optional[BaseException] = None
        self.state = "waiting"
        self.epoch = None  # the pinned ScheduleEpoch
        self.start_iteration: Optional[int] = None
        self.daemon = None
        self._task: Optional[asyncio.Task] = None
        self._history_before: List[IterationStats] = []  # iterations committed before a re-join
        self._stopping = False

    async def start(self, daemon) -> None:
        self.daemon = daemon
        if self.threads:
            torch.set_num_threads(int(self.threads))
        run = getattr(daemon, "run", None)
        if run is not None and run.num_stages != self.config.model.n_stages:
            # the run's stage count (founder's --num-stages, sent in hello) decides; layers per stage stay
            logger.info("model: %d stages for this run (instead of %d)", run.num_stages, self.config.model.n_stages)
            self.config = replace(self.config, model=replace(self.config.model, n_stages=run.num_stages).validate())
        if hasattr(daemon, "register_rpc"):
            daemon.register_rpc("training", self._rpc_training)
        daemon.training_progress = self.switch_iteration
        if hasattr(daemon, "on_schedule_epoch"):
            daemon.on_schedule_epoch.append(self._offer_epoch)
        self._task = asyncio.create_task(self._main(daemon), name="trainer-service")

    def switch_iteration(self, lead_s: float = 0.0) -> Optional[int]:
        """For the coordinator: the iteration a new epoch should start at (None before training).

        After the last iteration it is the run's end, so an epoch issued then (for a late joiner)
        says the run is over instead of looking like a fresh start (0) that would gather members
        at the start barrier until it timed out."""
        if self.state in ("training", "paused") and self.trainer is not None:
            return self.trainer.switch_iteration(lead_s)
        if self.state == "done":
            return self.iterations
        return None

    def _offer_epoch(self, epoch) -> None:
        if self.trainer is not None:
            self.trainer.offer_epoch(epoch)

    @property
    def debounce_s(self) -> float:
        if self.start_debounce_s is not None:
            return self.start_debounce_s
        hb = getattr(getattr(self.daemon, "config", None), "heartbeat_s", 1.0)
        return 3.0 * float(hb)

    async def _choose_epoch(self, daemon, after: Optional[Tuple[int, int]] = None):
        """The epoch to train on: the first time the daemon's current one (see the class docstring);
        after leaving (``after`` = (epoch we left, iteration)), the next one that includes us again."""
        me = str(daemon.peer_id)
        seen, since, said = None, time.monotonic(), None
        while True:
            epoch = daemon.current_epoch
            if after is not None and epoch is not None and (
                    epoch.epoch <= after[0] or int(getattr(epoch, "start_iteration", 0)) < after[1]):
                epoch = None  # not newer than the one we left, or it started before we left
            if after is not None and self._stopping:
                return None
            number = epoch.epoch if epoch is not None else None
            if number != seen:
                seen, since = number, time.monotonic()
            joining = epoch is not None and int(getattr(epoch, "start_iteration", 0)) > 0
            if epoch is not None and me in epoch.members and (joining or len(epoch.members) >= self.min_members):
                # a run in progress announced its boundary already; waiting would only make us late
                if joining or time.monotonic() - since >= self.debounce_s:
                    return epoch
            elif epoch is not None and said != number:
                said = number
                logger.info("training waits: epoch %d has %d members (need %d)%s", number, len(epoch.members),
                            self.min_members, "" if me in epoch.members else ", not including this node")
            await asyncio.sleep(self.poll_s)

    async def _confirm(self, epoch, summary: dict, start: int) -> None:
        """Publish this node's pin, then wait until every member confirmed the same one."""
        from node.compat import import_hivemind

        import_hivemind()
        from hivemind.utils import get_dht_time

        me, key = self.trainer.peer_id, start_key(self.config.run_id)
        record = {"epoch": int(epoch.epoch), "config": summary, "start": int(start), "time": time.time()}
        await self.trainer.dht.store(key, record, expiration_time=get_dht_time() + 3600.0, subkey=me,
                                     return_future=True)
        deadline = time.monotonic() + self.agreement_timeout_s
        not_after = float(epoch.issued_at) - 5.0  # older confirmations belong to an earlier session
        while True:
            res = await self.trainer.dht.get(key, latest=True, return_future=True)
            found = {}
            if res is not None and isinstance(res.value, dict):
                for k, v in res.value.items():
                    if str(k) in epoch.members and isinstance(v.value, dict) and float(v.value.get("time", 0)) >= not_after:
                        found[str(k)] = v.value
            for peer, r in found.items():
                if int(r.get("epoch", -1)) != epoch.epoch:
                    raise TrainingDisagreement(
                        f"members disagree on the training epoch: {peer[-8:]} pinned epoch {r.get('epoch')}, "
                        f"this node epoch {epoch.epoch} (membership changed within the start debounce; "
                        f"restart with --min-members = the number of nodes)")
                diff = summary_differences(summary, r.get("config") or {})
                if diff:
                    raise TrainingDisagreement(f"training configuration differs from {peer[-8:]}: " + "; ".join(diff))
                if int(r.get("start", -1)) != start:
                    raise TrainingDisagreement(
                        f"checkpoints disagree on the iteration to start from: {peer[-8:]} starts at "
                        f"{r.get('start')}, this node at {start} (use --resume on all nodes or none)")
            if len(found) == len(epoch.members):
                return
            if time.monotonic() > deadline:
                missing = [p[-8:] for p in epoch.members if p not in found]
                raise TrainingStalled(f"members {missing} never confirmed epoch {epoch.epoch} "
                                      f"within {self.agreement_timeout_s:.0f}s (are they running --train?)")
            await asyncio.sleep(self.poll_s)

    def _on_iteration(self, stats: IterationStats) -> None:
        metrics = getattr(self.daemon, "metrics", None)
        if metrics is not None and hasattr(metrics, "set_iteration"):
            try:
                metrics.set_iteration(stats.iteration, stats.loss, stats.tokens / max(stats.seconds, 1e-9))
            except Exception:  # noqa: BLE001 - metrics never break training
                logger.debug("metrics update failed", exc_info=True)
        if self.on_iteration is not None:
            self.on_iteration(stats)

    async def _main(self, daemon) -> None:
        try:
            epoch = await self._choose_epoch(daemon)
            first = True
            while True:
                try:
                    left_at = await self._train_on(daemon, epoch, first)
                except JoinFailed as e:
                    # the replica we need is busy or gone: the coordinator will issue another epoch
                    # (it starts later, so there is a newer state to fetch); try that one
                    logger.warning("%s; waiting for a later epoch to try again", e)
                    left_at = max(int(getattr(epoch, "start_iteration", 0)), 1)
                first = False
                if left_at is None:
                    break
                # left out of an epoch (a view that briefly lost us, a take-over coordinator): wait
                # for one that includes us again and re-join it with a fresh copy of our stage's state
                self.state = "waiting"
                logger.info("waiting for a schedule epoch that includes this node again (left at iteration %d)",
                            left_at)
                epoch = await self._choose_epoch(daemon, after=(self.trainer.epoch.epoch, left_at))
                await self.trainer.shutdown()
                if epoch is None:  # stopped while waiting
                    self.state = "stopped"
                    break
        except asyncio.CancelledError:
            self.state = "stopped"
            raise
        except BaseException as e:
            if isinstance(e, UserError):
                logger.error("training stopped: %s", e)
            else:
                logger.exception("training stopped with an error")
            self.error, self.state = e, "error"
        finally:
            self.done.set()

    async def _train_on(self, daemon, epoch, first: bool) -> Optional[int]:
        """Build a trainer on ``epoch`` (joining mid-run if it starts later than 0) and train.

        Returns the iteration at which a newer epoch left this node out, if it should re-join later;
        None when training is over (done, stopped, draining)."""
        self.epoch, self.state = epoch, "agreeing"
        logger.info("training pins schedule epoch %d (%d members)", epoch.epoch, len(epoch.members))
        for peer in epoch.members:
            if peer != str(daemon.peer_id) and not await daemon.ensure_connected(peer):
                logger.warning("cannot connect to schedule member %s yet", peer[-8:])
        join_at = int(getattr(epoch, "start_iteration", 0)) or None
        summary = training_summary(self.config, self.iterations)
        past_end = join_at is not None and join_at >= self.iterations
        if past_end or await self._run_finished(summary):
            # the coordinator plans for membership changes even after the run's last iteration, so a
            # late joiner can be handed an epoch that starts past the end, or at 0 when it coordinates
            # itself: no replica trains any more, and waiting for one (a state to download, a start
            # barrier) would never end
            if past_end:
                await self._check_joining_config(summary)
            self.state = "done"
            logger.warning("the run ended at iteration %d before this node could join (epoch %d starts at "
                           "iteration %d): nothing to train", self.iterations - 1, epoch.epoch, join_at or 0)
            return None
        pinned = epoch

        def epoch_source():
            return daemon.current_epoch or pinned

        self.trainer = TrainerNode(
            p2p=daemon.p2p, dht=daemon.dht, peer_id=str(daemon.peer_id), epoch=lambda: pinned, config=self.config,
            node_name=self.node_name, on_iteration=self._on_iteration, emulation=self._emulation(daemon),
            alive=getattr(daemon, "peer_alive", None), faults=self.faults, on_kill=_kill_own_process_group,
            link_estimate=getattr(daemon, "link_estimate", None), allow=getattr(daemon, "is_peer_allowed", None),
            metrics=getattr(daemon, "metrics", None), join_at=join_at,
            verify_epoch=getattr(daemon, "verify_epoch", None), fetch_epochs=getattr(daemon, "fetch_epochs", None))
        if not first and self._history_before:
            self.trainer.history = list(self._history_before)
        if join_at is not None:
            await self._check_joining_config(summary)
            logger.info("joining the run in progress at iteration %d (epoch %d)", join_at, epoch.epoch)
        await self.trainer.setup()
        self.trainer._epoch_source = epoch_source  # from now on: follow the daemon's adopted epochs
        if first:
            self.start_iteration = self.trainer.current_iteration
        if join_at is None:
            await self._confirm(epoch, summary, self.trainer.current_iteration)
        self.state = "training"
        logger.info("training stage %d from iteration %d to %d", self.trainer.stage, self.trainer.current_iteration,
                    self.iterations)
        await self.trainer.run(self.iterations)
        await self.trainer.save_checkpoint()
        self._history_before = list(self.trainer.history)
        if self.trainer.left is not None:
            self.state = "left"
            logger.info("training left at iteration %d: %s", self.trainer.committed_iteration, self.trainer.left)
            if not self.trainer.draining and not self.trainer._stop_requested \
                    and self.trainer.current_iteration < self.iterations:
                return self.trainer.current_iteration
            return None
        self.state = "done" if self.trainer.current_iteration >= self.iterations else "stopped"
        logger.info("training %s at iteration %d", self.state, self.trainer.committed_iteration)
        if self.state == "done":
            await self._say_finished(summary)
        return None

    async def _say_finished(self, summary: dict) -> None:
        """Record in the DHT that this member finished the run (read by :meth:`_run_finished`)."""
        try:
            from hivemind.utils import get_dht_time

            record = {"config": summary, "iteration": self.iterations - 1, "time": time.time()}
            await self.daemon.dht.store(finished_key(self.config.run_id), record,
                                        expiration_time=get_dht_time() + 3600.0, subkey=str(self.daemon.peer_id),
                                        return_future=True)
        except Exception:  # noqa: BLE001 - only late joiners read it; training is over either way
            logger.debug("could not record the finished run", exc_info=True)

    async def _run_finished(self, summary: dict) -> bool:
        """Whether a member already finished this run (same configuration, so the same iterations)."""
        try:
            records = await self._others_records(finished_key(self.config.run_id))
        except Exception:  # noqa: BLE001 - unknown: go on as before
            return False
        return any(not summary_differences(summary, record["config"]) for _, record in records)

    def _drain_pointless(self) -> Optional[str]:
        """Why no epoch without us will come (so waiting for one is pointless), or None."""
        view = getattr(self.daemon, "view", None)
        if view is None or self.trainer is None or self.trainer.runtime is None:
            return "no swarm view"
        me = str(self.daemon.peer_id)
        online = [e for e in view.online() if e.peer_id != me]
        if not any(self.trainer.stage in e.advert.stages for e in online):
            return f"no other ONLINE node holds stage {self.trainer.stage}"
        if not any(0 in e.advert.stages for e in online):
            return "no other ONLINE data node to coordinate"
        return None

    async def _others_records(self, key: str) -> List[Tuple[str, dict]]:
        """(peer, record) of every other member under a per-member DHT key that carries a ``config``."""
        res = await self.daemon.dht.get(key, latest=True, return_future=True)
        if res is None or not isinstance(res.value, dict):
            return []
        me = str(self.daemon.peer_id)
        return [(str(peer), v.value) for peer, v in res.value.items()
                if str(peer) != me and isinstance(v.value, dict) and v.value.get("config")]

    async def _check_joining_config(self, summary: dict) -> None:
        """A joiner skips the start barrier, but must still train with the run's hyper-parameters."""
        for peer, record in (await self._others_records(start_key(self.config.run_id)))[:1]:
            diff = summary_differences(summary, record["config"])
            if diff:
                raise TrainingDisagreement(f"training configuration differs from {peer[-8:]}: " + "; ".join(diff))

    def _emulation(self, daemon):
        if self.emulation is None:
            return None
        from node.dataplane.emulation import daemon_peer_locations

        return self.emulation.build(daemon_peer_locations(daemon))

    async def _rpc_training(self, params: dict) -> dict:
        try:
            since = int(params.get("since", -1))
            limit = max(1, int(params.get("limit", 100)))
        except (TypeError, ValueError):
            raise ValueError("since and limit must be integers") from None
        from dataclasses import asdict

        t = self.trainer
        history = [asdict(s) for s in (t.history if t is not None else []) if s.iteration > since][-limit:]
        state = self.state
        if state == "training" and t is not None and t.paused_reason:
            state = "paused"
        return {
            "peer_id": str(getattr(self.daemon, "peer_id", "")),
            "node_name": self.node_name,
            "state": state,
            "error": str(self.error) if self.error is not None else None,
            "paused": t.paused_reason if t is not None else None,
            "left": t.left if t is not None else None,
            "draining": bool(t.draining) if t is not None else False,
            "recovery": ({"reroutes": t.reroutes, "skips": t.skips, "resyncs": t.resyncs,
                          "retried": sum(s.retried for s in t.history), "dropped": sum(s.dropped for s in t.history)}
                         if t is not None else None),
            # the epoch training runs on now (it changes at iteration boundaries), else the pinned one
            "epoch": (t.epoch.epoch if t is not None and getattr(t, "epoch", None) is not None
                      else self.epoch.epoch if self.epoch is not None else None),
            "members": (len(t.members) if t is not None and getattr(t, "members", None) is not None
                        else len(self.epoch.members) if self.epoch is not None else None),
            "pinned_epoch": self.epoch.epoch if self.epoch is not None else None,
            "min_members": self.min_members,
            "stage": t.stage if t is not None and t.runtime is not None else None,
            "is_data_node": bool(t.is_data_node) if t is not None and t.runtime is not None else None,
            "start_iteration": self.start_iteration,
            "committed_iteration": t.committed_iteration if t is not None else None,
            "iterations": self.iterations,
            "overcommits": t.overcommits if t is not None else 0,
            "history": history,
        }

    async def stop(self) -> None:
        """Graceful leave: keep training until an epoch without this node starts (the coordinator
        issues one once our advert says DRAINING), so no in-flight microbatch is lost; after
        ``drain_timeout_s`` finish the current iteration and leave anyway."""
        self._stopping = True
        if self.trainer is not None and self.state == "training" and self._task is not None and not self._task.done():
            self.trainer.draining = True
            logger.info("draining: training on until a schedule epoch without this node starts "
                        "(at most %.0f s)", self.drain_timeout_s)
            deadline = time.monotonic() + self.drain_timeout_s
            while not self._task.done() and time.monotonic() < deadline:
                reason = self._drain_pointless()
                if reason:
                    logger.info("not draining: %s", reason)
                    break
                await asyncio.wait([self._task], timeout=0.5)
            if self._task.done() and self.trainer.left is None:
                logger.info("draining ended: training reached its last iteration before an epoch "
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
        if self.state in ("waiting", "agreeing", "training"):
            self.state = "stopped"
        if self.trainer is not None:
            await self.trainer.shutdown()
