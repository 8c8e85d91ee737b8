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

from node.averaging import AveragingConfig, StageAverager, averager_prefix
from node.checkpoint import CheckpointStore
from node.data import DataConfig, DataShard, TokenSplits, load_splits
from node.errors import UserError
from node.model import MODEL_SIZES, ModelConfig, build_stage
from node.stage_runtime import OptimConfig, StageRuntime, clip_coefficient

__all__ = [
    "TrainerConfig",
    "IterationStats",
    "SchedulePlan",
    "TrainerNode",
    "TrainingStalled",
    "TrainerService",
    "TrainingDisagreement",
    "training_summary",
    "start_key",
    "norm_key",
]

logger = logging.getLogger(__name__)

EpochSource = Union["ScheduleEpoch", Callable[[], "ScheduleEpoch"]]  # noqa: F821


class TrainingStalled(RuntimeError):
    """An iteration could not complete in time (a peer is gone; recovery is issue #6)."""


@dataclass(frozen=True)
class TrainerConfig:
    run_id: str = "skippipe"
    model: ModelConfig = MODEL_SIZES["tiny"]
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()
    averaging: AveragingConfig = AveragingConfig()
    seed: int = 0  # model initialisation; the data seed is ``data.seed``
    device: str = "cpu"
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 10  # iterations; 0 = only on clean shutdown
    resume: bool = False
    memory_slots: Optional[int] = None  # in-flight microbatches per node; default: the schedule's
    #: a forward blocked by full memory slots this long with nothing else to do is admitted anyway:
    #: reordered paths can form a cycle of full nodes waiting on each other (see docs/training.md)
    memory_deadlock_grace_s: float = 5.0
    iteration_timeout_s: float = 600.0
    norm_exchange_timeout_s: float = 120.0
    norm_poll_s: float = 0.02
    norm_record_ttl_s: float = 300.0


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


MbKey = Tuple[str, int, int, int]  # (data node peer id, epoch, iteration, index)


@dataclass
class _IterationState:
    done: Dict[str, object] = field(default_factory=dict)  # data node peer id -> IterationDone
    all_done: asyncio.Event = field(default_factory=asyncio.Event)
    # data-node side
    remaining: int = 0
    losses: List[float] = field(default_factory=list)
    visits: Dict[str, int] = field(default_factory=collections.Counter)
    tokens: int = 0


class TrainerNode:
    """Trains one stage replica (or one data node) of the swarm; see the module docstring."""

    def __init__(self, *, p2p, dht, peer_id: str, epoch: EpochSource, config: TrainerConfig,
                 splits: Optional[TokenSplits] = None, node_name: Optional[str] = None,
                 on_iteration: Optional[Callable[[IterationStats], None]] = None, emulation=None):
        self.p2p, self.dht, self.peer_id = p2p, dht, str(peer_id)
        self.emulation = emulation  # optional node.link_emulation.Emulation (WAN/compute emulation); None = off
        self._epoch_source = epoch
        self.cfg = config
        self._splits = splits
        self.node_name = node_name or self.peer_id
        self.on_iteration = on_iteration
        self.runtime: Optional[StageRuntime] = None
        self.averager: Optional[StageAverager] = None
        self.dataplane = None
        self.shard: Optional[DataShard] = None
        self.checkpoints: Optional[CheckpointStore] = None
        self.history: List[IterationStats] = []
        self.committed_iteration = -1
        self.current_iteration = -1
        self._last_saved = -1
        self._iters: Dict[int, _IterationState] = {}
        self._early: Dict[int, List[object]] = collections.defaultdict(list)
        self._grads: Deque[object] = collections.deque()
        self._returns: Deque[object] = collections.deque()
        self._forwards: Deque[object] = collections.deque()
        self._starts: Deque[int] = collections.deque()
        self._targets: Dict[MbKey, torch.Tensor] = {}
        self._wakeup = asyncio.Event()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="skippipe-compute")
        self._worker_task: Optional[asyncio.Task] = None
        self._send_tasks: set = set()
        self._failures: List[BaseException] = []
        self.overcommits = 0  # forwards admitted beyond the memory slots to break a cyclic wait
        self._stop_requested = False
        self._closed = False

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

    @property
    def stage(self) -> int:
        return self.plan.stage_of[self.index]

    @property
    def is_data_node(self) -> bool:
        return self.stage == 0

    async def setup(self) -> None:
        """Build the stage, restore a checkpoint, start averager and data plane.

        Must run on the main thread's event loop (the averager forks and installs signal handlers).
        """
        from node.dataplane import DataPlane

        self._bind_epoch(self._current_epoch())
        module = build_stage(self.cfg.model, self.stage, self.cfg.seed)
        self.runtime = StageRuntime(module, self.cfg.optim, self.cfg.device,
                                    padder=getattr(self.emulation, "padder", None))
        if self.cfg.checkpoint_dir:
            self.checkpoints = CheckpointStore(self.cfg.checkpoint_dir, self.cfg.run_id, self.stage, self.node_name)
            if self.cfg.resume:
                ckpt = self.checkpoints.load()
                if ckpt is not None:
                    self.runtime.load_state_dict(ckpt.state)
                    self.committed_iteration = self._last_saved = ckpt.iteration
                    logger.info("%s resumed stage %d at iteration %d", self.node_name, self.stage, ckpt.iteration)
        self.current_iteration = self.committed_iteration + 1
        if self.is_data_node:
            splits = self._splits if self._splits is not None else load_splits(self.cfg.data)
            if splits.vocab_size > self.cfg.model.vocab_size:
                raise UserError(f"tokenizer vocab {splits.vocab_size} exceeds model vocab {self.cfg.model.vocab_size}")
            self.shard = DataShard(splits, self.cfg.data, self.plan.data_nodes.index(self.index),
                                   len(self.plan.data_nodes))
        await self._build_averager()
        self.dataplane = DataPlane(self.p2p, self.cfg.run_id, self._on_message,
                                   emulator=getattr(self.emulation, "link_emulator", None))
        await self.dataplane.start()
        self._worker_task = asyncio.create_task(self._worker(), name=f"trainer-worker-{self.node_name}")

    async def _build_averager(self) -> None:
        if self.averager is not None:
            self.averager.shutdown()
            self.averager = None
        group = self.plan.replicas(self.stage)
        if len(group) > 1:
            assert self.runtime is not None
            self.averager = StageAverager(
                self.dht, self.runtime.grads(), prefix=averager_prefix(self.cfg.run_id, self.stage, self.epoch.epoch),
                group_size=len(group), cfg=self.cfg.averaging)
            await self.averager.start()

    async def _maybe_switch_epoch(self) -> None:
        """Apply a new schedule epoch at an iteration boundary (same stage only)."""
        epoch = self._current_epoch()
        if epoch.epoch == self.epoch.epoch:
            return
        old_stage = self.stage
        self._bind_epoch(epoch)
        if self.stage != old_stage:
            raise UserError(f"epoch {epoch.epoch} moves this node from stage {old_stage} to {self.stage}; "
                            "changing stage needs a state transfer (not supported yet)")
        if self.is_data_node:
            assert self.shard is not None
            self.shard = DataShard(self._splits or load_splits(self.cfg.data), self.cfg.data,
                                   self.plan.data_nodes.index(self.index), len(self.plan.data_nodes))
        await self._build_averager()
        logger.info("%s switched to schedule epoch %d", self.node_name, epoch.epoch)

    # ------------------------------------------------------------------ messages
    def _state(self, iteration: int) -> _IterationState:
        if iteration not in self._iters:
            self._iters[iteration] = _IterationState()
        return self._iters[iteration]

    def _on_message(self, msg: object, sender: str) -> None:
        from protocol import ActivationMessage, GradientMessage, HopFailure, IterationDone

        if isinstance(msg, IterationDone):
            if msg.run_id != self.cfg.run_id or msg.iteration <= self.committed_iteration:
                return
            st = self._state(msg.iteration)
            st.done[msg.data_node] = msg
            if all(p in st.done for p in self.data_node_peers):
                st.all_done.set()
            return
        if isinstance(msg, HopFailure):
            logger.warning("%s: hop failure reported for %s at hop %d: %s", self.node_name, msg.mb, msg.hop, msg.reason)
            return
        if not isinstance(msg, (ActivationMessage, GradientMessage)) or msg.mb.run_id != self.cfg.run_id:
            return
        if msg.route[msg.hop] != self.peer_id:
            logger.warning("%s: misrouted %s for %s", self.node_name, type(msg).__name__, msg.route[msg.hop][-8:])
            return
        it = msg.mb.iteration
        if it > self.current_iteration:
            self._early[it].append(msg)  # never apply iteration i+1 before step i is committed
            return
        if it < self.current_iteration:
            logger.warning("%s: dropping stale %s of iteration %d", self.node_name, type(msg).__name__, it)
            return
        self._enqueue(msg)

    def _enqueue(self, msg: object) -> None:
        from protocol import GradientMessage

        if isinstance(msg, GradientMessage):
            self._grads.append(msg)
        elif msg.hop == len(msg.route) - 1:  # activation back at its data node: loss
            self._returns.append(msg)
        else:
            self._forwards.append(msg)
        self._wakeup.set()

    def _spawn_send(self, peer: str, msg: object) -> None:
        async def send() -> None:
            try:
                await self.dataplane.send(peer, msg)
            except Exception as e:  # recovery (HopFailure, rerouting) is issue #6
                logger.error("%s: %s", self.node_name, e)
                self._failures.append(e)

        task = asyncio.create_task(send())
        self._send_tasks.add(task)
        task.add_done_callback(self._send_tasks.discard)

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
                self._wakeup.clear()
                if not self._forwards:
                    await self._wakeup.wait()
                    continue
                try:
                    await asyncio.wait_for(self._wakeup.wait(), self.cfg.memory_deadlock_grace_s)
                    continue
                except asyncio.TimeoutError:
                    logger.warning("%s: memory slots full (%d) for %.0fs with %d forwards waiting; admitting one "
                                   "to break a possible cyclic wait", self.node_name, self.memory_slots,
                                   self.cfg.memory_deadlock_grace_s, len(self._forwards))
                    self.overcommits += 1
                    job = (self._do_forward, self._forwards.popleft())
            fn, arg = job
            try:
                await fn(arg)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                logger.exception("%s: compute job failed", self.node_name)
                self._failures.append(e)

    async def _compute(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _key(self, mb) -> MbKey:
        return (mb.data_node, mb.epoch, mb.iteration, mb.index)

    async def _do_start(self, index: int) -> None:
        from protocol import ActivationMessage, MicrobatchId, TensorFrame

        it, epoch = self.current_iteration, self.epoch.epoch
        route = self._routes[index]
        peers = tuple(self.members[n] for n in route) + (self.peer_id,)
        mb = MicrobatchId(self.cfg.run_id, epoch, it, self.peer_id, index)
        key = self._key(mb)
        assert self.shard is not None and self.runtime is not None
        inputs, targets = self.shard.batch(it, index)
        self._targets[key] = targets
        st = self._state(it)
        st.tokens += targets.numel()
        frame = await self._compute(lambda: TensorFrame.from_tensor(self.runtime.start(key, inputs)))
        self._spawn_send(peers[1], ActivationMessage(mb, 1, peers, frame))

    async def _do_forward(self, msg) -> None:
        from protocol import ActivationMessage, TensorFrame

        key = self._key(msg.mb)
        assert self.runtime is not None
        frame = await self._compute(lambda: TensorFrame.from_tensor(self.runtime.forward(key, msg.tensor.to_tensor())))
        self._spawn_send(msg.route[msg.hop + 1], ActivationMessage(msg.mb, msg.hop + 1, msg.route, frame))

    async def _do_loss(self, msg) -> None:
        from protocol import GradientMessage, TensorFrame

        key = self._key(msg.mb)
        targets = self._targets.pop(key)
        assert self.runtime is not None

        def run():
            loss, grad = self.runtime.loss_backward(msg.tensor.to_tensor(), targets)
            return loss, TensorFrame.from_tensor(grad)

        loss, frame = await self._compute(run)
        self._state(msg.mb.iteration).losses.append(loss)
        self._spawn_send(msg.route[msg.hop - 1], GradientMessage(msg.mb, msg.hop - 1, msg.route, frame))

    async def _do_backward(self, msg) -> None:
        from protocol import GradientMessage, IterationDone, TensorFrame

        key = self._key(msg.mb)
        assert self.runtime is not None
        if msg.hop > 0:
            frame = await self._compute(
                lambda: TensorFrame.from_tensor(self.runtime.backward(key, msg.tensor.to_tensor())))
            self._spawn_send(msg.route[msg.hop - 1], GradientMessage(msg.mb, msg.hop - 1, msg.route, frame))
            return
        # back at the data node: backward through stage 0, the microbatch is complete
        await self._compute(lambda: self.runtime.finish(key, msg.tensor.to_tensor()))
        st = self._state(msg.mb.iteration)
        for peer in msg.route[:-1]:
            st.visits[peer] += 1
        st.remaining -= 1
        self._wakeup.set()
        if st.remaining == 0:
            done = IterationDone(self.cfg.run_id, self.epoch.epoch, msg.mb.iteration, self.peer_id,
                                 dict(st.visits), 0)
            for peer in self.members:
                self._spawn_send(peer, done)

    # ------------------------------------------------------------------ iteration
    async def run_iteration(self) -> IterationStats:
        """Run and commit iteration ``self.current_iteration``."""
        if self._closed:
            raise RuntimeError("trainer is shut down")
        await self._maybe_switch_epoch()
        it = self.current_iteration
        t0 = time.perf_counter()
        st = self._state(it)
        if self.is_data_node:
            self._routes = self.plan.routes_for(self.index)
            st.remaining = len(self._routes)
            if st.remaining == 0:
                from protocol import IterationDone

                for peer in self.members:
                    self._spawn_send(peer, IterationDone(self.cfg.run_id, self.epoch.epoch, it, self.peer_id, {}, 0))
            self._starts.extend(range(len(self._routes)))
        for msg in self._early.pop(it, []):
            self._enqueue(msg)
        self._wakeup.set()

        try:
            await asyncio.wait_for(st.all_done.wait(), self.cfg.iteration_timeout_s)
        except asyncio.TimeoutError:
            missing = [p[-8:] for p in self.data_node_peers if p not in st.done]
            raise TrainingStalled(f"{self.node_name}: iteration {it} incomplete after "
                                  f"{self.cfg.iteration_timeout_s:.0f}s; no IterationDone from {missing}")
        if self._failures:
            raise TrainingStalled(f"{self.node_name}: iteration {it} had failures: {self._failures[0]!r}")
        assert self.runtime is not None
        expected = sum(d.visits.get(self.peer_id, 0) for d in st.done.values())
        if expected != self.runtime.visits:
            logger.warning("%s: processed %d microbatches, data nodes report %d", self.node_name,
                           self.runtime.visits, expected)

        t_mb = time.perf_counter()
        averaged = await self._average(st)
        t_avg = time.perf_counter()
        loss_sum = float(sum(st.losses))
        record = {"stage": self.stage, "sq": self.runtime.grad_squared_norm(), "loss_sum": loss_sum,
                  "n_mb": len(st.losses), "tokens": st.tokens if self.is_data_node else 0}
        records = await self._exchange_norms(it, record)
        total_sq = self._global_squared_norm(records)
        coef = clip_coefficient(total_sq, self.cfg.optim.clip_norm)
        t_norm = time.perf_counter()

        def step() -> None:
            self.runtime.scale_grads(coef)
            self.runtime.step()

        await self._compute(step)
        self.committed_iteration = it
        self.current_iteration = it + 1
        del self._iters[it]
        n_mb = sum(int(r.get("n_mb", 0)) for r in records.values())
        stats = IterationStats(
            iteration=it, epoch=self.epoch.epoch,
            loss=sum(float(r.get("loss_sum", 0.0)) for r in records.values()) / max(n_mb, 1),
            microbatches=n_mb, tokens=sum(int(r.get("tokens", 0)) for r in records.values()),
            seconds=time.perf_counter() - t0, grad_norm=math.sqrt(total_sq), clip_coef=coef,
            active_nodes=len(records), local_visits=expected, averaged=averaged,
            microbatch_s=t_mb - t0, averaging_s=t_avg - t_mb, norm_exchange_s=t_norm - t_avg,
            step_s=time.perf_counter() - t_norm)
        self.history.append(stats)
        if self.checkpoints and self.cfg.checkpoint_every > 0 and (it + 1) % self.cfg.checkpoint_every == 0:
            await self.save_checkpoint()
        if self.on_iteration is not None:
            self.on_iteration(stats)
        return stats

    async def _average(self, st: _IterationState) -> Optional[bool]:
        assert self.runtime is not None
        group = [self.members[n] for n in self.plan.replicas(self.stage)]
        group_visits = sum(d.visits.get(p, 0) for d in st.done.values() for p in group)
        self.runtime.mean_grads()
        if self.averager is None or group_visits == 0:
            return None
        ok = await self.averager.average(self.runtime.grads(), weight=float(self.runtime.visits))
        if not ok:
            # replicas may now differ; the checksum re-sync of issue #6 repairs that
            logger.warning("%s: stage %d averaging failed; stepping with the local mean gradient",
                           self.node_name, self.stage)
        return ok

    async def _exchange_norms(self, it: int, record: dict) -> Dict[str, dict]:
        from node.compat import import_hivemind

        import_hivemind()
        from hivemind.utils import get_dht_time
        key = norm_key(self.cfg.run_id, it)
        await self.dht.store(key, record, expiration_time=get_dht_time() + self.cfg.norm_record_ttl_s,
                             subkey=self.peer_id, return_future=True)
        deadline = time.monotonic() + self.cfg.norm_exchange_timeout_s
        found: Dict[str, dict] = {}
        while True:
            res = await self.dht.get(key, latest=True, return_future=True)
            if res is not None and isinstance(res.value, dict):
                found = {str(k): v.value for k, v in res.value.items() if str(k) in self.members}
            if len(found) == len(self.members):
                return found
            if time.monotonic() > deadline:
                missing = [p[-8:] for p in self.members if p not in found]
                raise TrainingStalled(f"{self.node_name}: no gradient norm from {missing} for iteration {it}")
            await asyncio.sleep(self.cfg.norm_poll_s)

    def _global_squared_norm(self, records: Dict[str, dict]) -> float:
        per_stage: Dict[int, Tuple[str, float]] = {}
        for peer, r in records.items():
            s = int(r["stage"])
            if s not in per_stage or peer < per_stage[s][0]:
                per_stage[s] = (peer, float(r["sq"]))
        return sum(sq for _, sq in per_stage.values())

    async def run(self, iterations: int, stop_event: Optional[asyncio.Event] = None) -> List[IterationStats]:
        """Train until ``iterations`` iterations are committed in total (resume counts earlier ones)."""
        out = []
        while self.current_iteration < iterations and not self._stop_requested:
            if stop_event is not None and stop_event.is_set():
                break
            out.append(await self.run_iteration())
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
        if self._closed:
            return
        await self.save_checkpoint()
        self._closed = True
        self._wakeup.set()
        if self._worker_task is not None:
            self._worker_task.cancel()
            try:
                await self._worker_task
            except (asyncio.CancelledError, Exception):
                pass
        if self._send_tasks:
            await asyncio.wait(list(self._send_tasks), timeout=5)
        if self.dataplane is not None:
            await self.dataplane.close()
        if self.averager is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.averager.shutdown)
            self.averager = None
        self._executor.shutdown(wait=True)


#: DHT key (one subkey per member) under which every trainer confirms the epoch it trains on.
def start_key(run_id: str) -> str:
    return f"{run_id}:trainstart"


def training_summary(config: TrainerConfig, iterations: int) -> dict:
    """The hyper-parameters every member of a run must share (compared before training starts)."""
    from dataclasses import asdict

    return {"model": config.model.to_dict(), "optim": asdict(config.optim), "data": asdict(config.data),
            "averaging": asdict(config.averaging), "seed": config.seed, "iterations": int(iterations),
            "memory_slots": config.memory_slots}


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
                 agreement_timeout_s: float = 600.0, threads: Optional[int] = None, emulation=None):
        self.emulation = emulation  # optional node.emulation_args.EmulationSettings (peer locations: daemon view)
        self.config, self.iterations = config, iterations
        self.node_name, self.on_iteration, self.poll_s = node_name, on_iteration, poll_s
        self.min_members, self.start_debounce_s = max(1, int(min_members)), start_debounce_s
        self.agreement_timeout_s, self.threads = agreement_timeout_s, threads
        self.trainer: Optional[TrainerNode] = None
        self.stop_timeout_s = 6.0  # how long stop() lets the current iteration finish (the daemon allows 10 s)
        self.done = asyncio.Event()
        self.error: Optional[BaseException] = None
        self.state = "waiting"
        self.epoch = None  # the pinned ScheduleEpoch
        self.start_iteration: Optional[int] = None
        self.daemon = None
        self._task: Optional[asyncio.Task] = None

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
        self._task = asyncio.create_task(self._main(daemon), name="trainer-service")

    @property
    def debounce_s(self) -> float:
        if self.start_debounce_s is not None:
            return self.start_debounce_s
        hb = getattr(getattr(self.daemon, "config", None), "heartbeat_s", 1.0)
        return 3.0 * float(hb)

    async def _choose_epoch(self, daemon):
        me = str(daemon.peer_id)
        seen, since, said = None, time.monotonic(), None
        while True:
            epoch = daemon.current_epoch
            number = epoch.epoch if epoch is not None else None
            if number != seen:
                seen, since = number, time.monotonic()
            if epoch is not None and me in epoch.members and len(epoch.members) >= self.min_members:
                if time.monotonic() - since >= self.debounce_s:
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
            self.epoch, self.state = epoch, "agreeing"
            logger.info("training pins schedule epoch %d (%d members)", epoch.epoch, len(epoch.members))
            for peer in epoch.members:
                if peer != str(daemon.peer_id) and not await daemon.ensure_connected(peer):
                    logger.warning("cannot connect to schedule member %s yet", peer[-8:])
            self.trainer = TrainerNode(p2p=daemon.p2p, dht=daemon.dht, peer_id=str(daemon.peer_id), epoch=epoch,
                                       config=self.config, node_name=self.node_name, on_iteration=self._on_iteration,
                                       emulation=self._emulation(daemon))
            await self.trainer.setup()
            self.start_iteration = self.trainer.current_iteration
            await self._confirm(epoch, training_summary(self.config, self.iterations), self.start_iteration)
            self.state = "training"
            logger.info("training stage %d from iteration %d to %d", self.trainer.stage, self.start_iteration,
                        self.iterations)
            await self.trainer.run(self.iterations)
            await self.trainer.save_checkpoint()
            self.state = "done" if self.trainer.current_iteration >= self.iterations else "stopped"
            logger.info("training %s at iteration %d", self.state, self.trainer.committed_iteration)
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

    def _emulation(self, daemon):
        if self.emulation is None:
            return None
        from node.emulation_args import daemon_peer_locations

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
        return {
            "peer_id": str(getattr(self.daemon, "peer_id", "")),
            "node_name": self.node_name,
            "state": self.state,
            "error": str(self.error) if self.error is not None else None,
            "epoch": self.epoch.epoch if self.epoch is not None else None,
            "members": len(self.epoch.members) if self.epoch is not None else None,
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
        if self.trainer is not None:
            self.trainer.request_stop()
        if self._task is not None and not self._task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout=self.stop_timeout_s)
            except (asyncio.TimeoutError, Exception):
                self._task.cancel()
                with contextlib.suppress(BaseException):
                    await self._task
        if self.state in ("waiting", "agreeing", "training"):
            self.state = "stopped"
        if self.trainer is not None:
            await self.trainer.shutdown()
