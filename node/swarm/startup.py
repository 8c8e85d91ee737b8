"""Start-up steps of a daemon that touch the machine: ports, compute benchmark, p2pd, DHT.

Each step turns the failure a user can cause (a taken port, an unreachable initial peer, an
identity in use) into one :class:`UserError` line, so :meth:`node.swarm.daemon.Daemon.start`
reads as the order of the steps. The DHT's shutdown lives here too: the in-process harness
(:mod:`node.launch.inproc_swarm`) stops its DHTs the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import socket
import time
from pathlib import Path
from typing import Sequence

import node.compat  # noqa: F401  (protobuf shim before hivemind)
from node.compat import make_dht_storage_total_order
from hivemind import DHT
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from multiaddr import Multiaddr

from node.errors import UserError
from node.net.dht_process import SwarmDHT
from node.net.p2pd import own_session
from node.swarm.config import DaemonConfig

__all__ = [
    "measure_compute_speed", "tcp_ports", "check_port_free", "peer_id_of", "listen_ip", "check_ports",
    "create_p2p", "create_dht", "shutdown_dht", "write_ready",
]

logger = logging.getLogger(__name__)

#: DHT bootstrap tries before a join gives up, and the pause between them: a busy initial peer
#: can miss one bootstrap ping (seen with 12+ daemons on 2 cores); an unreachable one fails all.
DHT_BOOTSTRAP_ATTEMPTS = 3
DHT_BOOTSTRAP_RETRY_S = 2.0
#: Seconds hivemind gives the DHT process to exit on its own (it is killed after that anyway).
DHT_GRACEFUL_SHUTDOWN_S = 1.0
#: Seconds to wait for the forked DHT process to exit before it is killed.
DHT_SHUTDOWN_TIMEOUT_S = 5.0

# Compute benchmark: a transformer layer costs about 24 d^2 flops per token forward (QKVO
# projections 8 d^2, a 4d MLP 16 d^2), so seconds/sample/layer = 24 d^2 seq / measured flop/s.
BENCH_D_MODEL = 1024
BENCH_SEQ_LEN = 1024
BENCH_TOKENS = 256
BENCH_REPEATS = 6
#: Timed runs of the benchmark; the fastest counts. One run takes ~30 ms on a CPU core, shorter than the
#: time slices other processes on a busy box take from it, so a single run can read several times slow, and
#: a replica misjudged at start-up may be sent no microbatch (it then never measures its real speed).
BENCH_RUNS = 5
FLOPS_PER_TOKEN_PER_LAYER_PER_D2 = 24


def measure_compute_speed(device: str = "cpu") -> float:
    """Seconds per sample per layer of the reference model shape, from a short matmul benchmark (the fastest
    of :data:`BENCH_RUNS` runs: what the hardware does when nothing else holds it)."""
    import torch

    dev = torch.device(device)
    x = torch.randn(BENCH_TOKENS, BENCH_D_MODEL, device=dev)
    w = torch.randn(BENCH_D_MODEL, BENCH_D_MODEL, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    (x @ w).sum().item()  # warm-up (lazy init, kernel selection)
    sync()
    elapsed = math.inf
    for _ in range(BENCH_RUNS):
        t0 = time.perf_counter()
        for _ in range(BENCH_REPEATS):
            y = x @ w
        sync()
        float(y[0, 0])
        elapsed = min(elapsed, time.perf_counter() - t0)
    elapsed = max(elapsed, 1e-9)
    flops_per_s = 2.0 * BENCH_TOKENS * BENCH_D_MODEL * BENCH_D_MODEL * BENCH_REPEATS / elapsed
    per_sample_layer = FLOPS_PER_TOKEN_PER_LAYER_PER_D2 * BENCH_D_MODEL**2 * BENCH_SEQ_LEN
    return per_sample_layer / flops_per_s


def tcp_ports(maddrs: Sequence[str]) -> list[tuple[str, int]]:
    """(host, port) of each ``/ip4/.../tcp/...`` multiaddr; a malformed one is a user error."""
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


def check_port_free(host: str, port: int, what: str) -> None:
    """p2pd binds with SO_REUSEPORT, so a taken port does not fail there: check it ourselves."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise UserError(f"{what} port {port} on {host} is not available: {e.strerror}") from None


def peer_id_of(maddr: str) -> PeerID:
    """The peer id an initial peer's multiaddr ends with (the handshake needs to know whom it asks)."""
    try:
        return PeerID.from_base58(Multiaddr(maddr).value_for_protocol("p2p"))
    except Exception:  # noqa: BLE001
        raise UserError(f"initial peer {maddr!r} must end with /p2p/<peer id>") from None


def listen_ip(host_maddrs: Sequence[str]) -> str:
    """The address gossip listens on: the first host multiaddr's, else every interface."""
    for host, _ in tcp_ports(host_maddrs):
        return host
    return "0.0.0.0"


def check_ports(cfg: DaemonConfig) -> None:
    """Fail before anything slow starts if a host or gossip port is taken."""
    for host, port in tcp_ports(cfg.host_maddrs):
        check_port_free(host, port, "host")
    if cfg.gossip_port:
        check_port_free(listen_ip(cfg.host_maddrs), cfg.gossip_port, "gossip")


async def create_p2p(cfg: DaemonConfig) -> P2P:
    """Our p2pd; bootstrapping to the initial peers here turns an unreachable one into an error now."""
    try:
        with own_session():  # Ctrl+C / group signals reach the daemon, not p2pd (node.net.p2pd)
            return await P2P.create(
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


async def create_dht(p2p: P2P, cfg: DaemonConfig, record_validators: list, log: logging.LoggerAdapter | None = None) -> DHT:
    """A ``hivemind.DHT`` sharing our p2pd, built in an executor (its constructor blocks for seconds)."""
    log = log or logger
    loop = asyncio.get_running_loop()
    make_dht_storage_total_order()

    def make() -> DHT:
        return SwarmDHT(
            p2p=p2p,
            initial_peers=list(cfg.initial_peers) or None,
            start=True,
            record_validators=record_validators,
            shutdown_timeout=DHT_GRACEFUL_SHUTDOWN_S,
        )

    for attempt in range(1, DHT_BOOTSTRAP_ATTEMPTS + 1):
        try:
            return await loop.run_in_executor(None, make)
        except Exception as e:  # noqa: BLE001 - bootstrap failures surface as RuntimeError
            if attempt == DHT_BOOTSTRAP_ATTEMPTS or not cfg.initial_peers:
                raise UserError(f"cannot join the DHT through the initial peers: {e}") from None
            # an initial peer on a busy machine can miss the bootstrap ping: ask again
            log.warning("DHT bootstrap failed (%s); trying again (%d/%d)", e, attempt, DHT_BOOTSTRAP_ATTEMPTS)
            await asyncio.sleep(DHT_BOOTSTRAP_RETRY_S)
    raise AssertionError("unreachable")


async def shutdown_dht(dht: DHT, timeout: float = DHT_SHUTDOWN_TIMEOUT_S) -> None:
    """Stop a forked DHT process, SIGKILLing it if it lingers.

    The DHT child is forked from this process and inherits our asyncio signal handlers, so the
    SIGTERM that ``DHT.shutdown`` and multiprocessing's exit hook rely on is swallowed there;
    without the kill, interpreter exit would wait for the child forever.
    """
    loop = asyncio.get_running_loop()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(loop.run_in_executor(None, dht.shutdown), timeout=timeout)
    with contextlib.suppress(Exception):
        if dht.is_alive():
            dht.kill()
            await loop.run_in_executor(None, dht.join, timeout)


def write_ready(path: str | os.PathLike | None, info: dict) -> None:
    """Write the ready file atomically (a launcher polls for it and must never read half of it)."""
    if path is None:
        return
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)


def gossip_maddrs(cfg: DaemonConfig, gossip, maddrs: list[str]) -> list[str]:
    """Where peers reach our gossip host: announced hosts, else our visible p2pd hosts (``maddrs``), at
    its port; [] before gossip is up."""
    if gossip is None:
        return []
    addrs = []
    for m in gossip.maddrs:
        port = Multiaddr(m).value_for_protocol("tcp")
        if cfg.announce_maddrs:
            for host, _ in tcp_ports(cfg.announce_maddrs):
                addrs.append(f"/ip4/{host}/tcp/{port}")
        elif "/ip4/0.0.0.0/" in m:
            addrs.extend(f"/ip4/{Multiaddr(v).value_for_protocol('ip4')}/tcp/{port}" for v in maddrs if "/ip4/" in v)
        else:
            addrs.append(m.split("/p2p/")[0])
    return sorted(set(addrs))
