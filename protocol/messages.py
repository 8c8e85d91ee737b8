"""The swarm's message types, and the ``encode``/``decode`` entry points.

Each message is a frozen, typed dataclass with a ``TYPE`` string and is registered with
:func:`register_message`; the codec validates every field from the annotations, and each class's
``validate`` hook checks the invariants that span fields (documented in docs/CONTRACTS.md), so a
peer that receives a message can trust its shape without re-checking it.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import ClassVar

from .codec import decode, encode
from .errors import MalformedMessage
from .limits import DEFAULT_MAX_BYTES, MAX_MEASURED_COMPUTE_S
from .options import DecodeOptions
from .registry import register_message
from .tensor import TensorFrame

__all__ = [
    "encode",
    "decode",
    "register_message",
    "DEFAULT_MAX_BYTES",
    "MicrobatchId",
    "HopMessage",
    "ActivationMessage",
    "GradientMessage",
    "HopFailure",
    "IterationDone",
    "NormReport",
    "NORM_REPORT_MAX_GROUP",
    "NORM_REPORT_MAX_EPOCHS",
    "NORM_REPORT_MAX_EPOCH_BYTES",
    "StageAdvert",
    "MembershipEvent",
    "LinkReport",
    "ScheduleEpoch",
    "RpcRequest",
    "RpcResponse",
    "PEER_STATES",
    "MEMBERSHIP_KINDS",
    "PEER_STATE_ORDER",
    "MAX_PORT",
    "Reachability",
    "REACHABILITY_VALUES",
]

#: Lifecycle states a peer advertises in :class:`StageAdvert`, in lifecycle order.
PEER_STATE_ORDER: tuple[str, ...] = ("JOINING", "ONLINE", "DRAINING", "OFFLINE")
PEER_STATES: frozenset[str] = frozenset(PEER_STATE_ORDER)
#: Kinds of :class:`MembershipEvent`.
MEMBERSHIP_KINDS: frozenset[str] = frozenset({"join", "leave", "suspect", "alive"})


class Reachability(str, enum.Enum):
    """How other peers can open a connection to a peer, as it learned it (carried by :class:`StageAdvert`)."""

    #: a peer answered a dial-back at one of its addresses: anyone may dial it
    DIRECT = "direct"
    #: nobody can dial it, but it holds a reservation on a relay: peers reach it through the relay
    RELAYED = "relayed"
    #: nobody can dial it and no relay carries it: it can only use connections it opened itself
    OUTBOUND_ONLY = "outbound_only"
    #: not learned (yet): no peer answered a dial-back; treated as dialable, as peers were before
    UNKNOWN = "unknown"


REACHABILITY_VALUES: frozenset[str] = frozenset(r.value for r in Reachability)
#: Highest TCP/UDP port number (16-bit field).
MAX_PORT: int = 65535


def _non_negative(owner: str, **values: int | float) -> None:
    for name, value in values.items():
        if not value >= 0:  # also catches NaN
            raise MalformedMessage(f"{owner}.{name} must be >= 0, got {value!r}")


def _check_route(owner: str, mb: MicrobatchId, hop: int, route: tuple[str, ...]) -> None:
    if not route or route[0] != mb.data_node or route[-1] != mb.data_node:
        raise MalformedMessage(f"{owner}.route must start and end at data node {mb.data_node[:100]!r}")
    if not 0 <= hop < len(route):
        raise MalformedMessage(f"{owner}.hop {hop} is outside route of length {len(route)}")


def _check_delivery(owner: str, deliver_at_unix: float | None) -> None:
    """An emulated delivery time is a finite, non-negative Unix time (how long a receiver honours it
    is the receiver's business: :mod:`node.dataplane.transport` caps the hold)."""
    if deliver_at_unix is not None and not (math.isfinite(deliver_at_unix) and deliver_at_unix >= 0):
        raise MalformedMessage(f"{owner}.deliver_at_unix must be a finite time >= 0, got {deliver_at_unix!r}")


@dataclass(frozen=True)
class MicrobatchId:
    """Names one microbatch swarm-wide; not a message itself but part of the hop messages."""

    run_id: str
    epoch: int
    iteration: int
    data_node: str
    index: int
    #: retry number of this microbatch within its iteration (a forward that failed is re-sent on a
    #: fresh path as attempt 1, ...); part of the identity so late frames of an old attempt are told apart
    attempt: int = 0

    def validate(self, options: DecodeOptions) -> None:
        """Counters are non-negative."""
        _non_negative("MicrobatchId", epoch=self.epoch, iteration=self.iteration, index=self.index,
                      attempt=self.attempt)


@dataclass(frozen=True)
class HopMessage:
    """One hop of a microbatch: its tensor sent to ``route[hop]``. The two directions share every field and
    check; they differ only in their wire ``TYPE`` (:class:`ActivationMessage`, :class:`GradientMessage`).

    ``route`` lists peer ids from the data node back to it (``route[0] == route[-1] ==
    mb.data_node``); ``hop`` is the receiver's index in ``route``.
    """

    mb: MicrobatchId
    hop: int
    route: tuple[str, ...]
    tensor: TensorFrame
    #: WAN emulation only (None otherwise): the Unix time at which the emulated link delivers
    #: this tensor; the receiver holds the message until then (see ``_check_delivery``).
    deliver_at_unix: float | None = None

    def validate(self, options: DecodeOptions) -> None:
        """The route is closed at the data node and ``hop`` indexes it; an emulated delivery time is finite."""
        _check_route(type(self).__name__, self.mb, self.hop, self.route)
        _check_delivery(type(self).__name__, self.deliver_at_unix)


@register_message
@dataclass(frozen=True)
class ActivationMessage(HopMessage):
    """Forward pass: a microbatch's activations, ``hop`` increasing along the route."""

    TYPE: ClassVar[str] = "activation"


@register_message
@dataclass(frozen=True)
class GradientMessage(HopMessage):
    """Backward pass: gradients w.r.t. the activations, travelling the same route with ``hop`` decreasing."""

    TYPE: ClassVar[str] = "gradient"


@register_message
@dataclass(frozen=True)
class HopFailure:
    """A hop of a microbatch could not be delivered or computed; tells the data node to drop or reroute it."""

    TYPE: ClassVar[str] = "hop_failure"

    mb: MicrobatchId
    hop: int
    peer_id: str
    reason: str

    def validate(self, options: DecodeOptions) -> None:
        """``hop`` is an index."""
        _non_negative("HopFailure", hop=self.hop)


@register_message
@dataclass(frozen=True)
class IterationDone:
    """A data node finished all its microbatches of an iteration.

    ``visits[peer_id]`` counts the microbatches of this data node that peer processed, so
    stage peers know how many gradient contributions to expect before averaging.
    """

    TYPE: ClassVar[str] = "iteration_done"

    run_id: str
    epoch: int
    iteration: int
    data_node: str
    visits: dict[str, int]
    dropped: int

    def validate(self, options: DecodeOptions) -> None:
        """Counters are non-negative."""
        _non_negative("IterationDone", epoch=self.epoch, iteration=self.iteration, dropped=self.dropped)
        _non_negative("IterationDone.visits", **{"[" + repr(k[:100]) + "]": v for k, v in self.visits.items()})


#: Bounds of a :class:`NormReport` (the same as the DHT norm record's, node.net.records).
NORM_REPORT_MAX_GROUP: int = 1024
NORM_REPORT_MAX_EPOCHS: int = 8
NORM_REPORT_MAX_EPOCH_BYTES: int = 256 * 1024


@register_message
@dataclass(frozen=True)
class NormReport:
    """A member's numbers for one iteration, sent directly to every member of the epoch after its
    averaging round: the per-iteration barrier (the DHT norm record carries the same numbers and
    is only read for a member whose report did not arrive).

    ``sq`` (the stage's squared gradient norm), ``checksum`` and ``loss_sum`` may be non-finite
    (a poisoned gradient or a diverged replica must be seen by everyone), but ``sq`` is never
    negative. ``epochs`` are encoded schedule epochs the sender knows of and others may not.
    """

    TYPE: ClassVar[str] = "norm_report"

    run_id: str
    epoch: int
    iteration: int
    peer_id: str
    stage: int
    sq: float
    checksum: float
    loss_sum: float
    n_mb: int
    tokens: int
    dropped: int
    avg_group: tuple[str, ...] = ()
    epochs: tuple[bytes, ...] = ()
    #: the sender's fp16 loss scale (1.0 in fp32/bf16): members check the data nodes' one
    loss_scale: float = 1.0

    def validate(self, options: DecodeOptions) -> None:
        """Counters are non-negative, ``sq`` is not negative (NaN and inf are allowed), lists are bounded,
        the loss scale is finite and positive."""
        _non_negative("NormReport", epoch=self.epoch, iteration=self.iteration, stage=self.stage,
                      n_mb=self.n_mb, tokens=self.tokens, dropped=self.dropped)
        if self.sq < 0:  # NaN compares False: allowed, like inf
            raise MalformedMessage(f"NormReport.sq must not be negative, got {self.sq!r}")
        if not (math.isfinite(self.loss_scale) and self.loss_scale > 0):
            raise MalformedMessage(f"NormReport.loss_scale must be finite and positive, got {self.loss_scale!r}")
        if len(self.avg_group) > NORM_REPORT_MAX_GROUP:
            raise MalformedMessage(f"NormReport.avg_group names more than {NORM_REPORT_MAX_GROUP} peers")
        if len(self.epochs) > NORM_REPORT_MAX_EPOCHS or any(len(e) > NORM_REPORT_MAX_EPOCH_BYTES for e in self.epochs):
            raise MalformedMessage(f"NormReport.epochs must be at most {NORM_REPORT_MAX_EPOCHS} encoded epochs of "
                                   f"at most {NORM_REPORT_MAX_EPOCH_BYTES} bytes")


#: Longest configuration digest an advert may carry (a hex SHA-256 is 64).
MAX_CONFIG_DIGEST_CHARS = 64


@register_message
@dataclass(frozen=True)
class StageAdvert:
    """A peer's periodic self-description: which stages it serves, how fast, with how much room."""

    TYPE: ClassVar[str] = "stage_advert"

    run_id: str
    peer_id: str
    gossip_peer_id: str
    maddrs: tuple[str, ...]
    gossip_maddrs: tuple[str, ...]
    stages: tuple[int, ...]
    state: str
    compute_s_per_sample_per_layer: float
    memory_slots: int
    free_slots: int
    protocol_version: int
    rpc_port: int | None
    location: str | None
    timestamp: float
    #: Digest of the training configuration this peer trains ("" when it does not train): members
    #: admit only peers with their own digest into a schedule epoch.
    config_digest: str = ""
    #: How others can reach this peer (a :class:`Reachability` value); absent from older senders.
    reachability: str = Reachability.UNKNOWN.value
    #: Compute speed measured while training (forward-equivalent seconds per sample per layer, the median of
    #: recent steps; :mod:`node.train.compute_meter`); None before enough steps, and from older senders.
    measured_compute_s_per_sample_per_layer: float | None = None
    #: The peer joined with ``--auto`` (any stage other than 0 suits it), so the coordinator may move it to the
    #: bottleneck stage at an epoch boundary; False from older senders and for nodes given ``--stages``.
    movable: bool = False
    #: The peer relays data-plane frames between members nobody can dial (``--relay``); False from older senders.
    relay: bool = False
    #: The peer could train an epoch that named it. False while a node whose join found its stage's replicas
    #: disagreeing waits before it tries again: members stop routing to it and waiting for its norms, also
    #: those that cannot probe it (both behind NAT), and no coordinator names it; True from older senders.
    ready: bool = True

    def validate(self, options: DecodeOptions) -> None:
        """Known state and reachability, non-negative counts, finite compute speeds (a measured one positive and
        bounded), a valid port and a short digest."""
        measured = self.measured_compute_s_per_sample_per_layer
        if measured is not None and not 0 < measured <= MAX_MEASURED_COMPUTE_S:  # also catches NaN
            raise MalformedMessage(f"StageAdvert.measured_compute_s_per_sample_per_layer must be in "
                                   f"(0, {MAX_MEASURED_COMPUTE_S:g}], got {measured!r}")
        if self.reachability not in REACHABILITY_VALUES:
            raise MalformedMessage(f"StageAdvert.reachability must be one of {sorted(REACHABILITY_VALUES)}, "
                                   f"got {self.reachability[:100]!r}")
        if len(self.config_digest) > MAX_CONFIG_DIGEST_CHARS:
            raise MalformedMessage(f"StageAdvert.config_digest longer than {MAX_CONFIG_DIGEST_CHARS} characters")
        if self.state not in PEER_STATES:
            raise MalformedMessage(f"StageAdvert.state must be one of {sorted(PEER_STATES)}, got {self.state[:100]!r}")
        _non_negative("StageAdvert", memory_slots=self.memory_slots, free_slots=self.free_slots)
        _non_negative("StageAdvert.stages", **{f"[{i}]": s for i, s in enumerate(self.stages)})
        if not (math.isfinite(self.compute_s_per_sample_per_layer) and self.compute_s_per_sample_per_layer >= 0):
            raise MalformedMessage(
                f"StageAdvert.compute_s_per_sample_per_layer must be finite and >= 0, got {self.compute_s_per_sample_per_layer!r}"
            )
        if self.rpc_port is not None and not 0 <= self.rpc_port <= MAX_PORT:
            raise MalformedMessage(f"StageAdvert.rpc_port {self.rpc_port} is not a port number")


@register_message
@dataclass(frozen=True)
class MembershipEvent:
    """A change in who is in the swarm, gossiped so every peer converges on the same member list."""

    TYPE: ClassVar[str] = "membership_event"

    run_id: str
    peer_id: str
    kind: str
    stages: tuple[int, ...]
    timestamp: float

    def validate(self, options: DecodeOptions) -> None:
        """Known kind, non-negative stages."""
        if self.kind not in MEMBERSHIP_KINDS:
            raise MalformedMessage(f"MembershipEvent.kind must be one of {sorted(MEMBERSHIP_KINDS)}, got {self.kind[:100]!r}")
        _non_negative("MembershipEvent.stages", **{f"[{i}]": s for i, s in enumerate(self.stages)})


@register_message
@dataclass(frozen=True)
class LinkReport:
    """Measured round-trip times and bandwidths from ``src`` to other peers, feeding the scheduler's cost model."""

    TYPE: ClassVar[str] = "link_report"

    run_id: str
    src: str
    timestamp: float
    rtt_ms: dict[str, float]
    bandwidth_Bps: dict[str, float]

    def validate(self, options: DecodeOptions) -> None:
        """Measurements are not negative (inf is allowed: an unreachable peer)."""
        for field in ("rtt_ms", "bandwidth_Bps"):
            for peer, value in getattr(self, field).items():
                if value < 0:
                    raise MalformedMessage(f"LinkReport.{field}[{peer[:100]!r}] must be >= 0, got {value!r}")


@register_message
@dataclass(frozen=True)
class ScheduleEpoch:
    """The coordinator's schedule for an epoch: ``members[i]`` is node index ``i`` of the schedule JSON.

    ``signature`` covers :meth:`signing_payload`, i.e. ``encode()`` of the message with
    ``signature=b""``, so any change to any other field invalidates it.
    """

    TYPE: ClassVar[str] = "schedule_epoch"

    run_id: str
    epoch: int
    coordinator: str
    issued_at: float
    members: tuple[str, ...]
    schedule: dict
    signature: bytes
    #: first training iteration that runs on this epoch; every node finishes earlier iterations on
    #: the epoch before, so all members switch at the same iteration boundary (0 = from the start)
    start_iteration: int = 0

    def validate(self, options: DecodeOptions) -> None:
        """``epoch`` and ``start_iteration`` are non-negative."""
        _non_negative("ScheduleEpoch", epoch=self.epoch, start_iteration=self.start_iteration)

    def signing_payload(self) -> bytes:
        """The bytes the coordinator signs: this message encoded with an empty signature."""
        return encode(dataclasses.replace(self, signature=b""))


@register_message
@dataclass(frozen=True)
class RpcRequest:
    """A request to a peer's control RPC (the CLI talking to its daemon, or peer to peer)."""

    TYPE: ClassVar[str] = "rpc_request"

    method: str
    params: dict


@register_message
@dataclass(frozen=True)
class RpcResponse:
    """The reply to an :class:`RpcRequest`: ``result`` when ``ok``, else an ``error`` text."""

    TYPE: ClassVar[str] = "rpc_response"

    ok: bool
    result: object
    error: str | None
