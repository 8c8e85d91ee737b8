"""The microbatch pipeline of one node: hop messages in, one compute worker, hop messages out.

Every node runs one compute worker that always prefers backward work (gradients, then losses) over
forwards, and accepts a forward only while it has a free memory slot; autograd state of a
microbatch is dropped as soon as its backward ran. Messages of an iteration that has not opened
yet wait (iteration ``i+1`` is never applied before step ``i`` is committed); late ones are dropped.
Where a hop goes when its peer is gone is the route recovery's business (:mod:`node.train.recovery`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time
from typing import Callable, Deque, Dict, List, Optional, Tuple

from node.train.common import NodeKilled, NodeLog, arrival_time, mb_key
from protocol import ActivationMessage, GradientMessage, HopFailure, MicrobatchId, TensorFrame

__all__ = ["MicrobatchPipeline"]

logger = logging.getLogger(__name__)


class MicrobatchPipeline:
    """Queues, compute worker and compute calls of one trainer."""

    def __init__(self, cfg, *, peer_id: str, node_name: str, epochs, progress, resources, sender, life,
                 memory_slots: Callable[[], int], faults=None, emulated_links: bool = False):
        """``epochs``: the :class:`node.train.epochs.EpochTracker`; ``progress``, ``resources``, ``life``: the trainer's
        :class:`node.train.progress.IterationProgress`, :class:`~node.train.progress.StageResources` and
        :class:`~node.train.progress.LifeView`; ``sender``: the :class:`node.train.sender.HopSender`;
        ``memory_slots()``: forwards in flight at most; ``faults``: an optional fault injector;
        ``emulated_links``: arrival times follow the WAN emulation's delivery times. Routing a computed hop is the
        route recovery's business: :meth:`route_with` hands it over."""
        self.cfg = cfg
        self.peer_id, self.node_name = peer_id, node_name
        self.epochs, self.progress, self.resources, self.sender, self.life = epochs, progress, resources, sender, life
        self.faults = faults
        self._memory_slots = memory_slots
        self._emulated_links = emulated_links
        self.recovery = None  # node.train.recovery.RouteRecovery, see route_with
        self.log = NodeLog(logger, node_name)
        self._early: Dict[int, List[object]] = collections.defaultdict(list)
        self._grads: Deque[object] = collections.deque()
        self._returns: Deque[object] = collections.deque()
        self._forwards: Deque[object] = collections.deque()
        self.starts: Deque[Tuple[int, int, Tuple[str, ...]]] = collections.deque()
        #: data node: hedges of late microbatches, (index, attempt, route); started beyond the memory slots:
        #: a hedge stands in for a microbatch stuck elsewhere, whose slot here it would otherwise wait for
        self.hedges: Deque[Tuple[int, int, Tuple[str, ...]]] = collections.deque()
        # compute emulation: when each queued job could have started (monotonic; keyed by id of the
        # queued object), when the compute thread last finished, and the ready time of the running job
        self._ready_at: Dict[int, float] = {}
        self._free_since = 0.0
        self._job_ready_at: Optional[float] = None
        self.targets: Dict[tuple, object] = {}  # data node: microbatch key -> its targets
        self.wakeup = asyncio.Event()
        self.idle = asyncio.Event()
        self.idle.set()
        self.open = False  # the current iteration accepts microbatch work
        self.opened = -1  # the last iteration that was opened (its later messages are late, not early)
        self.overcommits = 0  # forwards admitted beyond the memory slots to break a cyclic wait
        #: attempts their data node gave up this iteration (another attempt answered first): their hops are dropped
        self._forgotten: set = set()
        #: why this node takes no more hops (it is leaving, e.g. its disk is full), or None
        self.refusing: Optional[str] = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="skippipe-compute")
        self._worker_task: Optional[asyncio.Task] = None

    def route_with(self, recovery) -> None:
        """Computed hops go out through ``recovery`` (re-routed or skipped where a peer is gone), which also
        keeps the data node's pending microbatches."""
        self.recovery = recovery

    # ------------------------------------------------------------------ intake
    def start_worker(self) -> None:
        self._worker_task = asyncio.create_task(self._worker(), name=f"trainer-worker-{self.node_name}")

    def on_hop(self, msg) -> None:
        """An activation or gradient of this run addressed to this node (the trainer dispatches)."""
        arrived = arrival_time(time.monotonic(), time.time(), msg.deliver_at_unix, self._emulated_links)
        if msg.route[msg.hop] != self.peer_id:
            self.log.warning("misrouted %s for %s", type(msg).__name__, msg.route[msg.hop][-8:])
            return
        if self.refusing is not None:
            self._refuse(msg)
            return
        it, current = msg.mb.iteration, self.progress.current
        if it > current or (it == current and it > self.opened):
            # never apply iteration i+1 before step i is committed; and between the commit and the
            # start of the next iteration (an epoch switch, a pause) its messages wait here too
            self._early[it].append(msg)
            return
        if it < current or not self.open:
            self.log.debug("dropping late %s of iteration %d", type(msg).__name__, it)
            return
        self.enqueue(msg, arrived)

    def forget(self, mb) -> None:
        """The data node of ``mb`` gave this attempt up (another one answered first): free its state and
        memory slot here, drop its queued hop, and the hops of it that still come."""
        key = mb_key(mb)
        if mb.iteration != self.progress.current or self.resources.runtime is None:
            return
        self._forgotten.add(key)
        self.resources.runtime.drop(key)
        for queue in (self._forwards, self._returns):
            for msg in [m for m in queue if mb_key(m.mb) == key]:
                queue.remove(msg)
                self._ready_at.pop(id(msg), None)
        self.wakeup.set()

    def enqueue(self, msg: object, arrived: Optional[float] = None) -> None:
        """Queue a hop message for the compute worker; ``arrived`` (monotonic, default now) is when
        its work could have started at the earliest (compute emulation counts from then)."""
        epoch = self.epochs.epoch.epoch
        if msg.mb.epoch != epoch:
            self.log.warning("dropping %s of epoch %d during epoch %d", type(msg).__name__, msg.mb.epoch, epoch)
            return
        if mb_key(msg.mb) in self._forgotten:
            return
        self._ready_at[id(msg)] = time.monotonic() if arrived is None else arrived
        if isinstance(msg, GradientMessage):
            self._grads.append(msg)
        elif msg.hop == len(msg.route) - 1:  # activation back at its data node: loss
            self._returns.append(msg)
        else:
            self._forwards.append(msg)
        self.wakeup.set()

    def release_early(self, it: int) -> None:
        """Queue what arrived for iteration ``it`` before it opened."""
        for msg in self._early.pop(it, []):
            self.enqueue(msg)
        self.wakeup.set()

    def refuse_all(self, reason: str) -> int:
        """This node leaves (``reason``): every hop queued here, and every one that still comes, is reported
        failed to its data node, which recomputes the microbatch elsewhere at once instead of waiting for
        its deadline. Returns how many queued hops were handed back."""
        self.refusing = reason
        queued = [m for early in self._early.values() for m in early]
        queued += list(self._forwards) + list(self._returns) + list(self._grads)
        self._early.clear()
        self.clear()
        for msg in queued:
            self._refuse(msg)
        return len(queued)

    def _refuse(self, msg) -> None:
        if msg.mb.data_node != self.peer_id:
            self.sender.send_control(msg.mb.data_node, HopFailure(msg.mb, msg.hop, self.peer_id, self.refusing))

    def clear(self) -> None:
        """Forget queued work of the iteration that just closed."""
        self._grads.clear(), self._returns.clear(), self._forwards.clear(), self.starts.clear(), self.hedges.clear()
        self._forgotten.clear()
        self._ready_at.clear()

    def queue_sizes(self) -> Tuple[int, int, int, int]:
        """(starts, forwards, losses, gradients) waiting for the worker."""
        return len(self.starts) + len(self.hedges), len(self._forwards), len(self._returns), len(self._grads)

    # ------------------------------------------------------------------ compute worker
    def _next_job(self):
        """Backward first, then losses, then forwards and new microbatches while slots are free."""
        runtime = self.resources.runtime
        assert runtime is not None
        if self._grads:
            return self._do_backward, self._grads.popleft()
        if self._returns:
            return self._do_loss, self._returns.popleft()
        if self.hedges:
            return self._do_start, self.hedges.popleft()
        if runtime.in_flight < self._memory_slots():
            if self._forwards:
                return self._do_forward, self._forwards.popleft()
            if self.starts:
                return self._do_start, self.starts.popleft()
        return None

    async def _worker(self) -> None:
        while not self.life.closed:
            job = self._next_job()
            if job is None:
                self.idle.set()
                self.wakeup.clear()
                if not self._forwards:
                    await self.wakeup.wait()
                    continue
                try:
                    await asyncio.wait_for(self.wakeup.wait(), self.cfg.memory_deadlock_grace_s)
                    continue
                except asyncio.TimeoutError:
                    if not self._forwards:
                        continue
                    self.log.warning("memory slots full (%d) for %.0fs with %d forwards waiting; admitting one to "
                                     "break a possible cyclic wait", self._memory_slots(),
                                     self.cfg.memory_deadlock_grace_s, len(self._forwards))
                    self.overcommits += 1
                    job = (self._do_forward, self._forwards.popleft())
            fn, arg = job
            # the job could start when its input arrived and the compute thread was free, whichever came
            # later; the time since (the host's dispatch latency) runs inside the emulated compute time
            ready = self._ready_at.pop(id(arg), None)
            self._job_ready_at = None if ready is None else max(ready, self._free_since)
            if not self.open:
                continue  # the iteration closed while this job waited: its result would be unused
            self.idle.clear()
            try:
                if await self._inject(fn, arg):
                    await fn(arg)
            except asyncio.CancelledError:
                raise
            except NodeKilled:
                return
            except Exception:
                self.log.exception("compute job failed")
            finally:
                self.idle.set()

    async def _inject(self, fn, arg) -> bool:
        """Apply a fault-injection rule to this job; False = the job is dropped."""
        if not self.faults:
            return True
        if fn == self._do_start:
            (index, attempt, _), hop, direction, it = arg, 0, "forward", self.progress.current
        else:
            index, attempt, hop, it = arg.mb.index, arg.mb.attempt, arg.hop, arg.mb.iteration
            direction = "backward" if fn in (self._do_backward,) else "forward"
        rule = self.faults.take(it, hop, direction, index, attempt)
        if rule is None:
            return True
        if rule.action == "delay":
            await asyncio.sleep(rule.delay_s)
            return True
        if rule.action == "drop":
            return False
        self.life.kill()
        raise NodeKilled(f"{self.node_name} killed by fault injection")

    def _tampered(self, iteration: int, target: str, tensor):
        """``tensor`` as a ``corrupt`` fault-injection rule makes it (rehearsing a bad member); as is without one."""
        faults = self.faults
        return faults.tamper(iteration, target, tensor) if faults else tensor

    async def compute(self, fn, *args):
        """Run ``fn`` on the one compute thread (torch work never blocks the event loop)."""
        def run():
            try:
                return fn(*args)
            finally:
                self._free_since = time.monotonic()

        return await asyncio.get_running_loop().run_in_executor(self._executor, run)

    async def _do_start(self, job) -> None:
        index, attempt, route = job
        it, epoch = self.progress.current, self.epochs.epoch.epoch
        mb = MicrobatchId(self.cfg.run_id, epoch, it, self.peer_id, index, attempt)
        key = mb_key(mb)
        runtime, shard, recovery = self.resources.runtime, self.resources.shard, self.recovery
        assert shard is not None and runtime is not None
        if not recovery.begin(index, attempt, route, time.monotonic()):
            return  # a hedge no longer needed
        inputs, targets = shard.batch(it, index)
        self.targets[key] = targets
        st = self.progress.state(it)
        if attempt == 0:
            st.tokens += targets.numel()
        ready = self._job_ready_at
        frame = await self.compute(lambda: TensorFrame.from_tensor(runtime.start(key, inputs, ready_at=ready)))
        self.sender.spawn(recovery.send_forward(ActivationMessage(mb, 1, route, frame)))

    async def _do_forward(self, msg) -> None:
        key = mb_key(msg.mb)
        runtime = self.resources.runtime
        assert runtime is not None
        ready = self._job_ready_at
        if key in self._forgotten:
            return  # given up while it waited (e.g. behind a straggling job)
        frame = await self.compute(lambda: TensorFrame.from_tensor(self._tampered(
            msg.mb.iteration, "activations", runtime.forward(key, msg.tensor.to_tensor(), ready_at=ready))))
        if key in self._forgotten:
            runtime.drop(key)
            return
        self.sender.spawn(self.recovery.send_forward(ActivationMessage(msg.mb, msg.hop + 1, msg.route, frame)))

    async def _do_loss(self, msg) -> None:
        pending = self.recovery.pending
        p = self.recovery.answered(msg.mb)  # the first attempt back wins; the others are discarded
        if p is None:
            return  # an attempt that was already given up (late), a duplicate, or one another attempt beat
        key = mb_key(msg.mb)
        targets = self.targets.pop(key)
        runtime = self.resources.runtime
        assert runtime is not None
        ready = self._job_ready_at

        def run():
            loss, grad = runtime.loss_backward(msg.tensor.to_tensor(), targets, ready_at=ready)
            return loss, TensorFrame.from_tensor(grad)

        loss, frame = await self.compute(run)
        if pending.get(msg.mb.index) is not p:
            return  # failed while the loss ran
        p.loss_done, p.route = True, tuple(msg.route)
        self.progress.state(msg.mb.iteration).losses.append(loss)
        self.sender.spawn(self.recovery.send_backward(GradientMessage(msg.mb, msg.hop - 1, msg.route, frame)))

    async def _do_backward(self, msg) -> None:
        key = mb_key(msg.mb)
        runtime = self.resources.runtime
        assert runtime is not None
        ready = self._job_ready_at
        if msg.hop > 0:
            frame = await self.compute(lambda: TensorFrame.from_tensor(self._tampered(
                msg.mb.iteration, "gradients", runtime.backward(key, msg.tensor.to_tensor(), ready_at=ready))))
            self.sender.spawn(self.recovery.send_backward(GradientMessage(msg.mb, msg.hop - 1, msg.route, frame)))
            return
        # back at the data node: backward through stage 0, the microbatch is complete
        pending = self.recovery.pending
        p = pending.get(msg.mb.index)
        if p is None or p.attempt != msg.mb.attempt:
            runtime.drop(key)
            return
        await self.compute(lambda: runtime.finish(key, msg.tensor.to_tensor(), ready_at=ready))
        if pending.get(msg.mb.index) is not p:
            return
        pending.pop(msg.mb.index, None)
        self.recovery.completed(p)
        st = self.progress.state(msg.mb.iteration)
        for peer in msg.route[:-1]:
            st.visits[peer] += 1
        self.recovery.microbatch_finished(st)

    # ------------------------------------------------------------------ shutdown
    async def close(self) -> None:
        """Stop the worker (the trainer's sender lets sends in flight finish)."""
        self.wakeup.set()
        if self._worker_task is not None:
            self._worker_task.cancel()
            try:
                await self._worker_task
            except (asyncio.CancelledError, Exception):
                pass

    def stop_compute(self) -> None:
        self._executor.shutdown(wait=True)
