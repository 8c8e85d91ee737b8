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
from typing import TYPE_CHECKING, Deque, Dict, List, Optional, Tuple

from node.train.common import NodeKilled, NodeLog, Pending, arrival_time, mb_key

if TYPE_CHECKING:
    from node.train.trainer import TrainerNode

__all__ = ["MicrobatchPipeline"]

logger = logging.getLogger(__name__)


class MicrobatchPipeline:
    """Queues, compute worker and compute calls of one :class:`TrainerNode`."""

    def __init__(self, node: "TrainerNode"):
        self.node = node
        self.cfg = node.cfg
        self.log = NodeLog(logger, node.node_name)
        self._early: Dict[int, List[object]] = collections.defaultdict(list)
        self._grads: Deque[object] = collections.deque()
        self._returns: Deque[object] = collections.deque()
        self._forwards: Deque[object] = collections.deque()
        self.starts: Deque[Tuple[int, int, Tuple[str, ...]]] = collections.deque()
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
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="skippipe-compute")
        self._worker_task: Optional[asyncio.Task] = None
        self._send_tasks: set = set()

    # ------------------------------------------------------------------ intake
    def start_worker(self) -> None:
        self._worker_task = asyncio.create_task(self._worker(), name=f"trainer-worker-{self.node.node_name}")

    def on_message(self, msg: object, sender: str) -> None:
        """Data-plane callback: every message a peer sent this node."""
        from protocol import ActivationMessage, GradientMessage, HopFailure, IterationDone, NormReport

        node = self.node
        if node.killed:
            return
        if isinstance(msg, IterationDone):
            node.on_iteration_done(msg)
            return
        if isinstance(msg, NormReport):  # the per-iteration barrier (node.train.commit)
            node.commit.on_norm_report(msg, sender)
            return
        if isinstance(msg, HopFailure):
            if msg.mb.run_id == self.cfg.run_id and msg.mb.data_node == node.peer_id:
                node.recovery.on_hop_failure(msg, sender)
            return
        if not isinstance(msg, (ActivationMessage, GradientMessage)) or msg.mb.run_id != self.cfg.run_id:
            return
        arrived = arrival_time(time.monotonic(), time.time(), msg.deliver_at_unix,
                               getattr(node.emulation, "link_emulator", None) is not None)
        if msg.route[msg.hop] != node.peer_id:
            self.log.warning("misrouted %s for %s", type(msg).__name__, msg.route[msg.hop][-8:])
            return
        it = msg.mb.iteration
        if it > node.current_iteration or (it == node.current_iteration and it > self.opened):
            # never apply iteration i+1 before step i is committed; and between the commit and the
            # start of the next iteration (an epoch switch, a pause) its messages wait here too
            self._early[it].append(msg)
            return
        if it < node.current_iteration or not self.open:
            self.log.debug("dropping late %s of iteration %d", type(msg).__name__, it)
            return
        self.enqueue(msg, arrived)

    def enqueue(self, msg: object, arrived: Optional[float] = None) -> None:
        """Queue a hop message for the compute worker; ``arrived`` (monotonic, default now) is when
        its work could have started at the earliest (compute emulation counts from then)."""
        from protocol import GradientMessage

        epoch = self.node.epoch.epoch
        if msg.mb.epoch != epoch:
            self.log.warning("dropping %s of epoch %d during epoch %d", type(msg).__name__, msg.mb.epoch, epoch)
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

    def clear(self) -> None:
        """Forget queued work of the iteration that just closed."""
        self._grads.clear(), self._returns.clear(), self._forwards.clear(), self.starts.clear()
        self._ready_at.clear()

    def queue_sizes(self) -> Tuple[int, int, int, int]:
        """(starts, forwards, losses, gradients) waiting for the worker."""
        return len(self.starts), len(self._forwards), len(self._returns), len(self._grads)

    # ------------------------------------------------------------------ sending
    def spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._send_tasks.add(task)
        task.add_done_callback(self._send_tasks.discard)

    async def try_send(self, peer: str, msg: object) -> bool:
        """Send ``msg``; a peer the send fails to is suspected (never raises)."""
        from node.dataplane.transport import DataPlaneError

        node = self.node
        if node.killed:
            return False
        try:
            await node.dataplane.send(peer, msg)
            return True
        except DataPlaneError as e:
            node.health.suspect(peer, f"send failed: {e}")
            return False
        except Exception as e:  # noqa: BLE001 - a broken peer must never break this node
            node.health.suspect(peer, f"send failed: {e!r}")
            return False

    def send_control(self, peer: str, msg: object) -> None:
        self.spawn(self.try_send(peer, msg))

    # ------------------------------------------------------------------ compute worker
    def _next_job(self):
        """Backward first, then losses, then forwards and new microbatches while slots are free."""
        runtime = self.node.runtime
        assert runtime is not None
        if self._grads:
            return self._do_backward, self._grads.popleft()
        if self._returns:
            return self._do_loss, self._returns.popleft()
        if runtime.in_flight < self.node.memory_slots:
            if self._forwards:
                return self._do_forward, self._forwards.popleft()
            if self.starts:
                return self._do_start, self.starts.popleft()
        return None

    async def _worker(self) -> None:
        while not self.node.closed:
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
                                     "break a possible cyclic wait", self.node.memory_slots,
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
        node = self.node
        if not node.faults:
            return True
        if fn == self._do_start:
            index, hop, direction, it = arg[0], 0, "forward", node.current_iteration
        else:
            index, hop, it = arg.mb.index, arg.hop, arg.mb.iteration
            direction = "backward" if fn in (self._do_backward,) else "forward"
        rule = node.faults.take(it, hop, direction, index)
        if rule is None:
            return True
        if rule.action == "delay":
            await asyncio.sleep(rule.delay_s)
            return True
        if rule.action == "drop":
            return False
        node.kill()
        raise NodeKilled(f"{node.node_name} killed by fault injection")

    def _tampered(self, iteration: int, target: str, tensor):
        """``tensor`` as a ``corrupt`` fault-injection rule makes it (rehearsing a bad member); as is without one."""
        faults = self.node.faults
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
        from protocol import ActivationMessage, MicrobatchId, TensorFrame

        node = self.node
        index, attempt, route = job
        it, epoch = node.current_iteration, node.epoch.epoch
        mb = MicrobatchId(self.cfg.run_id, epoch, it, node.peer_id, index, attempt)
        key = mb_key(mb)
        assert node.shard is not None and node.runtime is not None
        inputs, targets = node.shard.batch(it, index)
        self.targets[key] = targets
        st = node.iteration_state(it)
        if attempt == 0:
            st.tokens += targets.numel()
        now = time.monotonic()
        node.recovery.pending[index] = Pending(index, attempt, route, now + node.recovery.budget_s(route), started=now)
        ready = self._job_ready_at
        frame = await self.compute(lambda: TensorFrame.from_tensor(node.runtime.start(key, inputs, ready_at=ready)))
        self.spawn(node.recovery.send_forward(ActivationMessage(mb, 1, route, frame)))

    async def _do_forward(self, msg) -> None:
        from protocol import ActivationMessage, TensorFrame

        node = self.node
        key = mb_key(msg.mb)
        assert node.runtime is not None
        ready = self._job_ready_at
        frame = await self.compute(lambda: TensorFrame.from_tensor(self._tampered(
            msg.mb.iteration, "activations", node.runtime.forward(key, msg.tensor.to_tensor(), ready_at=ready))))
        self.spawn(node.recovery.send_forward(ActivationMessage(msg.mb, msg.hop + 1, msg.route, frame)))

    async def _do_loss(self, msg) -> None:
        from protocol import GradientMessage, TensorFrame

        node = self.node
        pending = node.recovery.pending
        p = pending.get(msg.mb.index)
        if p is None or p.attempt != msg.mb.attempt or p.loss_done:
            return  # an attempt that was already given up (late), or a duplicate
        key = mb_key(msg.mb)
        targets = self.targets.pop(key)
        assert node.runtime is not None
        ready = self._job_ready_at

        def run():
            loss, grad = node.runtime.loss_backward(msg.tensor.to_tensor(), targets, ready_at=ready)
            return loss, TensorFrame.from_tensor(grad)

        loss, frame = await self.compute(run)
        if pending.get(msg.mb.index) is not p:
            return  # failed while the loss ran
        p.loss_done, p.route = True, tuple(msg.route)
        node.iteration_state(msg.mb.iteration).losses.append(loss)
        self.spawn(node.recovery.send_backward(GradientMessage(msg.mb, msg.hop - 1, msg.route, frame)))

    async def _do_backward(self, msg) -> None:
        from protocol import GradientMessage, TensorFrame

        node = self.node
        key = mb_key(msg.mb)
        assert node.runtime is not None
        ready = self._job_ready_at
        if msg.hop > 0:
            frame = await self.compute(lambda: TensorFrame.from_tensor(self._tampered(
                msg.mb.iteration, "gradients", node.runtime.backward(key, msg.tensor.to_tensor(), ready_at=ready))))
            self.spawn(node.recovery.send_backward(GradientMessage(msg.mb, msg.hop - 1, msg.route, frame)))
            return
        # back at the data node: backward through stage 0, the microbatch is complete
        pending = node.recovery.pending
        p = pending.get(msg.mb.index)
        if p is None or p.attempt != msg.mb.attempt:
            node.runtime.drop(key)
            return
        await self.compute(lambda: node.runtime.finish(key, msg.tensor.to_tensor(), ready_at=ready))
        if pending.get(msg.mb.index) is not p:
            return
        pending.pop(msg.mb.index, None)
        st = node.iteration_state(msg.mb.iteration)
        for peer in msg.route[:-1]:
            st.visits[peer] += 1
        node.recovery.microbatch_finished(st)

    # ------------------------------------------------------------------ shutdown
    async def close(self) -> None:
        """Stop the worker, let sends in flight finish (bounded), stop the compute thread."""
        self.wakeup.set()
        if self._worker_task is not None:
            self._worker_task.cancel()
            try:
                await self._worker_task
            except (asyncio.CancelledError, Exception):
                pass
        if self._send_tasks:
            await asyncio.wait(list(self._send_tasks), timeout=5)

    def stop_compute(self) -> None:
        self._executor.shutdown(wait=True)
