"""Cost model: per-microbatch compute time per node and activation transfer time per node pair.

The scheduler only ever sees a :class:`CostMatrix` (``compute_s`` per node, ``link_s`` per
ordered pair). How it is built is up to the caller: from a measured location profile
(:func:`build_cost`, what ``skippipe plan`` and the benchmark use), or from live measurements of
a swarm (:func:`cost_from_measurements`). Every constant is a parameter with a default whose
origin is stated, nothing is a module global.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from scheduler.errors import ScheduleError

__all__ = [
    "GIB",
    "Link",
    "LinkProfile",
    "NodeSpec",
    "ModelShape",
    "CostParams",
    "CostMatrix",
    "activation_bytes",
    "transfer_time_s",
    "nodes_round_robin",
    "build_cost",
    "cost_from_measurements",
    "link_busy_matrix",
]

#: Bytes in a GiB; the reference profiles state bandwidth in GiB/s.
GIB = 2**30


@dataclass(frozen=True)
class Link:
    """One measured link: one-way latency in milliseconds and bandwidth in GiB/s."""

    latency_ms: float
    bandwidth_GiBps: float


@dataclass(frozen=True)
class LinkProfile:
    """Latency/bandwidth between locations plus per-location compute speed.

    ``links`` is keyed by ``(a, b)`` location pairs; lookups try both orders, so a profile
    needs each unordered pair once. Pairs inside one location use ``same_location``.
    ``compute_s_per_sample_per_layer`` maps a location to its seconds per sample per layer;
    ``default_compute_s_per_sample_per_layer`` covers locations not listed.
    """

    name: str
    locations: tuple[str, ...]
    links: Mapping[tuple[str, str], Link]
    same_location: Link = Link(1.0, 2.0)
    default_compute_s_per_sample_per_layer: float = 0.055
    compute_s_per_sample_per_layer: Mapping[str, float] = field(default_factory=dict)

    def link(self, a: str, b: str) -> Link:
        """The link between locations ``a`` and ``b`` (either key order)."""
        if a == b:
            return self.same_location
        found = self.links.get((a, b)) or self.links.get((b, a))
        if found is None:
            raise ScheduleError("profile", f"no link between locations {a!r} and {b!r}")
        return found

    def compute_for(self, location: str) -> float:
        return float(self.compute_s_per_sample_per_layer.get(location, self.default_compute_s_per_sample_per_layer))

    @classmethod
    def from_dict(cls, data: Mapping) -> "LinkProfile":
        """Parse the profile JSON object (see ``docs/scheduler.md``); raises ScheduleError."""
        try:
            locations = tuple(str(x) for x in data["locations"])
            links: dict[tuple[str, str], Link] = {}
            for key, value in data["links"].items():
                a, sep, b = str(key).partition("-")
                if not sep or a not in locations or b not in locations:
                    raise ScheduleError("profile", f"link key {key!r} is not 'A-B' over known locations")
                links[(a, b)] = Link(float(value["latency_ms"]), float(value["bandwidth_GiBps"]))
            same = data.get("same_location", {"latency_ms": 1.0, "bandwidth_GiBps": 2.0})
            compute = data.get("compute_s_per_sample_per_layer", 0.055)
            if isinstance(compute, Mapping):
                per_loc = {str(k): float(v) for k, v in compute.items()}
                default = float(data.get("default_compute_s_per_sample_per_layer", 0.055))
            else:
                per_loc, default = {}, float(compute)
            profile = cls(
                name=str(data.get("name", "profile")),
                locations=locations,
                links=links,
                same_location=Link(float(same["latency_ms"]), float(same["bandwidth_GiBps"])),
                default_compute_s_per_sample_per_layer=default,
                compute_s_per_sample_per_layer=per_loc,
            )
        except ScheduleError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ScheduleError("profile", f"malformed profile: {e!r}") from None
        for (a, b), link in links.items():
            if not (link.bandwidth_GiBps > 0 and link.latency_ms >= 0):
                raise ScheduleError("profile", f"link {a}-{b} needs bandwidth > 0 and latency >= 0")
        for i, a in enumerate(locations):
            for b in locations[i + 1 :]:
                profile.link(a, b)  # every pair must be present
        return profile

    @classmethod
    def load(cls, path: str) -> "LinkProfile":
        """Load a profile JSON file. The only file I/O of the cost model."""
        try:
            with open(path, "r", encoding="utf-8") as f:
                data = json.load(f)
        except OSError as e:
            raise ScheduleError("profile", f"cannot read {path}: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise ScheduleError("profile", f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(data)


@dataclass(frozen=True)
class NodeSpec:
    """A node as the cost model sees it."""

    id: int
    location: str
    compute_s_per_sample_per_layer: float
    memory_slots: int = 3


@dataclass(frozen=True)
class ModelShape:
    """The model and microbatch shape that fix compute and activation sizes.

    Defaults are the reference's 500M LLaMA setting (d_model 1024, context 1024, 4 layers per
    stage, 8 samples per microbatch, fp32 activations).
    """

    layers_per_stage: int = 4
    d_model: int = 1024
    seq_len: int = 1024
    samples_per_microbatch: int = 8
    #: real bytes per element on the wire: 4 (fp32), 2 (bf16/fp16), 1 + 4/64 (int8 with block scales;
    #: protocol.compression.wire_bytes_per_element gives the figure of each wire format)
    bytes_per_element: float = 4


@dataclass(frozen=True)
class CostParams:
    """Constants of the time model.

    backward_ratio: backward time / forward time; 1.5 as in the reference runtime and
        simulator (a backward computes two matmuls per forward one, minus recomputation).
    loss_ratio: loss + LM-head time at the data node / forward time; 0.25 as in the reference.
    hop_overhead_s: fixed cost added to every transfer; the reference adds 0.13 + 0.2 + 0.02 =
        0.35 s per hop for GPU<->CPU copies, serialisation and the message stack.
    """

    backward_ratio: float = 1.5
    loss_ratio: float = 0.25
    hop_overhead_s: float = 0.35


@dataclass(frozen=True)
class CostMatrix:
    """What the scheduler needs: forward seconds per microbatch per node, transfer seconds per
    ordered pair ``link_s[u][v]`` (u sends to v), plus the backward and loss ratios.

    ``link_s[v][v]`` is 0 (a node does not send to itself).
    """

    compute_s: tuple[float, ...]
    link_s: tuple[tuple[float, ...], ...]
    backward_ratio: float = 1.5
    loss_ratio: float = 0.25

    def __post_init__(self) -> None:
        n = len(self.compute_s)
        object.__setattr__(self, "compute_s", tuple(float(x) for x in self.compute_s))
        object.__setattr__(self, "link_s", tuple(tuple(float(x) for x in row) for row in self.link_s))
        if len(self.link_s) != n or any(len(row) != n for row in self.link_s):
            raise ScheduleError("cost", f"link_s must be {n}x{n} to match compute_s")
        for v, c in enumerate(self.compute_s):
            if not (math.isfinite(c) and c >= 0):
                raise ScheduleError("cost", f"compute_s[{v}] = {c} must be finite and >= 0")
        for u, row in enumerate(self.link_s):
            for v, x in enumerate(row):
                if not (math.isfinite(x) and x >= 0):
                    raise ScheduleError("cost", f"link_s[{u}][{v}] = {x} must be finite and >= 0")
        if not (self.backward_ratio >= 0 and self.loss_ratio >= 0):
            raise ScheduleError("cost", "backward_ratio and loss_ratio must be >= 0")

    @property
    def n_nodes(self) -> int:
        return len(self.compute_s)

    def forward_s(self, v: int) -> float:
        return self.compute_s[v]

    def backward_s(self, v: int) -> float:
        return self.compute_s[v] * self.backward_ratio

    def loss_s(self, v: int) -> float:
        return self.compute_s[v] * self.loss_ratio

    def to_json(self) -> dict:
        return {
            "compute_s": list(self.compute_s),
            "link_s": [list(row) for row in self.link_s],
            "backward_ratio": self.backward_ratio,
            "loss_ratio": self.loss_ratio,
        }

    @classmethod
    def from_json(cls, data: Mapping) -> "CostMatrix":
        try:
            return cls(
                compute_s=tuple(data["compute_s"]),
                link_s=tuple(tuple(row) for row in data["link_s"]),
                backward_ratio=float(data.get("backward_ratio", 1.5)),
                loss_ratio=float(data.get("loss_ratio", 0.25)),
            )
        except ScheduleError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ScheduleError("cost", f"malformed cost: {e!r}") from None


def activation_bytes(shape: ModelShape) -> int:
    """Bytes of one microbatch's activation (or gradient) between stages: the hidden state."""
    return math.ceil(shape.bytes_per_element * shape.d_model * shape.seq_len * shape.samples_per_microbatch)


def transfer_time_s(latency_ms: float, bandwidth_Bps: float, nbytes: float, hop_overhead_s: float = 0.35) -> float:
    """Seconds to move ``nbytes`` over a link: latency + size / bandwidth + fixed per-hop overhead.

    Bandwidth is not shared between concurrent transfers (the reference's model too).
    """
    if bandwidth_Bps <= 0:
        raise ScheduleError("cost", f"bandwidth must be > 0, got {bandwidth_Bps}")
    return latency_ms / 1000.0 + nbytes / bandwidth_Bps + hop_overhead_s


def nodes_round_robin(
    profile: LinkProfile,
    n_nodes: int,
    memory_slots: int = 3,
    locations: Sequence[str] | None = None,
) -> tuple[NodeSpec, ...]:
    """Nodes ``0..n_nodes-1``, node i at ``locations[i]`` if given, else at the profile's
    locations round-robin (the reference's placement)."""
    if n_nodes < 1:
        raise ScheduleError("nodes", "need at least one node")
    if locations is not None:
        if len(locations) != n_nodes:
            raise ScheduleError("nodes", f"{len(locations)} locations given for {n_nodes} nodes")
        unknown = sorted(set(locations) - set(profile.locations))
        if unknown:
            raise ScheduleError("nodes", f"unknown locations {unknown}")
        locs = list(locations)
    else:
        locs = [profile.locations[i % len(profile.locations)] for i in range(n_nodes)]
    return tuple(NodeSpec(i, loc, profile.compute_for(loc), memory_slots) for i, loc in enumerate(locs))


def build_cost(
    nodes: Sequence[NodeSpec],
    profile: LinkProfile,
    shape: ModelShape = ModelShape(),
    params: CostParams = CostParams(),
) -> CostMatrix:
    """Cost matrix for ``nodes`` placed on ``profile`` locations running a model of ``shape``.

    forward = s/sample/layer x layers per stage x samples per microbatch; transfer = latency +
    activation bytes / bandwidth + hop overhead. Node ids must be ``0..len(nodes)-1`` in order.
    """
    for i, node in enumerate(nodes):
        if node.id != i:
            raise ScheduleError("nodes", f"node ids must be 0..{len(nodes) - 1} in order (got {node.id} at {i})")
    nbytes = activation_bytes(shape)
    compute = tuple(n.compute_s_per_sample_per_layer * shape.layers_per_stage * shape.samples_per_microbatch for n in nodes)
    link = []
    for a in nodes:
        row = []
        for b in nodes:
            if a.id == b.id:
                row.append(0.0)
            else:
                lk = profile.link(a.location, b.location)
                row.append(transfer_time_s(lk.latency_ms, lk.bandwidth_GiBps * GIB, nbytes, params.hop_overhead_s))
        link.append(tuple(row))
    return CostMatrix(compute, tuple(link), params.backward_ratio, params.loss_ratio)


def link_busy_matrix(
    nodes: Sequence[NodeSpec],
    profile: LinkProfile,
    shape: ModelShape = ModelShape(),
) -> tuple[tuple[float, ...], ...]:
    """Seconds one activation occupies each directed link (bytes / bandwidth): the part of
    :func:`build_cost`'s ``link_s`` that concurrent transfers on one link must take in turn
    (``scheduler.simulator.simulate(..., link_busy_s=...)``). Node ids as in :func:`build_cost`."""
    nbytes = activation_bytes(shape)
    return tuple(
        tuple(0.0 if a.id == b.id else nbytes / (profile.link(a.location, b.location).bandwidth_GiBps * GIB)
              for b in nodes)
        for a in nodes
    )


def cost_from_measurements(
    compute_s_per_sample_per_layer: Sequence[float],
    latency_ms: Sequence[Sequence[float]],
    bandwidth_Bps: Sequence[Sequence[float]],
    shape: ModelShape = ModelShape(),
    params: CostParams = CostParams(),
) -> CostMatrix:
    """Cost matrix from live measurements (what a swarm coordinator has): per-node compute speed
    and per-pair one-way latency (ms) and bandwidth (bytes/s). Node i is index i."""
    n = len(compute_s_per_sample_per_layer)
    if len(latency_ms) != n or len(bandwidth_Bps) != n:
        raise ScheduleError("cost", "latency and bandwidth matrices must have one row per node")
    nbytes = activation_bytes(shape)
    compute = tuple(float(c) * shape.layers_per_stage * shape.samples_per_microbatch for c in compute_s_per_sample_per_layer)
    link = tuple(
        tuple(0.0 if u == v else transfer_time_s(latency_ms[u][v], bandwidth_Bps[u][v], nbytes, params.hop_overhead_s) for v in range(n))
        for u in range(n)
    )
    return CostMatrix(compute, link, params.backward_ratio, params.loss_ratio)
