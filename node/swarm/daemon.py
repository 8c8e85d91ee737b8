"""The node daemon: one asyncio (uvloop) process per volunteer machine.

Start-up order matters and is chosen so that failures surface early and clearly:

1. lock the identity (a second daemon with the same key fails at once), check ports are free;
2. measure compute speed (a small torch matmul);
3. ``hivemind.P2P`` (our p2pd) with the RSA identity; bootstrapping to ``--initial-peers`` here
   turns an unreachable peer into an immediate error;
4. RPC (libp2p handler + local HTTP) and the link-probe handler;
5. ``hello`` handshake with an initial peer: refuses a wrong run id, protocol version or training
   configuration (before announcing anything), and fetches the founder's run configuration;
6. ``hivemind.DHT(p2p=...)`` built in an executor (its constructor blocks for seconds), sharing
   our p2pd, with the signature + content record validators;
7. py-libp2p gossip in trio guest mode, peers found through the DHT adverts;
8. heartbeat loop: re-announce adverts (JOINING, then ONLINE), refresh the view, keep gossip
   connections, let the coordinator issue or adopt epochs; link probes on their own loop.

Shutdown is the reverse, announcing DRAINING and then OFFLINE so peers drop us at once.

The :class:`Daemon` composes collaborators with one job each, which :mod:`node.swarm.wiring` hands their inputs:
:mod:`node.swarm.startup` (ports, p2pd, DHT), :mod:`node.swarm.handshake` (run configuration and stage choice),
:class:`~node.swarm.membership.Membership` (heartbeat and view loops, gossip dispatch),
:class:`~node.swarm.gossip_access.GossipAccessControl`, :class:`~node.swarm.link_prober.LinkProber`
and :class:`~node.swarm.rpc_api.DaemonRpcApi` (the built-in RPC handlers).

Trainer integration: pass ``services=[...]`` objects with ``async start(daemon)`` and
``async stop()``; they start after the control plane is up and stop before it goes down. Use
:attr:`Daemon.p2p`, :attr:`Daemon.dht`, :attr:`Daemon.view`, :attr:`Daemon.current_epoch`,
:attr:`Daemon.run` (the run configuration), :meth:`Daemon.add_p2p_handler`,
:meth:`Daemon.register_rpc`, :attr:`Daemon.on_schedule_epoch` and :attr:`Daemon.epoch_changed`;
report training progress through :attr:`Daemon.metrics` (:class:`node.ops.metrics.NodeMetrics`)
and drop data-plane traffic from peers that fail :meth:`Daemon.is_peer_allowed` (swarm key /
allowlist, :mod:`node.net.access`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Protocol, Sequence

import node.compat  # noqa: F401  (protobuf shim before hivemind)
from hivemind import DHT
from hivemind.p2p import P2P, PeerID
from multiaddr import Multiaddr

from node.dataplane.relay import serves_relay
from node.errors import UserError
from node.net.access import SwarmAccess, load_allowlist, load_swarm_key
from node.net.identity import IdentityLock, NodeIdentity, load_or_create_gossip_key, load_or_create_identity, verify_rsa_signature
from node.net.ratelimit import PeerRateLimiter
from node.net.rpc import RpcServer
from node.ops.join_command import join_lines_for_daemon
from node.ops.looplag import LoopLagProbe
from node.ops.metrics import NodeMetrics
from node.swarm import startup
from node.net.records import sign_records
from node.swarm.adverts import AdvertStore, make_record_validators
from node.swarm.config import DaemonConfig
from node.swarm.coordinator import DEFAULT_BANDWIDTH_Bps, Coordinator, RunConfig
from node.swarm.gossip import GossipService
from node.swarm.gossip_access import GossipAccessControl
from node.swarm.handshake import choose_stages, complete_the_view, founding_run_config, handshake, services_summary
from node.net.ping import PING_PROTOCOL, PingHandler
from node.net.runconfig import summary_digest
from node.swarm.admission import Admission
from node.swarm.link_prober import PROBE_TIMEOUT_S, LinkProber
from node.swarm.membership import Membership
from node.swarm.reachability_watch import ReachabilityWatch
from node.swarm.rpc_api import members_only
from node.swarm.wiring import admission_of, coordinator_of, membership_parts, move_to_stage, rpc_api_of
from node.swarm.startup import measure_compute_speed
from node.swarm.states import NodeLogger, NodeState, Phase
from node.swarm.view import SwarmView
from protocol.limits import MAX_MEASURED_COMPUTE_S
from protocol.messages import ScheduleEpoch, StageAdvert
from protocol.version import PROTOCOL_VERSION

__all__ = ["Daemon", "DaemonService", "run_daemon", "measure_compute_speed", "PING_PROTOCOL"]

logger = logging.getLogger(__name__)

#: Seconds a DRAINING node waits so peers see the state before it leaves.
DRAIN_GRACE_S = 0.5
#: How long a service gets to stop unless it says otherwise (``stop_timeout_s``).
SERVICE_STOP_TIMEOUT_S = 10.0
#: Seconds each goodbye (the DRAINING and OFFLINE adverts) may take on the way out.
GOODBYE_TIMEOUT_S = 2.0


class DaemonService(Protocol):
    """Something that runs inside the daemon (e.g. the trainer)."""

    async def start(self, daemon: "Daemon") -> None: ...

    async def stop(self) -> None: ...


def measured_compute_of(hook: Callable[[], float | None] | None, log) -> float | None:
    """A training service's measured compute speed, bounded as the advert's validation wants (None when it has
    none, or a value an advert cannot carry: the start-up figure then serves)."""
    try:
        value = hook() if hook is not None else None
    except Exception:  # noqa: BLE001 - a broken hook must not stop the heartbeat
        log.debug("measured compute hook failed", exc_info=True)
        return None
    if value is None or not 0 < float(value) <= MAX_MEASURED_COMPUTE_S:
        return None
    return float(value)


class Daemon:
    """One node of the swarm. Create, ``await start()``, ``await wait_stopped()``, ``await stop()``."""

    def __init__(self, config: DaemonConfig, services: Sequence[DaemonService] = ()):
        self.config = config
        self.reachability = ReachabilityWatch()  # a service: learns how others reach us, keeps learning
        self.services: list[DaemonService] = [self.reachability, *services]
        self.log = NodeLogger(logger)
        self.identity: NodeIdentity | None = None
        self.peer_id: str = ""
        self.p2p: P2P | None = None
        self.dht: DHT | None = None
        self.gossip: GossipService | None = None
        self.metrics = NodeMetrics()
        self.loop_lag = LoopLagProbe(on_sample=self.metrics.set_loop_lag)
        self.access = SwarmAccess()
        self.rpc = RpcServer(
            p2p_limiter=PeerRateLimiter(config.rpc_rate_per_s, config.rpc_burst),
            http_limiter=PeerRateLimiter(config.http_rate_per_s, config.http_burst),
            on_request=self.metrics.count_rpc)
        self.view: SwarmView | None = None
        self.adverts: AdvertStore | None = None
        self.coordinator: Coordinator | None = None
        #: The run configuration (stages, path length, ...): the founder's, or the one hello returned.
        self.run: RunConfig | None = None
        self.stages: tuple[int, ...] = ()
        #: What this node trains (a service's ``run_summary(run)``; None: nothing) and its digest (in adverts)
        self.training_summary: dict | None = None
        self.config_digest = ""
        #: Who has earned a place in an epoch (challenges, silent members; :mod:`node.swarm.admission`).
        self.admission: Admission | None = None
        self.state = NodeState.JOINING
        #: why a service could not go on (:meth:`report_failure`); None while all is well
        self.failure: str | None = None
        self.phase = Phase.CREATED
        self.compute_s_per_sample_per_layer = 0.0
        self.maddrs: list[str] = []
        #: Called with each adopted ScheduleEpoch (sync functions or coroutines).
        self.on_schedule_epoch: list[Callable[[ScheduleEpoch], Any]] = []
        #: Set whenever a new epoch is adopted; consumers clear it after reading current_epoch.
        self.epoch_changed = asyncio.Event()
        #: Set by a training service: the first iteration a new schedule epoch may start at, the iteration it last
        #: committed (None while not training), why this node must not coordinate right now (None: nothing against it),
        #: whether it can train if named (False after a join that found its stage's replicas disagreeing), and its
        #: compute speed measured while training (None: not yet), its stage probe sketch of a stage it holds.
        self.training_progress: Callable[[float], int | None] | None = None
        self.training_iteration: Callable[[], int | None] | None = None
        self.coordination_blocker: Callable[[], str | None] | None = None
        self.training_ready: Callable[[], bool] | None = None
        self.measured_compute: Callable[[], float | None] | None = None
        self.training_sketch: Callable[[int, bytes], Awaitable[list | None]] | None = None
        self.started_at = time.time()
        self.gossip_access = GossipAccessControl(lambda: self.access, lambda: self.view, self.is_peer_allowed,
                                                 self.metrics, self.log)
        self.membership = Membership(config, self.log, self.metrics, self.gossip_access, self.advert,
                                     state=lambda: self.state, go_online=self._go_online)
        self.rpc_api = rpc_api_of(self)
        self.prober: LinkProber | None = None
        self._lock = IdentityLock(config.identity_path)
        self._initial_ids: list[PeerID] = []
        self._tasks: list[asyncio.Task] = []
        self._stopped = asyncio.Event()

    # ------------------------------------------------------------------ public API
    @property
    def current_epoch(self) -> ScheduleEpoch | None:
        return self.coordinator.current if self.coordinator is not None else None

    @property
    def protocol_version(self) -> int:
        return self.config.protocol_version if self.config.protocol_version is not None else PROTOCOL_VERSION

    @property
    def gossip_dropped_from(self):
        """Gossip messages dropped by access control, per sending gossip id (bounded)."""
        return self.gossip_access.dropped_from

    def is_peer_allowed(self, peer_id: str) -> bool:
        """May ``peer_id`` (p2pd peer id, base58) talk to us? Call it on every inbound data-plane stream.

        Open swarm: always True. With an allowlist the peer must be listed; with a swarm key it
        must also have an advert in our view (only adverts with a valid swarm-key proof get
        there). Cheap (dictionary lookups), so it can run per stream or per message.
        """
        if peer_id == self.peer_id:
            return True
        if not self.access.listed(peer_id):
            return False
        return self.access.swarm_key is None or (self.view is not None and self.view.get(peer_id) is not None)

    def register_rpc(self, name: str, method: Callable[[dict], Awaitable[Any]]) -> None:
        """Expose ``method(params)`` over libp2p and local HTTP RPC (members only over libp2p in a
        private swarm, see :mod:`node.swarm.rpc_api`)."""
        self.rpc.register(name, members_only(self, name, method))

    async def add_p2p_handler(self, name: str, handler) -> None:
        """Register a hivemind binary stream handler ``handler(stream_info, reader, writer)``."""
        await self.p2p.add_binary_stream_handler(name, handler)

    async def ensure_connected(self, peer_id: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
        """Make p2pd connect to ``peer_id`` through the maddrs of its advert.

        Uses hivemind's p2pd client directly (``P2P._client``: ``P2P`` has no public connect). A peer already
        connected counts without an advert in our view (p2pd's connect returns at once). False: unreachable.
        """
        if self.p2p is None:
            return False
        entry = self.view.get(peer_id) if self.view is not None else None
        addrs = [Multiaddr(m.split("/p2p/")[0]) for m in entry.advert.maddrs] if entry is not None else []
        try:
            await asyncio.wait_for(self.p2p._client.connect(PeerID.from_base58(peer_id), addrs), timeout)
            return True
        except Exception as e:  # noqa: BLE001 - unreachable peers are routine
            self.log.debug("connect to %s failed: %r", peer_id, e)
            return False

    async def probe_link(self, peer_id: str) -> tuple[float, float | None]:
        """(min RTT in ms, bandwidth in bytes/s) to ``peer_id`` over our p2pd."""
        return await self.prober.probe(peer_id)

    async def report_failure(self, reason: str) -> None:
        """A service cannot go on (e.g. a checkpoint failed verification): advertise OFFLINE and say goodbye,
        so the swarm leaves this node out of the next epoch and never re-syncs from its state; the process
        stays up so ``swarm status`` and the ``training`` RPC show ``reason``."""
        self.failure = reason
        self.log.error("this node can no longer take part: %s", reason)
        self.state = NodeState.OFFLINE  # every later heartbeat advertises it too
        if self.adverts is None or self.membership is None:
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.membership.announce(), timeout=GOODBYE_TIMEOUT_S)
            self.membership.publish_event("leave")

    move_stage = move_to_stage  # the trainer's hook: the stage the epoch it trains on gives this node
    def peer_alive(self, peer_id: str) -> bool:
        """Membership as the view sees it: an unexpired advert saying neither OFFLINE nor that its node cannot
        train (``ready``: all a node behind NAT learns of a NATed peer it cannot probe), and no silent member."""
        entry = self.view.get(peer_id) if self.view is not None else None
        silent = self.admission is not None and peer_id in self.admission.silent  # live advert, no answers
        return peer_id == self.peer_id or (entry is not None and entry.state != NodeState.OFFLINE
                                           and entry.advert.ready and not silent)

    def leave_out(self, peer_id: str, reason: str) -> None:
        """Never admit ``peer_id`` into an epoch again (it pinned another run at the start barrier)."""
        self.admission.leave_out(peer_id, reason)
        self.membership.refresh_now.set()

    def verify_epoch(self, epoch: ScheduleEpoch) -> bool:
        """True if ``epoch`` is of our run and signed by its coordinator as our view knows it."""
        entry = self.view.get(epoch.coordinator) if self.view is not None else None
        if epoch.run_id != self.config.run_id or entry is None:
            return False
        return verify_rsa_signature(entry.public_key, epoch.signing_payload(), epoch.signature)

    async def fetch_epochs(self) -> list[ScheduleEpoch]:
        """Every epoch stored in the DHT whose signature matches the key that owns its record (a
        trainer that fell behind an epoch switch looks there)."""
        if self.adverts is None:
            return []
        return [e for e, owner in await self.adverts.fetch_epochs()
                if verify_rsa_signature(owner, e.signing_payload(), e.signature)]

    def link_estimate(self, a: str, b: str) -> tuple[float, float] | None:
        """(one-way latency s, bandwidth B/s) of a measured link, for deadlines; None if unmeasured."""
        stat = self.view.link(a, b) if self.view is not None else None
        return None if stat is None else (stat.rtt_ms / 2000.0, float(stat.bandwidth_Bps or DEFAULT_BANDWIDTH_Bps))

    def reaches_directly(self, peer_id: str) -> bool:
        """False when no connection to ``peer_id`` can exist (both behind NAT, no relay: SwarmView.reaches)."""
        return self.view is None or self.view.reaches(self.reachability.value, peer_id)

    def missing_stages(self) -> list[int]:
        """Stages of the run that no live (ONLINE or DRAINING) peer of our view holds."""
        return self.view.missing_stages(self.run.num_stages) if self.run and self.view else []

    def advert(self) -> StageAdvert:
        cfg = self.config
        return StageAdvert(
            run_id=cfg.run_id, peer_id=self.peer_id, gossip_peer_id=self.gossip.peer_id if self.gossip else "",
            maddrs=tuple(self.maddrs), gossip_maddrs=tuple(self.gossip_maddrs()), stages=tuple(self.stages),
            state=str(self.state),
            compute_s_per_sample_per_layer=float(self.compute_s_per_sample_per_layer),
            memory_slots=int(cfg.memory_slots), free_slots=int(cfg.memory_slots),
            protocol_version=self.protocol_version,
            rpc_port=self.rpc.http_port,
            location=cfg.location, relay=serves_relay(cfg.relay, self.reachability.value),
            timestamp=time.time(),
            config_digest=self.config_digest, reachability=self.reachability.value, movable=cfg.stages is None,
            measured_compute_s_per_sample_per_layer=measured_compute_of(self.measured_compute, self.log),
            ready=self.training_ready() if self.training_ready is not None else True,
        )

    def gossip_maddrs(self) -> list[str]:
        """Where peers reach our gossip host (see :func:`node.swarm.startup.gossip_maddrs`)."""
        return startup.gossip_maddrs(self.config, self.gossip, self.maddrs)

    def status_json(self) -> dict:
        epoch, m = self.current_epoch, self.membership
        return {
            "peer_id": self.peer_id,
            "gossip_peer_id": self.gossip.peer_id if self.gossip else None,
            "run_id": self.config.run_id,
            "run": self.run.to_json() if self.run else None,
            "state": str(self.state),
            "failure": self.failure,
            "stages": list(self.stages),
            "maddrs": list(self.maddrs),
            "gossip_maddrs": self.gossip_maddrs(),
            "rpc_port": self.rpc.http_port,
            "protocol_version": self.protocol_version,
            "compute_s_per_sample_per_layer": self.compute_s_per_sample_per_layer,
            "measured_compute_s_per_sample_per_layer": measured_compute_of(self.measured_compute, self.log),
            "memory_slots": self.config.memory_slots,
            "device": self.config.device,
            "heartbeat_s": self.config.heartbeat_s,
            "last_announce_s": round(m.last_announce_s, 3),
            "last_refresh_s": round(m.last_refresh_s, 3),
            "view_refreshes": m.view_refreshes,
            "uptime_s": round(time.time() - self.started_at, 3),
            "pid": os.getpid(),
            "known_peers": len(self.view.alive()) if self.view else 0,
            "gossip_connections": len(self.gossip.connected_peers()) if self.gossip else 0,
            "epoch": epoch.epoch if epoch else None,
            "access_control": {
                "swarm_key": self.access.swarm_key is not None,
                "allowlist": len(self.access.allowed_peers) if self.access.allowed_peers is not None else None,
                "gossip_dropped_from": self.gossip_access.most_dropped(),
            },
            "coordinator_status": self.coordinator.status if self.coordinator else None,
            "admission": self.admission.status() if self.admission else None,
            "missing_stages": self.missing_stages(),
        }

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Bring the node up; raises :class:`UserError` (after cleaning up) on bad input."""
        self.phase = Phase.STARTING
        try:
            await self._open_local()
            await self._join()
            await self._start_control_plane()
        except BaseException:
            await self.stop(graceful=False)
            raise
        self._tasks = [
            asyncio.create_task(self.membership.heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self.membership.view_loop(), name="view"),
            asyncio.create_task(self.prober.loop(), name="link-probes"),
            asyncio.create_task(self.loop_lag.run(), name="loop-lag"),
            asyncio.create_task(self.membership.admission_loop(), name="admission"),
        ]
        try:
            for service in self.services:
                await service.start(self)
        except BaseException:
            await self.stop(graceful=False)
            raise
        self.phase = Phase.RUNNING
        startup.write_ready(self.config.ready_file, self.status_json())

    async def _open_local(self) -> None:
        """Everything that can fail on this machine alone: flags, ports, identity, RPC port, p2pd."""
        cfg = self.config
        if cfg.initial_peers and cfg.new_swarm:
            raise UserError("--new-swarm and --initial-peers are mutually exclusive")
        self._initial_ids = [startup.peer_id_of(m) for m in cfg.initial_peers]
        self.access = SwarmAccess(
            swarm_key=load_swarm_key(cfg.swarm_key_path) if cfg.swarm_key_path is not None else None,
            allowed_peers=load_allowlist(cfg.allow_peers_path) if cfg.allow_peers_path is not None else None,
        )
        startup.check_ports(cfg)
        self._lock.acquire()
        self.identity = load_or_create_identity(cfg.identity_path)
        self.peer_id = self.identity.peer_id.to_base58()
        self.log.set_node(self.peer_id[-8:])
        self.metrics.info.labels(peer_id=self.peer_id).set(1)
        if not self.access.listed(self.peer_id):
            self.log.warning("this node's own peer id %s is not in --allow-peers: other members will ignore it",
                             self.peer_id)
        # RPC over HTTP first: a taken --rpc-port should fail before anything slow starts.
        self.rpc_api.register(self.register_rpc, self.rpc)
        if cfg.rpc_port is not None:
            try:
                await self.rpc.start_http(cfg.rpc_host, cfg.rpc_port)
            except OSError as e:
                raise UserError(f"rpc port {cfg.rpc_port} on {cfg.rpc_host} is not available: {e.strerror}") from None
        loop = asyncio.get_running_loop()
        self.compute_s_per_sample_per_layer = await loop.run_in_executor(None, measure_compute_speed, cfg.device)
        self.p2p = await startup.create_p2p(cfg)
        self.maddrs = [str(m) for m in await self.p2p.get_visible_maddrs()]
        await self.rpc.attach_p2p(self.p2p)

    async def _join(self) -> None:
        """The run configuration (handshake or founding), the DHT, the view and our stages."""
        cfg = self.config
        await self.p2p.add_binary_stream_handler(PING_PROTOCOL, PingHandler(allow=self.is_peer_allowed))
        reply = None
        if cfg.initial_peers:
            reply = await handshake(self.p2p, cfg, self.access, self.peer_id, self.protocol_version,
                                    self._initial_ids, self.log)
            self.run = reply.run
        else:
            self.run = founding_run_config(cfg)
        self.training_summary = services_summary(self.services, self.run, reply)
        self.config_digest = summary_digest(self.training_summary)
        validators = make_record_validators(self.identity.private_key, self.access)
        self.dht = await startup.create_dht(self.p2p, cfg, validators, self.log)
        owner = make_record_validators(self.identity.private_key)[0].local_public_key
        self.adverts = AdvertStore(self.dht, cfg.run_id, owner, self.access)
        sign_records(self.dht, owner, self.access)  # training records: owner-signed, sealed, members only
        self.view = SwarmView(run_id=cfg.run_id, self_id=self.peer_id)
        self.prober = LinkProber(cfg, self.p2p, self.peer_id, self.view, self.membership.publish_links, self.log)
        self.view.update_from_dht(await self.adverts.fetch_all(self.run.num_stages))
        await self.reachability.learn(self)  # before the stage choice: a node behind NAT must not strand itself
        if cfg.stages is None and cfg.initial_peers:
            await complete_the_view(self.view, self.adverts.fetch_all, self.run.num_stages)
        self.stages = choose_stages(cfg, self.run, self.view, self.log, self.reachability.value)

    async def _start_control_plane(self) -> None:
        """Gossip and the coordinator, then one round of membership upkeep before the loops take over."""
        cfg = self.config
        self.gossip = GossipService(
            load_or_create_gossip_key(cfg.gossip_key_path),
            [f"/ip4/{startup.listen_ip(cfg.host_maddrs)}/tcp/{cfg.gossip_port}"],
            list(self.membership.topics.values()),
            self.membership.on_gossip,
        )
        await self.gossip.start()
        self.admission = admission_of(self)
        self.coordinator = coordinator_of(self, self._on_adopt)
        self.membership.bind(membership_parts(self))
        await self.membership.catch_up()

    async def stop(self, graceful: bool = True) -> None:
        """Leave the swarm (DRAINING, then OFFLINE), stop services and every subprocess."""
        if self.phase in (Phase.STOPPING, Phase.STOPPED):
            await self._stopped.wait()
            return
        self.phase = Phase.STOPPING
        try:
            if graceful and self.adverts is not None and self.gossip is not None:
                with contextlib.suppress(Exception):
                    self.state = NodeState.DRAINING
                    await asyncio.wait_for(self.membership.announce(), timeout=GOODBYE_TIMEOUT_S)
                    await asyncio.sleep(DRAIN_GRACE_S)
            await self._stop_services()
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                with contextlib.suppress(BaseException):
                    await task
            if graceful and self.adverts is not None:
                with contextlib.suppress(Exception):
                    self.state = NodeState.OFFLINE
                    await asyncio.wait_for(self.membership.announce(), timeout=GOODBYE_TIMEOUT_S)
                    self.membership.publish_event("leave")
                    await asyncio.sleep(0.1)  # let the coalesced leave go out
            await self._close_network()
        finally:
            self._lock.release()
            if self.config.ready_file is not None:
                with contextlib.suppress(OSError):
                    Path(self.config.ready_file).unlink()
            self.phase = Phase.STOPPED
            self._stopped.set()

    async def _stop_services(self) -> None:
        for service in reversed(self.services):
            with contextlib.suppress(Exception):
                # a trainer drains (finishes its iterations until a new epoch leaves it out)
                timeout = float(getattr(service, "stop_timeout_s", SERVICE_STOP_TIMEOUT_S)) + 5.0
                await asyncio.wait_for(service.stop(), timeout=timeout)

    async def _close_network(self) -> None:
        if self.gossip is not None:
            with contextlib.suppress(Exception):
                await self.gossip.stop()
        await self.rpc.stop()
        if self.dht is not None:
            await startup.shutdown_dht(self.dht)
        if self.p2p is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.p2p.shutdown(), timeout=5.0)

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def _go_online(self) -> None:
        self.state = NodeState.ONLINE

    def _on_adopt(self, epoch: ScheduleEpoch) -> None:
        self.metrics.set_schedule_epoch(epoch.epoch)
        self.epoch_changed.set()
        for callback in list(self.on_schedule_epoch):
            try:
                result = callback(epoch)
                if inspect.isawaitable(result):
                    asyncio.ensure_future(result)
            except Exception:  # noqa: BLE001
                self.log.exception("on_schedule_epoch callback failed")


def run_daemon(config: DaemonConfig, services: Sequence[DaemonService] = (), banner: bool = True,
               exit_when_done: bool = False) -> int:
    """Run a daemon on uvloop until SIGINT/SIGTERM; the body of ``skippipe node run``.

    A node whose services (the trainer) have all finished stays in the swarm, idle, so its state can still
    be queried and served; ``exit_when_done`` makes it leave and exit 0 instead (a volunteer's run is over)."""
    import faulthandler

    import uvloop

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` dumps stacks

    async def main() -> int:
        loop = asyncio.get_running_loop()
        daemon = Daemon(config, services)
        stop_requested = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop_requested.set)
        start = asyncio.create_task(daemon.start())
        waiter = asyncio.create_task(stop_requested.wait())
        done, _ = await asyncio.wait({start, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if start not in done:  # interrupted during start-up
            start.cancel()
            with contextlib.suppress(BaseException):
                await start
            await daemon.stop(graceful=False)
            return 130
        start.result()  # re-raises UserError (start() has cleaned up already)
        if banner:
            _print_banner(daemon)
        finished = asyncio.create_task(_services_finished(daemon.services))
        waiter = asyncio.create_task(stop_requested.wait())
        await asyncio.wait({finished, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if finished.done() and not waiter.done():
            if not exit_when_done:
                print("training ended: this node stays in the swarm, idle (Ctrl+C to leave; "
                      "--exit-when-done exits by itself)", flush=True)
                await waiter
            else:
                print("training ended: leaving (--exit-when-done)", flush=True)
        finished.cancel()
        waiter.cancel()
        print("stopping...", flush=True)
        await daemon.stop()
        return 0

    return uvloop.run(main())


async def _services_finished(services: Sequence[DaemonService]) -> None:
    """Returns once every service that says when it is done (an ``asyncio.Event`` named ``done``) is done;
    never, when no service does."""
    events = [s.done for s in services if isinstance(getattr(s, "done", None), asyncio.Event)]
    if not events:
        await asyncio.Event().wait()
    for event in events:
        await event.wait()


def _print_banner(daemon: Daemon) -> None:
    s = daemon.status_json()
    joinable = [m for m in s["maddrs"] if "/ip4/0.0.0.0/" not in m]
    print(f"skippipe node {s['peer_id']} is {s['state']} in run {s['run_id']!r}, stages {s['stages']}", flush=True)
    if daemon.config.initial_peers:
        print(f"joined through {', '.join(daemon.config.initial_peers)}", flush=True)
    else:
        print("started a new swarm; others join with:", flush=True)
    for line in join_lines_for_daemon(daemon.config, daemon.services, joinable):
        print(line, flush=True)
    print(daemon.reachability.line(), flush=True)
    if s["rpc_port"]:
        print(f"rpc: http://127.0.0.1:{s['rpc_port']}", flush=True)
