"""Configuration of one node daemon.

Every timing constant of the control plane lives here as a named field with a default, so tests
can shrink the heartbeat to a second and a deployment can stretch it without touching code. The
derived timeouts (advert TTL, coordinator take-over, epoch debounce) are expressed in heartbeats so
that one knob scales them all consistently.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from node.spec import DEFAULT_HEARTBEAT_S, DEFAULT_MEMORY_SLOTS, DEFAULT_MICROBATCHES, DEFAULT_RUN_ID
from node.dataplane.relay import RelayMode
from node.swarm.replan import ReplanPolicy

__all__ = [
    "DEFAULT_HEARTBEAT_S",
    "DEFAULT_RUN_ID",
    "DEFAULT_HOST_MADDRS",
    "DEFAULT_MEMORY_SLOTS",
    "SKIPPIPE_HOME_ENV",
    "default_home",
    "default_identity_path",
    "DaemonConfig",
]

#: Listen on every interface, ephemeral port: what a volunteer behind a home router needs.
DEFAULT_HOST_MADDRS = ("/ip4/0.0.0.0/tcp/0",)
#: Environment variable overriding where identities and state are kept.
SKIPPIPE_HOME_ENV = "SKIPPIPE_HOME"


def default_home() -> Path:
    """``$SKIPPIPE_HOME`` or ``~/.skippipe``: where the node keeps its keys."""
    env = os.environ.get(SKIPPIPE_HOME_ENV)
    return Path(env) if env else Path.home() / ".skippipe"


def default_identity_path() -> Path:
    """Default hivemind (RSA) identity file; the gossip key sits next to it."""
    return default_home() / "identity.key"


@dataclass
class DaemonConfig:
    """Everything ``skippipe node run`` needs to start a daemon.

    ``stages=None`` means "pick automatically" (``--auto``): the node joins the bottleneck stage
    (:func:`node.swarm.handshake.choose_stages`), and the coordinator may move it to another. ``num_stages`` / ``path_length`` / ``microbatches_per_data_node``
    describe the run; a joining node takes them from the swarm it joins (hello handshake), so
    only the founding node's values matter.
    """

    run_id: str = DEFAULT_RUN_ID
    initial_peers: tuple[str, ...] = ()
    new_swarm: bool = False
    stages: tuple[int, ...] | None = None
    num_stages: int | None = None
    path_length: int | None = None
    microbatches_per_data_node: int = DEFAULT_MICROBATCHES
    #: Run-level schedule policy and emulated cost table (new swarm only; see coordinator.RunConfig).
    schedule_policy: str = "skippipe"
    location_cost: dict | None = None
    memory_slots: int = DEFAULT_MEMORY_SLOTS
    host_maddrs: tuple[str, ...] = DEFAULT_HOST_MADDRS
    announce_maddrs: tuple[str, ...] = ()
    gossip_port: int = 0
    identity_path: Path = field(default_factory=default_identity_path)
    device: str = "cpu"
    location: str | None = None
    #: Local HTTP JSON RPC port on 127.0.0.1; 0 = ephemeral, None = disabled.
    rpc_port: int | None = 0
    rpc_host: str = "127.0.0.1"
    #: Override of the advertised protocol version (tests of the incompatibility check only).
    protocol_version: int | None = None
    #: Where to write a JSON "ready" record once the daemon serves (used by local swarms).
    ready_file: Path | None = None

    # --- access control (node.net.access) ------------------------------------------------------
    #: File holding the swarm's shared secret; None = open swarm.
    swarm_key_path: Path | None = None
    #: File listing the peer ids allowed in the swarm (one per line, # comments); None = anyone.
    allow_peers_path: Path | None = None
    #: Send the swarm-key proof in hello. Only tests turn it off, to play a modified client that
    #: skips the courtesy check and must still be kept out by the DHT and gossip checks.
    access_handshake: bool = True

    # --- hostile input (node.net.ratelimit) ----------------------------------------------------
    #: Per-peer token bucket of the libp2p RPC handler: sustained requests/s and burst size.
    rpc_rate_per_s: float = 20.0
    rpc_burst: float = 40.0
    #: Per-client-address token bucket of the local HTTP endpoint (dashboard polls ~4 req/s).
    http_rate_per_s: float = 50.0
    http_burst: float = 100.0

    # --- control-plane timing -------------------------------------------------------------
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    #: Advert expiration in heartbeats: a node missed for this long drops out of every view.
    advert_ttl_heartbeats: float = 3.0
    #: Membership must be stable this long (heartbeats) before a new epoch is computed.
    epoch_debounce_heartbeats: float = 1.5
    #: A backup coordinator waits this many heartbeats per rank before taking over.
    coordinator_timeout_heartbeats: float = 3.0
    #: Link probes run every this many heartbeats, against a few peers per round.
    link_probe_every_heartbeats: int = 3
    link_probe_peers_per_round: int = 4
    link_probe_payload_bytes: int = 64 * 1024
    #: Gossip connections a node keeps (GossipSub needs only a handful to flood the swarm).
    gossip_target_peers: int = 6
    #: Seconds for the hello handshake with an initial peer.
    hello_timeout_s: float = 10.0
    #: Safety cap (seconds) on the coordinator's path search per epoch. The search itself stops on a work
    #: budget derived from the problem, so the schedule does not depend on how busy the machine is; the cap
    #: only bounds a pathological case (a 20-node search takes ~1 s of CPU) and is logged when hit.
    schedule_budget_s: float = 15.0
    #: When the coordinator re-plans for the members' measured compute speeds (:mod:`node.swarm.replan`).
    replan: ReplanPolicy = ReplanPolicy(enabled=False)
    #: Relay data-plane frames between members nobody can dial (``--relay``; :mod:`node.dataplane.relay`).
    relay: RelayMode = RelayMode.AUTO

    @property
    def advert_ttl_s(self) -> float:
        return self.heartbeat_s * self.advert_ttl_heartbeats

    @property
    def epoch_debounce_s(self) -> float:
        return self.heartbeat_s * self.epoch_debounce_heartbeats

    @property
    def coordinator_timeout_s(self) -> float:
        return self.heartbeat_s * self.coordinator_timeout_heartbeats

    @property
    def gossip_key_path(self) -> Path:
        """The py-libp2p Ed25519 key lives next to the hivemind identity (one key per stack)."""
        p = Path(self.identity_path)
        return p.with_name(p.name + ".gossip")
