"""The daemon as the code that wires its parts sees it: a typed seam (:class:`SwarmHost`), so
:mod:`node.swarm.wiring` (which hands the coordinator, admission, membership and the RPC handlers their explicit
inputs) and the daemon's own reachability service name what they read of the :class:`node.swarm.daemon.Daemon`
without importing it (the daemon builds them; they never build it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional, Protocol, Sequence

if TYPE_CHECKING:
    from node.net.access import SwarmAccess
    from node.net.identity import NodeIdentity
    from node.net.rpc import RpcServer
    from node.ops.metrics import NodeMetrics
    from node.swarm.admission import Admission
    from node.swarm.adverts import AdvertStore
    from node.swarm.config import DaemonConfig
    from node.swarm.coordinator import Coordinator, RunConfig
    from node.swarm.gossip import GossipService
    from node.swarm.gossip_access import GossipAccessControl
    from node.swarm.states import NodeLogger, NodeState
    from node.swarm.view import SwarmView
    from protocol.messages import ScheduleEpoch, StageAdvert

__all__ = ["SwarmHost"]


class SwarmHost(Protocol):
    """What the daemon's membership and RPC handlers read of it; None where a part is not started yet."""

    peer_id: str
    config: "DaemonConfig"
    log: "NodeLogger"
    identity: "NodeIdentity"
    access: "SwarmAccess"
    metrics: "NodeMetrics"
    rpc: "RpcServer"
    p2p: Any  # hivemind.p2p.P2P
    dht: Any  # hivemind.DHT
    state: "NodeState"
    stages: Sequence[int]
    run: Optional["RunConfig"]
    view: Optional["SwarmView"]
    gossip: Optional["GossipService"]
    gossip_access: "GossipAccessControl"
    adverts: Optional["AdvertStore"]
    coordinator: Optional["Coordinator"]
    admission: Optional["Admission"]
    membership: Any  # node.swarm.membership.Membership
    reachability: Any  # node.swarm.reachability_watch.ReachabilityWatch
    training_summary: Optional[dict]
    config_digest: str
    #: a training service's hooks (None without one): see node.train.service.TrainerService.attach
    training_progress: Optional[Callable[[float], Optional[int]]]
    training_iteration: Optional[Callable[[], Optional[int]]]
    coordination_blocker: Optional[Callable[[], Optional[str]]]
    training_ready: Optional[Callable[[], bool]]
    measured_compute: Optional[Callable[[], Optional[float]]]
    training_sketch: Optional[Callable[[int, bytes], Awaitable[Optional[list]]]]

    @property
    def current_epoch(self) -> Optional["ScheduleEpoch"]: ...

    @property
    def protocol_version(self) -> int: ...

    def advert(self) -> "StageAdvert": ...

    def status_json(self) -> dict: ...

    def is_peer_allowed(self, peer_id: str) -> bool: ...

    def register_rpc(self, name: str, method: Callable[[dict], Awaitable[Any]]) -> None: ...

    async def ensure_connected(self, peer_id: str, timeout: float = ...) -> bool: ...
