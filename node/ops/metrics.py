"""Prometheus metrics of one node, served as ``GET /metrics`` on the daemon's HTTP endpoint.

Every daemon owns one :class:`NodeMetrics` with its *own* ``CollectorRegistry`` (never the
process-global one): tests run several daemons in one interpreter, and a library that imports
us must not find our series in its registry. The daemon fills the control-plane gauges (epoch,
peers per state, RPC rejections, dropped gossip); the trainer reports training progress and
data-plane traffic through the typed ``record_*`` / ``set_*`` / ``count_*`` methods, so metric
names and labels are defined in this one place.

A short ring of recent iterations is kept next to the Prometheus series for the dashboard's
loss curve (``recent_iterations``), because Prometheus gauges only hold the latest value.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from protocol.messages import PEER_STATE_ORDER as STATES

__all__ = [
    "NodeMetrics",
    "METRICS_CONTENT_TYPE",
    "HOP_LATENCY_BUCKETS_S",
    "RECENT_ITERATIONS",
    "DIRECTIONS",
]

logger = logging.getLogger(__name__)

#: Content type of the text exposition format (what Prometheus scrapes).
METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST
#: Hop latency buckets in seconds: loopback (sub-ms) up to intercontinental links with big frames.
HOP_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Iterations kept for the dashboard's loss curve.
RECENT_ITERATIONS = 500
#: ``direction`` label values: "in" = received from that peer, "out" = sent to it.
DIRECTIONS = ("in", "out")
_PREFIX = "skippipe"


class NodeMetrics:
    """The metric series of one daemon. Thread-safe (prometheus_client is; the ring has a lock)."""

    def __init__(self, peer_id: str = "", recent_iterations: int = RECENT_ITERATIONS) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.iteration = Gauge(f"{_PREFIX}_iteration", "Last finished training iteration", registry=r)
        self.loss = Gauge(f"{_PREFIX}_loss", "Training loss of the last finished iteration", registry=r)
        self.tokens_per_s = Gauge(f"{_PREFIX}_tokens_per_second", "Training throughput of the last iteration", registry=r)
        self.microbatches = Counter(
            f"{_PREFIX}_microbatches", "Microbatch hops per peer and direction", ["peer", "direction"], registry=r
        )
        self.bytes = Counter(f"{_PREFIX}_data_bytes", "Data-plane bytes per peer and direction", ["peer", "direction"], registry=r)
        self.hop_latency = Histogram(
            f"{_PREFIX}_hop_latency_seconds",
            "Seconds one activation/gradient hop took on the wire",
            ["direction"],
            buckets=HOP_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.reroutes = Counter(f"{_PREFIX}_reroutes", "Microbatches re-routed around a failed node", registry=r)
        self.skips = Counter(
            f"{_PREFIX}_skips", "Stages a microbatch skipped because no replica of them was alive", registry=r
        )
        self.dropped_microbatches = Counter(
            f"{_PREFIX}_dropped_microbatches", "Microbatches this data node gave up after their retries", registry=r
        )
        self.failures = Counter(f"{_PREFIX}_failures", "Failures by kind", ["kind"], registry=r)
        self.schedule_epoch = Gauge(f"{_PREFIX}_schedule_epoch", "Adopted schedule epoch (0 = none yet)", registry=r)
        self.peers = Gauge(f"{_PREFIX}_peers", "Peers in this node's view per advertised state", ["state"], registry=r)
        self.rpc_requests = Counter(
            f"{_PREFIX}_rpc_requests", "RPC requests by transport and outcome", ["transport", "outcome"], registry=r
        )
        self.gossip_dropped = Counter(
            f"{_PREFIX}_gossip_dropped", "Gossip messages dropped, by reason", ["reason"], registry=r
        )
        self.dataplane_rejected = Counter(
            f"{_PREFIX}_dataplane_rejected",
            "Data-plane frames or streams refused, by reason (no peer label: a hostile peer picks its id)",
            ["reason"],
            registry=r,
        )
        self.relayed_bytes = Counter(f"{_PREFIX}_relayed_bytes", "Data-plane bytes this node relayed between members "
                                     "behind NAT (node.dataplane.relay)", registry=r)
        self.relayed_frames = Counter(f"{_PREFIX}_relayed_frames", "Data-plane frames this node relayed", registry=r)
        self.relayed_states = Counter(f"{_PREFIX}_relayed_states", "Stage-state streams this node piped between two "
                                      "members nobody else could connect", registry=r)
        self.relay_circuits = Gauge(f"{_PREFIX}_relay_circuits", "Relay streams members behind NAT hold open to this "
                                    "node", registry=r)
        self.loop_lag = Gauge(f"{_PREFIX}_loop_lag_seconds",
                              "How late the event loop's lag probe last woke (node.ops.looplag)", registry=r)
        self.loop_lag_max = Gauge(f"{_PREFIX}_loop_lag_max_seconds",
                                  "The latest the event loop's lag probe ever woke: its longest block", registry=r)
        self.info = Gauge(f"{_PREFIX}_node_info", "Constant 1, labelled with this node's peer id", ["peer_id"], registry=r)
        if peer_id:
            self.info.labels(peer_id=peer_id).set(1)
        for state in STATES:
            self.peers.labels(state=state).set(0)
        self._recent: collections.deque[dict] = collections.deque(maxlen=recent_iterations)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ trainer API
    def set_iteration(self, iteration: int, loss: float | None = None, tokens_per_s: float | None = None) -> None:
        """A training iteration finished (data nodes know the loss; others may pass None)."""
        self.iteration.set(int(iteration))
        if loss is not None:
            self.loss.set(float(loss))
        if tokens_per_s is not None:
            self.tokens_per_s.set(float(tokens_per_s))
        with self._lock:
            self._recent.append(
                {"iteration": int(iteration), "loss": loss, "tokens_per_s": tokens_per_s, "time": time.time()}
            )

    def set_loop_lag(self, lag_s: float, max_s: float) -> None:
        """One sample of :class:`node.ops.looplag.LoopLagProbe` (its ``on_sample``)."""
        self.loop_lag.set(lag_s)
        self.loop_lag_max.set(max_s)

    def record_hop(self, peer: str, seconds: float | None, nbytes: int, direction: str) -> None:
        """One microbatch (activation or gradient) went to (``"out"``) or came from (``"in"``) ``peer``."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        self.microbatches.labels(peer=peer, direction=direction).inc()
        if nbytes:
            self.bytes.labels(peer=peer, direction=direction).inc(int(nbytes))
        if seconds is not None and seconds >= 0:
            self.hop_latency.labels(direction=direction).observe(float(seconds))

    def count_failure(self, kind: str) -> None:
        """A failure of ``kind`` (e.g. ``"hop_timeout"``, ``"peer_lost"``, ``"nan_loss"``)."""
        self.failures.labels(kind=kind).inc()

    def count_rejected(self, reason: str) -> None:
        """The data plane refused a frame (or a stream) for ``reason`` (e.g. ``"non_finite"``, ``"rate_limited"``)."""
        self.dataplane_rejected.labels(reason=reason).inc()

    def count_relayed(self, nbytes: int) -> None:
        """This node relayed one data-plane frame of ``nbytes`` between two other members."""
        self.relayed_bytes.inc(int(nbytes))
        self.relayed_frames.inc()

    def count_relayed_state(self, nbytes: int = 0) -> None:
        """Part of a piped stage-state stream: ``nbytes`` more bytes (a new stream when 0)."""
        if nbytes:
            self.relayed_bytes.inc(int(nbytes))
        else:
            self.relayed_states.inc()

    def set_relay_circuits(self, n: int) -> None:
        self.relay_circuits.set(int(n))

    def relay_json(self) -> dict:
        """Relayed bytes, frames and open circuits, for the status RPC."""
        return {"relayed_bytes": int(self.sample(f"{_PREFIX}_relayed_bytes_total") or 0),
                "relayed_frames": int(self.sample(f"{_PREFIX}_relayed_frames_total") or 0),
                "relayed_states": int(self.sample(f"{_PREFIX}_relayed_states_total") or 0),
                "circuits": int(self.sample(f"{_PREFIX}_relay_circuits") or 0)}

    def count_reroute(self, n: int = 1) -> None:
        self.reroutes.inc(n)

    def count_skip(self, n: int = 1) -> None:
        """A microbatch skipped a stage on its route (no live replica, within the skip budget)."""
        self.skips.inc(n)

    def count_drop(self, n: int = 1) -> None:
        """A data node dropped one of its microbatches (the step is re-weighted without it)."""
        self.dropped_microbatches.inc(n)

    # ------------------------------------------------------------------ daemon API
    def set_schedule_epoch(self, epoch: int | None) -> None:
        self.schedule_epoch.set(int(epoch or 0))

    def set_peer_states(self, states: Iterable[str]) -> None:
        """Recount the peers-per-state gauge from the view's states (unknown states are kept too)."""
        counts: dict[str, int] = {s: 0 for s in STATES}
        for state in states:
            counts[state] = counts.get(state, 0) + 1
        for state, n in counts.items():
            self.peers.labels(state=state).set(n)

    def count_rpc(self, transport: str, outcome: str) -> None:
        """``transport`` "p2p" or "http"; ``outcome`` "ok", "error", "malformed" or "rate_limited"."""
        self.rpc_requests.labels(transport=transport, outcome=outcome).inc()

    def count_gossip_dropped(self, reason: str) -> None:
        self.gossip_dropped.labels(reason=reason).inc()

    # ------------------------------------------------------------------ readers
    def recent_iterations(self, limit: int | None = None) -> list[dict]:
        """The last ``limit`` iterations (oldest first) as ``{iteration, loss, tokens_per_s, time}``."""
        with self._lock:
            items = list(self._recent)
        return items[-limit:] if limit else items

    def traffic(self) -> dict[str, dict[str, float]]:
        """Per-peer totals ``{peer: {bytes_in, bytes_out, microbatches_in, microbatches_out}}``."""
        out: dict[str, dict[str, float]] = {}
        for counter, what in ((self.bytes, "bytes"), (self.microbatches, "microbatches")):
            for metric in counter.collect():
                for sample in metric.samples:
                    if not sample.name.endswith("_total"):
                        continue
                    row = out.setdefault(
                        sample.labels["peer"], {"bytes_in": 0, "bytes_out": 0, "microbatches_in": 0, "microbatches_out": 0}
                    )
                    row[f"{what}_{sample.labels['direction']}"] = sample.value
        return out

    def render(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)

    def sample(self, name: str, labels: Mapping[str, str] | None = None) -> float | None:
        """Current value of one sample (tests and the status RPC), or None if absent."""
        return self.registry.get_sample_value(name, dict(labels or {}))
