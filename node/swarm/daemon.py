"""The node daemon: one asyncio (uvloop) process per volunteer machine.

Start-up order matters and is chosen so that failures surface early and clearly:

1. lock the identity (a second daemon with the same key fails at once), check ports are free;
2. measure compute speed (a small torch matmul);
3. ``hivemind.P2P`` (our p2pd) with the RSA identity; bootstrapping to ``--initial-peers`` here
   turns an unreachable peer into an immediate error;
4. RPC (libp2p handler + local HTTP) and the link-probe handler;
5. ``hello`` handshake with an initial peer: refuses a wrong run id or protocol version, and
   fetches the run configuration (stages, path length) the founding node chose;
6. ``hivemind.DHT(p2p=...)`` built in an executor (its constructor blocks for seconds), sharing
   our p2pd, with the signature + content record validators;
7. py-libp2p gossip in trio guest mode, peers found through the DHT adverts;
8. heartbeat loop: re-announce adverts (JOINING, then ONLINE), refresh the view, keep gossip
   connections, let the coordinator issue or adopt epochs; link probes on their own loop.

Shutdown is the reverse, announcing DRAINING and then OFFLINE so peers drop us at once.

Trainer integration: pass ``services=[...]`` objects with ``async start(daemon)`` and
``async stop()``; they start after the control plane is up and stop before it goes down. Use
:attr:`Daemon.p2p`, :attr:`Daemon.dht`, :attr:`Daemon.view`, :attr:`Daemon.current_epoch`,
:meth:`Daemon.add_p2p_handler`, :meth:`Daemon.register_rpc`, :attr:`Daemon.on_schedule_epoch`
and :attr:`Daemon.epoch_changed`; report training progress through :attr:`Daemon.metrics`
(:class:`node.ops.metrics.NodeMetrics`) and drop data-plane traffic from peers that fail
:meth:`Daemon.is_peer_allowed` (swarm key / allowlist, :mod:`node.net.access`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import inspect
import json
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Protocol, Sequence

import node.compat  # noqa: F401  (protobuf shim before hivemind)
from hivemind import DHT
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from multiaddr import Multiaddr

from node.net.access import HELLO_PROOF_PARAM, SwarmAccess, load_allowlist, load_swarm_key
from node.swarm.config import DaemonConfig
from node.swarm.coordinator import DEFAULT_BANDWIDTH_Bps, Coordinator, RunConfig
from node.ops.dashboard import dashboard_html
from node.swarm.adverts import AdvertStore, make_record_validators
from node.errors import UserError
from node.swarm.gossip import GossipMessage, GossipService
from node.net.identity import (
    IdentityLock,
    NodeIdentity,
    load_or_create_gossip_key,
    load_or_create_identity,
    verify_rsa_signature,
)
from node.ops.metrics import METRICS_CONTENT_TYPE, NodeMetrics
from node.net.p2pd import own_session
from node.net.ratelimit import PeerRateLimiter
from node.net.rpc import CALLER_PARAM, HttpReply, RpcCallError, RpcServer, call_p2p
from node.swarm.view import SwarmView
from protocol.errors import ProtocolError
from protocol.messages import LinkReport, MembershipEvent, ScheduleEpoch, StageAdvert, decode, encode
from protocol.version import PROTOCOL_VERSION

__all__ = ["Daemon", "DaemonService", "run_daemon", "measure_compute_speed", "PING_PROTOCOL"]

logger = logging.getLogger(__name__)

#: libp2p protocol id of the link probe (echo of small frames, 1-byte ack of large ones).
PING_PROTOCOL = "skippipe/ping/1"
#: Frames up to this size are echoed (RTT probes); larger ones are acknowledged (bandwidth).
PING_ECHO_MAX_BYTES = 64
#: RTT samples per probe (the minimum is reported: queueing only ever adds delay).
PING_SAMPLES = 3
#: Seconds one link probe may take before the peer counts as unreachable for this round.
PROBE_TIMEOUT_S = 5.0
#: The DHT epoch record outlives the heartbeat by far: late joiners read it from there.
EPOCH_RECORD_TTL_S = 3600.0
#: Look for a newer epoch in the DHT every this many heartbeats (gossip is the fast path).
EPOCH_DHT_POLL_HEARTBEATS = 3
#: Store durations of margin in the advert lifetime (see Daemon.advert_ttl_s).
TTL_STORE_MARGIN = 3.0
#: A JOINING node turns ONLINE after this many successful heartbeats.
JOINING_HEARTBEATS = 1
#: Seconds a DRAINING node waits so peers see the state before it leaves.
DRAIN_GRACE_S = 0.5
#: How long a service gets to stop unless it says otherwise (``stop_timeout_s``).
SERVICE_STOP_TIMEOUT_S = 10.0
#: DHT bootstrap tries before a join gives up, and the pause between them: a busy initial peer
#: can miss one bootstrap ping (seen with 12+ daemons on 2 cores); an unreachable one fails all.
DHT_BOOTSTRAP_ATTEMPTS = 3
DHT_BOOTSTRAP_RETRY_S = 2.0
#: Seconds hivemind gives the DHT process to exit on its own (it is killed after that anyway).
DHT_GRACEFUL_SHUTDOWN_S = 1.0
#: Seconds to wait for the forked DHT process to exit before it is killed.
DHT_SHUTDOWN_TIMEOUT_S = 5.0
#: Default number of stages of a new swarm when neither --stages nor --num-stages says.
DEFAULT_NUM_STAGES = 2
#: One warning per gossip sender that is dropped by access control at most this often.
DROPPED_GOSSIP_LOG_EVERY_S = 30.0
#: Distinct dropped gossip senders remembered (for status); the table restarts when full.
MAX_TRACKED_DROPPED_SENDERS = 1024
#: Dropped gossip senders listed in status (the most frequent ones).
STATUS_DROPPED_SENDERS = 20
#: Iterations the ``iterations`` RPC returns when the caller does not say.
DEFAULT_RECENT_ITERATIONS = 200

# Compute benchmark: a transformer layer costs about 24 d^2 flops per token forward (QKVO
# projections 8 d^2, a 4d MLP 16 d^2), so seconds/sample/layer = 24 d^2 seq / measured flop/s.
BENCH_D_MODEL = 1024
BENCH_SEQ_LEN = 1024
BENCH_TOKENS = 256
BENCH_REPEATS = 6
FLOPS_PER_TOKEN_PER_LAYER_PER_D2 = 24


class DaemonService(Protocol):
    """Something that runs inside the daemon (e.g. the trainer)."""

    async def start(self, daemon: "Daemon") -> None: ...

    async def stop(self) -> None: ...


def measure_compute_speed(device: str = "cpu") -> float:
    """Seconds per sample per layer of the reference model shape, from a short matmul benchmark."""
    import torch

    dev = torch.device(device)
    x = torch.randn(BENCH_TOKENS, BENCH_D_MODEL, device=dev)
    w = torch.randn(BENCH_D_MODEL, BENCH_D_MODEL, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    (x @ w).sum().item()  # warm-up (lazy init, kernel selection)
    sync()
    t0 = time.perf_counter()
    for _ in range(BENCH_REPEATS):
        y = x @ w
    sync()
    float(y[0, 0])
    elapsed = max(time.perf_counter() - t0, 1e-9)
    flops_per_s = 2.0 * BENCH_TOKENS * BENCH_D_MODEL * BENCH_D_MODEL * BENCH_REPEATS / elapsed
    per_sample_layer = FLOPS_PER_TOKEN_PER_LAYER_PER_D2 * BENCH_D_MODEL**2 * BENCH_SEQ_LEN
    return per_sample_layer / flops_per_s


def _tcp_ports(maddrs: Sequence[str]) -> list[tuple[str, int]]:
    out = []
    for m in maddrs:
        try:
            ma = Multiaddr(m)
            port = int(ma.value_for_protocol("tcp"))
            try:
                host = ma.value_for_protocol("ip4")
            except Exception:  # noqa: BLE001
                host = "0.0.0.0"
        except Exception:  # noqa: BLE001
            raise UserError(f"bad multiaddr {m!r} (expected e.g. /ip4/0.0.0.0/tcp/31337)") from None
        out.append((host, port))
    return out


def _check_port_free(host: str, port: int, what: str) -> None:
    """p2pd binds with SO_REUSEPORT, so a taken port does not fail there: check it ourselves."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise UserError(f"{what} port {port} on {host} is not available: {e.strerror}") from None


def _peer_id_of(maddr: str) -> PeerID:
    try:
        return PeerID.from_base58(Multiaddr(maddr).value_for_protocol("p2p"))
    except Exception:  # noqa: BLE001
        raise UserError(f"initial peer {maddr!r} must end with /p2p/<peer id>") from None


class Daemon:
    """One node of the swarm. Create, ``await start()``, ``await wait_stopped()``, ``await stop()``."""

    def __init__(self, config: DaemonConfig, services: Sequence[DaemonService] = ()):
        self.config = config
        self.services: list[DaemonService] = list(services)
        self.identity: NodeIdentity | None = None
        self.peer_id: str = ""
        self.p2p: P2P | None = None
        self.dht: DHT | None = None
        self.gossip: GossipService | None = None
        self.metrics = NodeMetrics()
        self.access = SwarmAccess()
        self.rpc = RpcServer(
            p2p_limiter=PeerRateLimiter(config.rpc_rate_per_s, config.rpc_burst),
            http_limiter=PeerRateLimiter(config.http_rate_per_s, config.http_burst),
            on_request=self.metrics.count_rpc,
        )
        self._dropped_log: dict[str, float] = {}
        #: Gossip messages dropped by access control, per sending gossip id (bounded).
        self.gossip_dropped_from: collections.Counter[str] = collections.Counter()
        self.view: SwarmView | None = None
        self.adverts: AdvertStore | None = None
        self.coordinator: Coordinator | None = None
        self.run: RunConfig | None = None
        self.stages: tuple[int, ...] = ()
        self.state = "JOINING"
        self.compute_s_per_sample_per_layer = 0.0
        self.maddrs: list[str] = []
        #: Called with each adopted ScheduleEpoch (sync functions or coroutines).
        self.on_schedule_epoch: list[Callable[[ScheduleEpoch], Any]] = []
        #: Set whenever a new epoch is adopted; consumers clear it after reading current_epoch.
        self.epoch_changed = asyncio.Event()
        #: set by a training service: the first iteration a new schedule epoch may start at
        self.training_progress: Callable[[float], int | None] | None = None
        self.started_at = time.time()
        self._lock = IdentityLock(config.identity_path)
        self._tasks: list[asyncio.Task] = []
        self._stopped = asyncio.Event()
        self._stopping = False
        self._heartbeats = 0
        #: Seconds the last announce / view refresh took (exposed in status: load indicator).
        self.last_announce_s = 0.0
        self.last_refresh_s = 0.0
        self._refresh_now = asyncio.Event()
        #: Completed view refreshes (status: lets a test wait for "the view has been re-read").
        self.view_refreshes = 0
        self._probe_cursor = 0
        self._gossip_dialing: set[str] = set()
        self._topics: dict[str, str] = {}

    # ------------------------------------------------------------------ public API
    @property
    def current_epoch(self) -> ScheduleEpoch | None:
        return self.coordinator.current if self.coordinator is not None else None

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
        if self.access.swarm_key is not None:
            return self.view is not None and self.view.get(peer_id) is not None
        return True

    def register_rpc(self, name: str, method: Callable[[dict], Awaitable[Any]]) -> None:
        """Expose ``method(params)`` over libp2p and local HTTP RPC."""
        self.rpc.register(name, method)

    async def add_p2p_handler(self, name: str, handler) -> None:
        """Register a hivemind binary stream handler ``handler(stream_info, reader, writer)``."""
        await self.p2p.add_binary_stream_handler(name, handler)

    async def ensure_connected(self, peer_id: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
        """Make p2pd connect to ``peer_id`` through the maddrs of its advert.

        Uses hivemind's p2pd client directly (``P2P._client``; hivemind is pinned at 1.1.12),
        because ``P2P`` has no public connect. Returns False if unknown or unreachable.
        """
        entry = self.view.get(peer_id) if self.view is not None else None
        if entry is None or self.p2p is None:
            return False
        addrs = [Multiaddr(m.split("/p2p/")[0]) for m in entry.advert.maddrs]
        try:
            await asyncio.wait_for(self.p2p._client.connect(PeerID.from_base58(peer_id), addrs), timeout)
            return True
        except Exception as e:  # noqa: BLE001 - unreachable peers are routine
            logger.debug("connect to %s failed: %r", peer_id, e)
            return False

    def advert(self) -> StageAdvert:
        cfg = self.config
        return StageAdvert(
            run_id=cfg.run_id,
            peer_id=self.peer_id,
            gossip_peer_id=self.gossip.peer_id if self.gossip else "",
            maddrs=tuple(self.maddrs),
            gossip_maddrs=tuple(self._gossip_maddrs()),
            stages=tuple(self.stages),
            state=self.state,
            compute_s_per_sample_per_layer=float(self.compute_s_per_sample_per_layer),
            memory_slots=int(cfg.memory_slots),
            free_slots=int(cfg.memory_slots),
            protocol_version=self.protocol_version,
            rpc_port=self.rpc.http_port,
            location=cfg.location,
            timestamp=time.time(),
        )

    @property
    def protocol_version(self) -> int:
        return self.config.protocol_version if self.config.protocol_version is not None else PROTOCOL_VERSION

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Bring the node up; raises :class:`UserError` (after cleaning up) on bad input."""
        try:
            await self._start()
        except BaseException:
            await self.stop(graceful=False)
            raise

    async def _start(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        if cfg.initial_peers and cfg.new_swarm:
            raise UserError("--new-swarm and --initial-peers are mutually exclusive")
        initial_ids = [_peer_id_of(m) for m in cfg.initial_peers]
        self.access = SwarmAccess(
            swarm_key=load_swarm_key(cfg.swarm_key_path) if cfg.swarm_key_path is not None else None,
            allowed_peers=load_allowlist(cfg.allow_peers_path) if cfg.allow_peers_path is not None else None,
        )
        for host, port in _tcp_ports(cfg.host_maddrs):
            _check_port_free(host, port, "host")
        if cfg.gossip_port:
            _check_port_free(self._listen_ip(), cfg.gossip_port, "gossip")
        self._lock.acquire()
        self.identity = load_or_create_identity(cfg.identity_path)
        self.peer_id = self.identity.peer_id.to_base58()
        self.metrics.info.labels(peer_id=self.peer_id).set(1)
        if not self.access.listed(self.peer_id):
            logger.warning("this node's own peer id %s is not in --allow-peers: other members will ignore it", self.peer_id)
        gossip_key = load_or_create_gossip_key(cfg.gossip_key_path)

        # RPC over HTTP first: a taken --rpc-port should fail before anything slow starts.
        self._register_builtin_rpc()
        if cfg.rpc_port is not None:
            try:
                await self.rpc.start_http(cfg.rpc_host, cfg.rpc_port)
            except OSError as e:
                raise UserError(f"rpc port {cfg.rpc_port} on {cfg.rpc_host} is not available: {e.strerror}") from None

        self.compute_s_per_sample_per_layer = await loop.run_in_executor(None, measure_compute_speed, cfg.device)

        try:
            with own_session():  # Ctrl+C / group signals reach the daemon, not p2pd (node.net.p2pd)
                self.p2p = await P2P.create(
                    initial_peers=list(cfg.initial_peers) or None,
                    host_maddrs=list(cfg.host_maddrs),
                    announce_maddrs=list(cfg.announce_maddrs) or None,
                    identity_path=str(cfg.identity_path),
                    check_if_identity_free=bool(cfg.initial_peers),
                )
        except P2PDaemonError as e:
            text = str(e)
            if "bootstrap" in text:
                raise UserError(f"cannot reach any initial peer ({', '.join(cfg.initial_peers)})") from None
            if "already taken" in text:
                raise UserError(f"identity {cfg.identity_path} is already used by another peer in this swarm") from None
            raise UserError(f"p2p daemon failed to start: {text}") from None
        self.maddrs = [str(m) for m in await self.p2p.get_visible_maddrs()]
        await self.rpc.attach_p2p(self.p2p)
        await self.p2p.add_binary_stream_handler(PING_PROTOCOL, self._handle_ping)

        self.run = await self._handshake(initial_ids) if cfg.initial_peers else self._founding_run_config()

        def _make_dht() -> DHT:
            return DHT(
                p2p=self.p2p,
                initial_peers=list(cfg.initial_peers) or None,
                start=True,
                record_validators=make_record_validators(self.identity.private_key, self.access),
                shutdown_timeout=DHT_GRACEFUL_SHUTDOWN_S,
            )

        for attempt in range(1, DHT_BOOTSTRAP_ATTEMPTS + 1):
            try:
                self.dht = await loop.run_in_executor(None, _make_dht)
                break
            except Exception as e:  # noqa: BLE001 - bootstrap failures surface as RuntimeError
                if attempt == DHT_BOOTSTRAP_ATTEMPTS or not cfg.initial_peers:
                    raise UserError(f"cannot join the DHT through the initial peers: {e}") from None
                # an initial peer on a busy machine can miss the bootstrap ping: ask again
                logger.warning("DHT bootstrap failed (%s); trying again (%d/%d)", e, attempt, DHT_BOOTSTRAP_ATTEMPTS)
                await asyncio.sleep(DHT_BOOTSTRAP_RETRY_S)
        owner = make_record_validators(self.identity.private_key)[0].local_public_key
        self.adverts = AdvertStore(self.dht, cfg.run_id, owner, self.access)
        self.view = SwarmView(run_id=cfg.run_id, self_id=self.peer_id)
        self.view.update_from_dht(await self.adverts.fetch_all(self.run.num_stages))
        self.stages = self._choose_stages()

        self._topics = {
            "membership": f"skippipe/{cfg.run_id}/membership",
            "links": f"skippipe/{cfg.run_id}/links",
            "epochs": f"skippipe/{cfg.run_id}/epochs",
        }
        self.gossip = GossipService(
            gossip_key,
            [f"/ip4/{self._listen_ip()}/tcp/{cfg.gossip_port}"],
            list(self._topics.values()),
            self._on_gossip,
        )
        await self.gossip.start()

        self.coordinator = Coordinator(
            run_id=cfg.run_id,
            identity=self.identity,
            view=self.view,
            run=self.run,
            memory=cfg.memory_slots,
            debounce_s=cfg.epoch_debounce_s,
            takeover_s=cfg.coordinator_timeout_s,
            budget_s=cfg.schedule_budget_s,
            publish=self._publish_epoch,
            on_adopt=self._on_adopt,
            progress=lambda lead_s=0.0: self.training_progress(lead_s) if self.training_progress is not None else None,
        )
        await self._announce()
        await self._refresh_view()
        await self._maintain_gossip()
        await self._adopt_epoch_from_dht()
        self._tasks = [
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self._view_loop(), name="view"),
            asyncio.create_task(self._probe_loop(), name="link-probes"),
        ]
        for service in self.services:
            await service.start(self)
        self._write_ready()

    async def stop(self, graceful: bool = True) -> None:
        """Leave the swarm (DRAINING, then OFFLINE), stop services and every subprocess."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        try:
            if graceful and self.adverts is not None and self.gossip is not None:
                with contextlib.suppress(Exception):
                    self.state = "DRAINING"
                    await asyncio.wait_for(self._announce(), timeout=2.0)
                    await asyncio.sleep(DRAIN_GRACE_S)
            for service in reversed(self.services):
                with contextlib.suppress(Exception):
                    # a trainer drains (finishes its iterations until a new epoch leaves it out)
                    timeout = float(getattr(service, "stop_timeout_s", SERVICE_STOP_TIMEOUT_S)) + 5.0
                    await asyncio.wait_for(service.stop(), timeout=timeout)
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                with contextlib.suppress(BaseException):
                    await task
            if graceful and self.adverts is not None:
                with contextlib.suppress(Exception):
                    self.state = "OFFLINE"
                    await asyncio.wait_for(self._announce(), timeout=2.0)
                    self._gossip_event("leave")
                    await asyncio.sleep(0.1)  # let the coalesced leave go out
            if self.gossip is not None:
                with contextlib.suppress(Exception):
                    await self.gossip.stop()
            await self.rpc.stop()
            if self.dht is not None:
                await self._shutdown_dht()
            if self.p2p is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.p2p.shutdown(), timeout=5.0)
        finally:
            self._lock.release()
            if self.config.ready_file is not None:
                with contextlib.suppress(OSError):
                    Path(self.config.ready_file).unlink()
            self._stopped.set()

    async def _shutdown_dht(self) -> None:
        """Stop the forked DHT process, SIGKILLing it if it lingers.

        The DHT child is forked from this process and inherits our asyncio signal handlers, so
        the SIGTERM that ``DHT.shutdown`` and multiprocessing's exit hook rely on is swallowed
        there; without the kill, interpreter exit would wait for the child forever.
        """
        loop = asyncio.get_running_loop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(loop.run_in_executor(None, self.dht.shutdown), timeout=DHT_SHUTDOWN_TIMEOUT_S)
        with contextlib.suppress(Exception):
            if self.dht.is_alive():
                self.dht.kill()
                await loop.run_in_executor(None, self.dht.join, DHT_SHUTDOWN_TIMEOUT_S)

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    # ------------------------------------------------------------------ start-up helpers
    def _listen_ip(self) -> str:
        for host, _ in _tcp_ports(self.config.host_maddrs):
            return host
        return "0.0.0.0"

    def _gossip_maddrs(self) -> list[str]:
        if self.gossip is None:
            return []
        addrs = []
        for m in self.gossip.maddrs:
            ma = Multiaddr(m)
            port = ma.value_for_protocol("tcp")
            if self.config.announce_maddrs:
                for host, _ in _tcp_ports(self.config.announce_maddrs):
                    addrs.append(f"/ip4/{host}/tcp/{port}")
            elif "/ip4/0.0.0.0/" in m:
                addrs.extend(
                    f"/ip4/{Multiaddr(v).value_for_protocol('ip4')}/tcp/{port}"
                    for v in self.maddrs
                    if "/ip4/" in v
                )
            else:
                addrs.append(m.split("/p2p/")[0])
        return sorted(set(addrs))

    def _founding_run_config(self) -> RunConfig:
        cfg = self.config
        if cfg.num_stages is not None:
            num_stages = cfg.num_stages
        elif cfg.stages:
            num_stages = max(max(cfg.stages) + 1, DEFAULT_NUM_STAGES)
        else:
            num_stages = DEFAULT_NUM_STAGES
        if num_stages < 1:
            raise UserError("--num-stages must be at least 1")
        path_length = cfg.path_length if cfg.path_length is not None else num_stages
        if not 1 <= path_length <= num_stages:
            raise UserError(f"--path-length must be between 1 and the number of stages ({num_stages})")
        if cfg.microbatches_per_data_node < 1:
            raise UserError("--microbatches must be at least 1")
        return RunConfig(num_stages, path_length, cfg.microbatches_per_data_node, cfg.schedule_policy, cfg.location_cost)

    async def _handshake(self, initial_ids: list[PeerID]) -> RunConfig:
        """Ask an initial peer which run it serves; refuse a wrong run id or protocol version."""
        cfg = self.config
        errors = []
        for maddr, peer_id in zip(cfg.initial_peers, initial_ids):
            try:
                params = {"run_id": cfg.run_id, "protocol_version": self.protocol_version}
                proof = self.access.hello_proof(self.peer_id) if cfg.access_handshake else None
                if proof is not None:
                    params[HELLO_PROOF_PARAM] = proof
                info = await call_p2p(self.p2p, peer_id, "hello", params, timeout=cfg.hello_timeout_s)
            except RpcCallError as e:
                if "access denied" in str(e):
                    if not cfg.access_handshake:  # test knob: a modified client pushes on regardless
                        logger.warning("hello refused (%s); joining anyway without the handshake", e)
                        return self._founding_run_config()
                    raise UserError(f"{maddr} refused this node: {str(e).split('access denied: ', 1)[-1]}") from None
                errors.append(f"{maddr}: {e}")
                continue
            if not isinstance(info, dict) or "run_id" not in info:
                errors.append(f"{maddr}: not a skippipe node")
                continue
            if info.get("protocol_version") != self.protocol_version:
                raise UserError(
                    f"incompatible protocol version: {maddr} speaks v{info.get('protocol_version')}, "
                    f"this node speaks v{self.protocol_version}; upgrade the older side"
                )
            if info["run_id"] != cfg.run_id:
                raise UserError(
                    f"wrong run id: {maddr} serves run {info['run_id']!r}, not {cfg.run_id!r} (pass --run-id {info['run_id']})"
                )
            run = RunConfig.from_json(info["run"])
            if cfg.num_stages is not None and cfg.num_stages != run.num_stages:
                raise UserError(f"run {cfg.run_id!r} has {run.num_stages} stages, not {cfg.num_stages}")
            return run
        raise UserError("no initial peer answered the handshake: " + "; ".join(errors))

    def _choose_stages(self) -> tuple[int, ...]:
        cfg, run = self.config, self.run
        if cfg.stages is not None:
            bad = [s for s in cfg.stages if not 0 <= s < run.num_stages]
            if bad:
                raise UserError(f"stage(s) {bad} out of range: run {cfg.run_id!r} has stages 0..{run.num_stages - 1}")
            return tuple(sorted(set(cfg.stages)))
        counts = [0] * run.num_stages
        for entry in self.view.alive():
            for s in entry.advert.stages:
                if 0 <= s < run.num_stages:
                    counts[s] += 1
        stage = min(range(run.num_stages), key=lambda s: (counts[s], s))
        logger.info("--auto picked stage %d (replicas per stage: %s)", stage, counts)
        return (stage,)

    def _write_ready(self) -> None:
        info = self.status_json()
        if self.config.ready_file is not None:
            path = Path(self.config.ready_file)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(info))
            os.replace(tmp, path)

    # ------------------------------------------------------------------ loops
    async def _heartbeat_loop(self) -> None:
        """Re-announce our adverts on a fixed beat, never delayed by view or schedule work.

        Under load (20 daemons on 2 cores) a combined loop took longer than the advert TTL and
        healthy peers flapped out of each other's views; so announcing has its own loop.
        """
        cfg = self.config
        while True:
            t0 = time.monotonic()
            try:
                self._heartbeats += 1
                if self.state == "JOINING" and self._heartbeats > JOINING_HEARTBEATS:
                    self.state = "ONLINE"
                    await self._announce()
                    self._gossip_event("join")
                else:
                    await self._announce()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - one failed heartbeat must not kill the daemon
                logger.exception("advert announce failed")
            self.last_announce_s = time.monotonic() - t0
            await asyncio.sleep(max(0.0, cfg.heartbeat_s - self.last_announce_s))

    async def _view_loop(self) -> None:
        """Refresh the view, keep gossip connections, and drive the coordinator."""
        cfg = self.config
        rounds = 0
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._refresh_now.wait(), timeout=cfg.heartbeat_s)
            self._refresh_now.clear()
            t0 = time.monotonic()
            try:
                rounds += 1
                await self._refresh_view()
                self.view_refreshes += 1
                self._update_view_metrics()
                await self._maintain_gossip()
                if rounds % EPOCH_DHT_POLL_HEARTBEATS == 0:
                    await self._adopt_epoch_from_dht()
                await self.coordinator.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001
                logger.exception("view refresh failed")
            self.last_refresh_s = time.monotonic() - t0

    def advert_ttl_s(self) -> float:
        """Advert lifetime: the configured TTL, stretched when stores are slow.

        The next advert lands one heartbeat plus one store duration after this one was sent, so
        a lifetime shorter than ``heartbeat + 2 x store time`` makes a healthy node flap out of
        views on an overloaded machine; we keep a margin of 3 store durations.
        """
        cfg = self.config
        return max(cfg.advert_ttl_s, cfg.heartbeat_s + TTL_STORE_MARGIN * self.last_announce_s)

    async def _announce(self) -> None:
        advert = self.advert()
        ttl = self.advert_ttl_s()
        await self.adverts.announce(advert, ttl)
        self.view.set_self(advert, self.identity.public_key_bytes, time.time() + ttl)

    async def _refresh_view(self) -> None:
        fetched = await self.adverts.fetch_all(self.run.num_stages)
        fetched.pop(self.peer_id, None)  # our own entry is set locally, never from the DHT
        self.view.update_from_dht(fetched)

    async def _maintain_gossip(self) -> None:
        """Keep up to ``gossip_target_peers`` gossip connections, to peers found in the DHT."""
        connected = self.gossip.connected_peers()
        wanted = self.config.gossip_target_peers - len(connected)
        if wanted <= 0:
            return
        candidates = [
            e
            for e in self.view.alive()
            if e.peer_id != self.peer_id
            and e.advert.gossip_peer_id
            and e.advert.gossip_peer_id not in connected
            and e.advert.gossip_peer_id not in self._gossip_dialing
            and e.advert.gossip_maddrs
        ]
        # Spread connections: start after our own id in the ring so the mesh is not a star.
        candidates.sort(key=lambda e: (e.peer_id <= self.peer_id, e.peer_id))
        for entry in candidates[:wanted]:
            gid = entry.advert.gossip_peer_id
            self._gossip_dialing.add(gid)
            task = asyncio.create_task(self.gossip.connect(gid, list(entry.advert.gossip_maddrs)))
            task.add_done_callback(lambda _t, gid=gid: self._gossip_dialing.discard(gid))

    async def _adopt_epoch_from_dht(self) -> None:
        for epoch, _owner in await self.adverts.fetch_epochs():
            self.coordinator.consider(epoch)

    async def _publish_epoch(self, epoch: ScheduleEpoch) -> None:
        self.gossip.publish(self._topics["epochs"], encode(epoch))
        await self.adverts.store_epoch(epoch, EPOCH_RECORD_TTL_S)

    def _update_view_metrics(self) -> None:
        self.metrics.set_peer_states(e.state for e in self.view.peers.values())
        epoch = self.current_epoch
        self.metrics.set_schedule_epoch(epoch.epoch if epoch else None)

    def _on_adopt(self, epoch: ScheduleEpoch) -> None:
        self.metrics.set_schedule_epoch(epoch.epoch)
        self.epoch_changed.set()
        for callback in list(self.on_schedule_epoch):
            try:
                result = callback(epoch)
                if inspect.isawaitable(result):
                    asyncio.ensure_future(result)
            except Exception:  # noqa: BLE001
                logger.exception("on_schedule_epoch callback failed")

    # ------------------------------------------------------------------ gossip
    def _gossip_event(self, kind: str) -> None:
        event = MembershipEvent(
            run_id=self.config.run_id, peer_id=self.peer_id, kind=kind, stages=tuple(self.stages), timestamp=time.time()
        )
        self.gossip.publish(self._topics["membership"], encode(event))

    def _gossip_sender_allowed(self, gossip_id: str) -> bool:
        """With access control on, only gossip ids named by an accepted advert may speak."""
        if not self.access.enabled:
            return True
        entry = self.view.by_gossip_id(gossip_id) if self.view is not None else None
        if entry is not None and self.is_peer_allowed(entry.peer_id):
            return True
        self.metrics.count_gossip_dropped("not_allowed")
        if gossip_id not in self.gossip_dropped_from and len(self.gossip_dropped_from) >= MAX_TRACKED_DROPPED_SENDERS:
            self.gossip_dropped_from.clear()
        self.gossip_dropped_from[gossip_id] += 1
        now = time.monotonic()
        if now - self._dropped_log.get(gossip_id, -DROPPED_GOSSIP_LOG_EVERY_S) >= DROPPED_GOSSIP_LOG_EVERY_S:
            if len(self._dropped_log) > 1024:
                self._dropped_log.clear()
            self._dropped_log[gossip_id] = now
            logger.warning("dropping gossip from %s: not an allowed member of this swarm", gossip_id)
        return False

    def _on_gossip(self, message: GossipMessage) -> None:
        if self.gossip is not None and message.from_gossip_id == self.gossip.peer_id:
            return
        if not self._gossip_sender_allowed(message.from_gossip_id):
            return
        try:
            if message.topic == self._topics["membership"]:
                event = decode(message.data, expect=MembershipEvent)
                if not self.view.on_membership(event, message.from_gossip_id) and event.kind != "leave":
                    self._refresh_now.set()  # a newcomer we have not read from the DHT yet
                elif event.kind == "leave":
                    self._refresh_now.set()
            elif message.topic == self._topics["links"]:
                self.view.on_link_report(decode(message.data, expect=LinkReport), message.from_gossip_id)
            elif message.topic == self._topics["epochs"]:
                epoch = decode(message.data, expect=ScheduleEpoch)
                verdict = self.coordinator.consider(epoch)
                logger.debug("epoch %d from %s: %s", epoch.epoch, epoch.coordinator, verdict)
        except ProtocolError as e:
            self.metrics.count_gossip_dropped("malformed")
            logger.debug("dropping malformed gossip on %s: %s", message.topic, e)

    # ------------------------------------------------------------------ link probes
    async def _handle_ping(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await P2P.receive_raw_data(reader)
                await P2P.send_raw_data(data if len(data) <= PING_ECHO_MAX_BYTES else b"\x01", writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def probe_link(self, peer_id: str) -> tuple[float, float | None]:
        """(min RTT in ms, bandwidth in bytes/s) to ``peer_id`` over our p2pd."""
        _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), PING_PROTOCOL)
        try:
            rtts = []
            for _ in range(PING_SAMPLES):
                t0 = time.perf_counter()
                await P2P.send_raw_data(b"p", writer)
                await P2P.receive_raw_data(reader)
                rtts.append(time.perf_counter() - t0)
            rtt = min(rtts)
            payload = os.urandom(self.config.link_probe_payload_bytes)
            t0 = time.perf_counter()
            await P2P.send_raw_data(payload, writer)
            await P2P.receive_raw_data(reader)
            elapsed = time.perf_counter() - t0
            bandwidth = len(payload) / max(elapsed - rtt, elapsed / 2, 1e-6)
            return rtt * 1000.0, bandwidth
        finally:
            writer.close()

    async def _probe_loop(self) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.heartbeat_s * cfg.link_probe_every_heartbeats)
            peers = [e.peer_id for e in self.view.alive() if e.peer_id != self.peer_id]
            if not peers:
                continue
            count = min(cfg.link_probe_peers_per_round, len(peers))
            chosen = [peers[(self._probe_cursor + i) % len(peers)] for i in range(count)]
            self._probe_cursor += count
            rtt_ms, bandwidth = {}, {}
            for peer in chosen:
                try:
                    rtt, bw = await asyncio.wait_for(self.probe_link(peer), PROBE_TIMEOUT_S)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - unreachable peers are routine
                    logger.debug("link probe to %s failed: %r", peer, e)
                    continue
                rtt_ms[peer] = rtt
                if bw is not None:
                    bandwidth[peer] = bw
            if rtt_ms:
                report = LinkReport(
                    run_id=cfg.run_id, src=self.peer_id, timestamp=time.time(), rtt_ms=rtt_ms, bandwidth_Bps=bandwidth
                )
                self.view.on_link_report(report, None)
                self.gossip.publish(self._topics["links"], encode(report))

    # ------------------------------------------------------------------ RPC
    def _register_builtin_rpc(self) -> None:
        self.register_rpc("hello", self._rpc_hello)
        self.register_rpc("status", self._rpc_status)
        self.register_rpc("swarm", self._rpc_swarm)
        self.register_rpc("schedule", self._rpc_schedule)
        self.register_rpc("health", self._rpc_health)
        self.register_rpc("iterations", self._rpc_iterations)
        self.register_rpc("traffic", self._rpc_traffic)
        self.rpc.register_http_route("/metrics", self._http_metrics)
        self.rpc.register_http_route("/", self._http_dashboard)

    async def _http_dashboard(self, params: dict) -> HttpReply:
        return HttpReply(200, "text/html; charset=utf-8", dashboard_html())

    async def _rpc_traffic(self, params: dict) -> dict:
        """Data-plane totals per peer as counted by this node (the dashboard's throughput)."""
        return {"peer_id": self.peer_id, "peers": self.metrics.traffic()}

    async def _http_metrics(self, params: dict) -> HttpReply:
        if self.view is not None:
            self._update_view_metrics()
        return HttpReply(200, METRICS_CONTENT_TYPE, self.metrics.render())

    async def _rpc_iterations(self, params: dict) -> dict:
        """Recent training iterations (the dashboard's loss curve)."""
        try:
            limit = max(1, int(params.get("limit", DEFAULT_RECENT_ITERATIONS)))
        except (TypeError, ValueError):
            raise ValueError("limit must be an integer") from None
        return {"peer_id": self.peer_id, "iterations": self.metrics.recent_iterations(limit)}

    async def _rpc_hello(self, params: dict) -> dict:
        refusal = self.access.check_hello(params.get(CALLER_PARAM), params.get(HELLO_PROOF_PARAM))
        if refusal is not None:
            logger.warning("hello from %s refused: %s", params.get(CALLER_PARAM), refusal)
            raise PermissionError(refusal)
        return {
            "run_id": self.config.run_id,
            "protocol_version": self.protocol_version,
            "peer_id": self.peer_id,
            "run": self.run.to_json() if self.run else None,
        }

    def status_json(self) -> dict:
        epoch = self.current_epoch
        return {
            "peer_id": self.peer_id,
            "gossip_peer_id": self.gossip.peer_id if self.gossip else None,
            "run_id": self.config.run_id,
            "run": self.run.to_json() if self.run else None,
            "state": self.state,
            "stages": list(self.stages),
            "maddrs": list(self.maddrs),
            "gossip_maddrs": self._gossip_maddrs(),
            "rpc_port": self.rpc.http_port,
            "protocol_version": self.protocol_version,
            "compute_s_per_sample_per_layer": self.compute_s_per_sample_per_layer,
            "memory_slots": self.config.memory_slots,
            "device": self.config.device,
            "heartbeat_s": self.config.heartbeat_s,
            "last_announce_s": round(self.last_announce_s, 3),
            "last_refresh_s": round(self.last_refresh_s, 3),
            "view_refreshes": self.view_refreshes,
            "uptime_s": round(time.time() - self.started_at, 3),
            "pid": os.getpid(),
            "known_peers": len(self.view.alive()) if self.view else 0,
            "gossip_connections": len(self.gossip.connected_peers()) if self.gossip else 0,
            "epoch": epoch.epoch if epoch else None,
            "access_control": {
                "swarm_key": self.access.swarm_key is not None,
                "allowlist": len(self.access.allowed_peers) if self.access.allowed_peers is not None else None,
                "gossip_dropped_from": dict(self.gossip_dropped_from.most_common(STATUS_DROPPED_SENDERS)),
            },
            "coordinator_status": self.coordinator.status if self.coordinator else None,
            "missing_stages": self.missing_stages(),
        }

    def missing_stages(self) -> list[int]:
        """Stages of the run that no live (ONLINE or DRAINING) peer of our view holds."""
        if self.run is None or self.view is None:
            return []
        held = {s for e in self.view.alive() if e.state in ("ONLINE", "DRAINING") for s in e.advert.stages}
        return [s for s in range(self.run.num_stages) if s not in held]

    def peer_alive(self, peer_id: str) -> bool:
        """Membership as the view sees it: an unexpired advert that does not say OFFLINE."""
        if peer_id == self.peer_id:
            return True
        entry = self.view.get(peer_id) if self.view is not None else None
        return entry is not None and entry.state != "OFFLINE"

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
        if stat is None:
            return None
        return stat.rtt_ms / 2000.0, float(stat.bandwidth_Bps or DEFAULT_BANDWIDTH_Bps)

    async def _rpc_status(self, params: dict) -> dict:
        return self.status_json()

    async def _rpc_swarm(self, params: dict) -> dict:
        return self.view.to_json() if self.view else {"peers": [], "links": []}

    async def _rpc_schedule(self, params: dict) -> dict:
        epoch = self.current_epoch
        if epoch is None:
            return {"epoch": None, "status": self.coordinator.status if self.coordinator else "starting"}
        return {
            "epoch": epoch.epoch,
            "coordinator": epoch.coordinator,
            "issued_at": epoch.issued_at,
            "members": list(epoch.members),
            "schedule": epoch.schedule,
            "status": self.coordinator.status,
        }

    async def _rpc_health(self, params: dict) -> dict:
        ok = self.p2p is not None and self.p2p.is_alive and self.dht is not None and self.dht.is_alive()
        return {"ok": bool(ok), "state": self.state, "peer_id": self.peer_id}


def run_daemon(config: DaemonConfig, services: Sequence[DaemonService] = (), banner: bool = True) -> int:
    """Run a daemon on uvloop until SIGINT/SIGTERM; the body of ``skippipe node run``."""
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
        await stop_requested.wait()
        print("stopping...", flush=True)
        await daemon.stop()
        return 0

    return uvloop.run(main())


def _print_banner(daemon: Daemon) -> None:
    s = daemon.status_json()
    joinable = [m for m in s["maddrs"] if "/ip4/0.0.0.0/" not in m]
    print(f"skippipe node {s['peer_id']} is {s['state']} in run {s['run_id']!r}, stages {s['stages']}", flush=True)
    if daemon.config.initial_peers:
        print(f"joined through {', '.join(daemon.config.initial_peers)}", flush=True)
    else:
        print("started a new swarm; others join with:", flush=True)
    for m in joinable:
        print(f"  skippipe node run --run-id {s['run_id']} --initial-peers {m} --auto", flush=True)
    if s["rpc_port"]:
        print(f"rpc: http://127.0.0.1:{s['rpc_port']}", flush=True)
