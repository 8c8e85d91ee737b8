"""An in-process swarm: N :class:`~node.train.trainer.TrainerNode` on 127.0.0.1 in this process.

Every node gets a real hivemind ``P2P`` (its own p2pd) and ``DHT``, plus one bootstrap peer, and
trains exactly as the daemon runs it, but without daemons: the schedule is given (hand-built or
loopback-scheduled, :mod:`node.launch.schedules`) instead of coming from a coordinator, and
"alive" is a set of killed peer ids instead of advert expiry. Cheaper to start than
:class:`node.launch.process_swarm.ProcessSwarm` and steppable from a test, so the training tests,
fault-injection tests and benchmarks use it; ``skippipe up --in-process`` too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from typing import Callable, Optional, Sequence

from node.errors import UserError
from node.swarm.startup import shutdown_dht
from node.swarm.states import NodeLogger

__all__ = ["InProcessSwarm"]

logger = logging.getLogger(__name__)

#: Grace period for a p2pd or DHT process to exit before it is killed.
DHT_SHUTDOWN_TIMEOUT_S = 5.0


class InProcessSwarm:
    """A swarm of :class:`TrainerNode` on 127.0.0.1, all in this process (one p2pd + DHT each)."""

    def __init__(self, schedule: dict, config, splits=None, threads_per_node: Optional[int] = 1,
                 on_iteration: Optional[Callable] = None,
                 emulation_for: Optional[Callable[[int, Sequence[str]], object]] = None,
                 faults_for: Optional[Callable[[int], object]] = None):
        """``emulation_for(i, members)``: optional per-node :class:`node.dataplane.emulation.Emulation` (off by default).
        ``self.epoch`` may be replaced between iterations (same allocation) to switch schedules."""
        self.emulation_for = emulation_for
        #: ``faults_for(i)``: optional per-node :class:`node.train.faults.FaultInjector` (deterministic fault tests)
        self.faults_for = faults_for
        #: peer ids of nodes that were killed; stands in for the daemon's view (advert expiry) here
        self.dead: set = set()
        self.schedule, self.config, self.splits = schedule, config, splits
        self.threads_per_node = threads_per_node
        self.on_iteration = on_iteration
        self.n_nodes = sum(len(s) for s in schedule["stages"])
        self.p2ps: list = []
        self.dhts: list = []
        self.nodes: list = []
        self._bootstrap = None
        self._bootstrap_dht = None

    async def start(self) -> None:
        import torch

        from node.compat import import_hivemind
        from node.train.trainer import TrainerNode
        from protocol import ScheduleEpoch

        hivemind = import_hivemind()
        if self.threads_per_node:
            torch.set_num_threads(self.threads_per_node)
        from node.net.lifetime import install_fork_guard
        from node.net.p2pd import own_session

        install_fork_guard()  # the DHT processes forked below die with this process, even on SIGKILL
        loop = asyncio.get_running_loop()
        local = ["/ip4/127.0.0.1/tcp/0"]
        with own_session():  # and so does every p2pd
            self._bootstrap = await hivemind.p2p.P2P.create(host_maddrs=local)
        self._bootstrap_dht = await loop.run_in_executor(
            None, lambda: hivemind.DHT(p2p=self._bootstrap, start=True))
        initial = [str(a) for a in await self._bootstrap.get_visible_maddrs()]

        async def make_node():
            with own_session():
                p2p = await hivemind.p2p.P2P.create(host_maddrs=local, initial_peers=initial)
            dht = await loop.run_in_executor(None, lambda: hivemind.DHT(p2p=p2p, initial_peers=initial, start=True))
            return p2p, dht

        for _ in range(self.n_nodes):  # sequential: forking DHT processes concurrently is not faster on 2 cores
            p2p, dht = await make_node()
            self.p2ps.append(p2p)
            self.dhts.append(dht)
        maddrs = [p._visible_maddrs for p in self.p2ps]  # without the /p2p/ suffix p2pd expects
        for i, j in itertools.combinations(range(self.n_nodes), 2):
            await self.p2ps[i]._client.connect(self.p2ps[j].peer_id, maddrs[j])
        members = tuple(str(p.peer_id) for p in self.p2ps)
        self.epoch = ScheduleEpoch(self.config.run_id, 0, str(self._bootstrap.peer_id), time.time(), members,
                                   self.schedule, b"")
        for i, (p2p, dht) in enumerate(zip(self.p2ps, self.dhts)):
            node = TrainerNode(p2p=p2p, dht=dht, peer_id=members[i], epoch=lambda: self.epoch, config=self.config,
                               splits=self.splits, node_name=f"node{i}",
                               on_iteration=self.on_iteration if i == 0 else None,
                               emulation=self.emulation_for(i, members) if self.emulation_for else None,
                               alive=self.is_alive, faults=self.faults_for(i) if self.faults_for else None,
                               on_kill=lambda i=i: self._on_kill(i))
            await node.setup()
            self.nodes.append(node)
        logger.info("local swarm of %d nodes ready", self.n_nodes)
        starts = {n.current_iteration for n in self.nodes}
        if len(starts) != 1:
            raise UserError(f"checkpoints disagree on the iteration to resume from: {sorted(starts)}")

    def _log(self, node) -> NodeLogger:
        return NodeLogger(logger, node.node_name)

    @property
    def start_iteration(self) -> int:
        return self.nodes[0].current_iteration

    def is_alive(self, peer_id: str) -> bool:
        return peer_id not in self.dead

    def _on_kill(self, i: int) -> None:
        """A node died (fault injection): its p2pd goes away, so streams to it break like a dead host's."""
        self.dead.add(str(self.p2ps[i].peer_id))
        asyncio.ensure_future(self._kill_p2p(i))

    async def _kill_p2p(self, i: int) -> None:
        node = self.nodes[i] if i < len(self.nodes) else None
        if node is not None and node.dataplane.transport is not None:
            with contextlib.suppress(Exception):
                await node.dataplane.transport.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.p2ps[i].shutdown(), DHT_SHUTDOWN_TIMEOUT_S)

    def kill(self, i: int) -> None:
        """Kill node ``i`` now, mid-whatever (its trainer stops, its p2pd is shut down)."""
        self.nodes[i].kill()

    async def train(self, iterations: int):
        """Run all nodes to ``iterations`` committed iterations; returns node 0's history."""
        from node.train.trainer import NodeKilled

        async def run(n):
            try:
                return await n.run(iterations)
            except NodeKilled:
                return None

        tasks = [asyncio.create_task(run(n)) for n in self.nodes]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return results[0]

    def stage_modules(self):
        """Replica 0 of every stage, in stage order (for evaluation and comparisons)."""
        return [self.nodes[nodes[0]].runtime.module for nodes in self.schedule["stages"]]

    async def close(self) -> None:
        """Stop every node, DHT and p2pd, in parallel; a DHT child that lingers is killed."""
        t0 = time.perf_counter()

        async def stop_node(n):
            try:
                await n.shutdown()
            except Exception:
                self._log(n).exception("shutting down failed")

        await asyncio.gather(*(stop_node(n) for n in self.nodes))

        # forked DHT children may ignore SIGTERM (inherited handlers): shutdown_dht kills them
        dhts = self.dhts + ([self._bootstrap_dht] if self._bootstrap_dht else [])
        await asyncio.gather(*(shutdown_dht(d, DHT_SHUTDOWN_TIMEOUT_S) for d in dhts))
        for p in self.p2ps + ([self._bootstrap] if self._bootstrap else []):
            try:
                await asyncio.wait_for(p.shutdown(), DHT_SHUTDOWN_TIMEOUT_S)
            except Exception:
                pass
        self.nodes, self.dhts, self.p2ps = [], [], []
        self._bootstrap = self._bootstrap_dht = None
        logger.info("local swarm closed in %.1f s", time.perf_counter() - t0)

    async def __aenter__(self) -> "InProcessSwarm":
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
