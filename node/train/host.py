"""What a trainer needs from the process that hosts it: the typed seam between training and the daemon.

:class:`node.swarm.daemon.Daemon` satisfies :class:`TrainerHost` structurally (train may not import
swarm: the layers go one way), with exactly these names; a test can pass any object that has them.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, List, Optional, Protocol, Sequence, Tuple

__all__ = ["TrainerHost", "TrainingMetrics", "HostRun", "HostConfig", "HostView"]


class TrainingMetrics(Protocol):
    """The metric series a trainer (and its data plane) reports; :class:`node.ops.metrics.NodeMetrics`."""

    def set_iteration(self, iteration: int, loss: Optional[float] = None,
                      tokens_per_s: Optional[float] = None) -> None: ...

    def record_hop(self, peer: str, seconds: Optional[float], nbytes: int, direction: str) -> None: ...

    def count_failure(self, kind: str) -> None: ...

    def count_rejected(self, reason: str) -> None: ...

    def count_reroute(self, n: int = 1) -> None: ...

    def count_skip(self, n: int = 1) -> None: ...

    def count_drop(self, n: int = 1) -> None: ...


class HostRun(Protocol):
    """The run's shape fixed by its founder (the stage count decides the model split)."""

    num_stages: int


class HostConfig(Protocol):
    heartbeat_s: float  # the start debounce defaults to three heartbeats


class HostAdvert(Protocol):
    stages: Sequence[int]


class HostViewEntry(Protocol):
    peer_id: str
    advert: HostAdvert


class HostView(Protocol):
    """The host's view of the swarm (who is ONLINE and which stages they hold)."""

    def online(self) -> List[HostViewEntry]: ...

    def get(self, peer_id: str) -> Any: ...


class TrainerHost(Protocol):
    """A swarm member a :class:`node.train.service.TrainerService` runs in."""

    peer_id: str
    p2p: Any  # hivemind P2P: the data plane and state transfer run on it
    dht: Any  # hivemind DHT on the same p2pd: averaging and the per-member records
    view: Optional[HostView]
    metrics: Optional[TrainingMetrics]
    run: Optional[HostRun]
    config: HostConfig
    #: the stages this node advertises (a single one is proven before an epoch names it: node.train.proof)
    stages: Sequence[int]
    #: set by the service: its stage probe sketch of a stage it holds (None for any other)
    training_sketch: Optional[Callable[[int, bytes], Awaitable[Optional[list]]]]
    #: the coordinator asks this for the iteration a new epoch should start at (None: not training)
    training_progress: Optional[Callable[[float], Optional[int]]]
    #: called with every schedule epoch the host adopts
    on_schedule_epoch: List[Callable[[Any], Any]]
    #: the hooks a trainer service gives its host (:meth:`node.train.service.TrainerService.attach`): the
    #: committed iteration (admission answers), why the coordinator must not issue an epoch now (None: it may),
    #: whether a node that is not training yet could train if named, and the measured compute speed (adverts)
    training_iteration: Optional[Callable[[], Optional[int]]]
    coordination_blocker: Optional[Callable[[], Optional[str]]]
    training_ready: Optional[Callable[[], bool]]
    measured_compute: Optional[Callable[[], Optional[float]]]

    @property
    def current_epoch(self) -> Any: ...  # the adopted protocol.ScheduleEpoch, or None

    def register_rpc(self, name: str, method: Callable[[dict], Awaitable[Any]]) -> None: ...

    async def ensure_connected(self, peer_id: str, timeout: float = ...) -> bool: ...

    def peer_alive(self, peer_id: str) -> bool: ...

    def verify_epoch(self, epoch: Any) -> bool: ...

    async def fetch_epochs(self) -> List[Any]: ...

    def link_estimate(self, a: str, b: str) -> Optional[Tuple[float, float]]: ...

    def is_peer_allowed(self, peer_id: str) -> bool: ...

    def reaches_directly(self, peer_id: str) -> bool: ...

    def leave_out(self, peer_id: str, reason: str) -> None:
        """Never admit ``peer_id`` into an epoch again (it pinned another run at the start barrier)."""
        ...

    async def move_stage(self, stage: int) -> None:
        """The epoch this node is about to train on gives it ``stage``: a host whose stage was chosen with
        ``--auto`` advertises that stage from now on (one given ``--stages`` keeps its advert)."""
        ...

    async def report_failure(self, reason: str) -> None:
        """This member cannot train (e.g. its checkpoint failed verification): the host stops advertising it
        as ONLINE, so no epoch includes it and no replica re-syncs from it, and keeps ``reason`` visible."""
        ...
