"""The daemon's built-in RPC methods and HTTP routes (``skippipe swarm status`` and the dashboard read them).

Only the handlers live here; what they report comes from :class:`RpcSources`, the daemon's parts they read
(callables for those that start late), handed over by the daemon. Methods are served over libp2p and local
HTTP alike (:class:`node.net.rpc.RpcServer`).

In a private swarm (``--swarm-key``) every method but ``hello`` and ``health`` answers a libp2p caller only if it
is a member (an advert with a valid swarm-key proof in this node's view, and listed if there is an
allowlist) or proves the swarm key for its own peer id in the call (``swarm_proof``, as ``hello``
does; ``skippipe swarm status --peer ... --swarm-key FILE``). Everyone else gets "access denied".
Local HTTP (bound to ``--rpc-host``, 127.0.0.1 by default) is the operator's and stays open.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional, Protocol

from node.net.access import HELLO_PROOF_PARAM, SwarmAccess
from node.net.rpc import CALLER_PARAM, HttpReply
from node.ops.dashboard import dashboard_html
from node.ops.metrics import METRICS_CONTENT_TYPE

if TYPE_CHECKING:
    from node.net.rpc import RpcServer
    from node.ops.metrics import NodeMetrics
    from node.swarm.admission import Admission
    from node.swarm.config import DaemonConfig
    from node.swarm.coordinator import Coordinator, RunConfig
    from node.swarm.states import NodeState
    from node.swarm.view import SwarmView

__all__ = ["DaemonRpcApi", "RpcSources", "RpcGate", "members_only", "rpc_refusal"]

logger = logging.getLogger(__name__)

#: Iterations the ``iterations`` RPC returns when the caller does not say.
DEFAULT_RECENT_ITERATIONS = 200


#: Methods anyone may call: the access handshake itself and the liveness probe ({ok, state, peer id}).
OPEN_METHODS = frozenset({"hello", "health"})


class RpcGate(Protocol):
    """What the members-only check reads: the swarm's access rules, who is a member, where to log refusals."""

    access: SwarmAccess
    log: logging.Logger

    def is_peer_allowed(self, peer_id: str) -> bool: ...


def rpc_refusal(daemon: RpcGate, name: str, params: dict) -> str | None:
    """Why a call of ``name`` must be refused (see the module docstring), or None."""
    access = daemon.access
    if name in OPEN_METHODS or access is None or access.swarm_key is None:
        return None
    caller = params.get(CALLER_PARAM) if isinstance(params, dict) else None
    if caller is None:
        return None  # local HTTP: the operator
    if daemon.is_peer_allowed(str(caller)):
        return None
    if access.listed(str(caller)) and access.check_hello(str(caller), params.get(HELLO_PROOF_PARAM)) is None:
        return None
    return "access denied: this swarm's state is readable by members only (pass --swarm-key FILE)"


def members_only(daemon: RpcGate, name: str, method: Callable[[dict], Awaitable[Any]]):
    """``method`` behind :func:`rpc_refusal` (a refusal is raised as PermissionError, logged once per caller)."""
    if name in OPEN_METHODS:
        return method
    refused: set = set()

    async def gated(params: dict):
        refusal = rpc_refusal(daemon, name, params)
        if refusal is not None:
            caller = params.get(CALLER_PARAM)
            if caller not in refused and len(refused) < 1024:
                refused.add(caller)
                daemon.log.warning("rpc %s from %s refused: %s", name, caller, refusal)
            raise PermissionError(refusal)
        return await method(params)

    return gated


@dataclass(frozen=True)
class RpcSources:
    """What the built-in methods report, as the daemon hands it over: its fixed parts, and callables for the
    parts that start late (each returns None, or an empty value, until its part is up)."""

    config: "DaemonConfig"
    protocol_version: int
    metrics: "NodeMetrics"
    log: logging.Logger
    #: the daemon's status with its reachability
    status: Callable[[], dict]
    access: Callable[[], SwarmAccess]
    peer_id: Callable[[], str]
    state: Callable[[], "NodeState"]
    run: Callable[[], Optional["RunConfig"]]
    #: what this node trains (the hello reply tells joiners), None: nothing
    training_summary: Callable[[], Optional[dict]]
    view: Callable[[], Optional["SwarmView"]]
    coordinator: Callable[[], Optional["Coordinator"]]
    admission: Callable[[], Optional["Admission"]]
    #: p2pd and the DHT are up and alive
    healthy: Callable[[], bool]
    #: refresh the view's gauges before ``/metrics`` renders them
    update_view_metrics: Callable[[], None]


class DaemonRpcApi:
    """``hello``, ``status``, ``swarm``, ``schedule``, ``health``, ``iterations``, ``traffic``, ``admit``,
    ``stage_probe``, ``/metrics``, ``/``."""

    def __init__(self, sources: RpcSources):
        self.sources = sources

    def register(self, register_rpc: Callable[[str, Callable[[dict], Awaitable[Any]]], None],
                 rpc: "RpcServer") -> None:
        """Serve the methods through ``register_rpc`` (members only in a private swarm) and the routes on ``rpc``."""
        methods = {"hello": self.rpc_hello, "status": self.rpc_status, "swarm": self.rpc_swarm,
                   "schedule": self.rpc_schedule, "health": self.rpc_health, "iterations": self.rpc_iterations,
                   "traffic": self.rpc_traffic, "admit": self.rpc_admit,
                   "stage_probe": self.rpc_stage_probe}
        for name, method in methods.items():
            register_rpc(name, method)
        rpc.register_http_route("/metrics", self.http_metrics)
        rpc.register_http_route("/", self.http_dashboard)

    async def rpc_hello(self, params: dict) -> dict:
        d = self.sources
        refusal = d.access().check_hello(params.get(CALLER_PARAM), params.get(HELLO_PROOF_PARAM))
        if refusal is not None:
            d.log.warning("hello from %s refused: %s", params.get(CALLER_PARAM), refusal)
            raise PermissionError(refusal)
        run = d.run()
        return {
            "run_id": d.config.run_id,
            "protocol_version": d.protocol_version,
            "peer_id": d.peer_id(),
            "run": run.to_json() if run else None,
            # what a joiner must train to be admitted (checked before it announces itself)
            "training": d.training_summary(),
        }

    async def rpc_admit(self, params: dict) -> dict:
        """The admission challenge (:mod:`node.swarm.admission`): echo the nonce, say what we train."""
        admission = self.sources.admission()
        if admission is None:
            raise RuntimeError("not started")
        return await admission.answer_challenge(params)

    async def rpc_stage_probe(self, params: dict) -> dict:
        """A challenger's reference for a candidate's stage probe (:mod:`node.swarm.admission`): our sketch."""
        admission = self.sources.admission()
        if admission is None:
            raise RuntimeError("not started")
        return await admission.reference(params)

    async def rpc_status(self, params: dict) -> dict:
        return self.sources.status()

    async def rpc_swarm(self, params: dict) -> dict:
        view = self.sources.view()
        return view.to_json() if view else {"peers": [], "links": []}

    async def rpc_schedule(self, params: dict) -> dict:
        coordinator = self.sources.coordinator()
        epoch = coordinator.current if coordinator is not None else None
        if epoch is None:
            return {"epoch": None, "status": coordinator.status if coordinator else "starting"}
        return {
            "epoch": epoch.epoch,
            "coordinator": epoch.coordinator,
            "issued_at": epoch.issued_at,
            "members": list(epoch.members),
            "schedule": epoch.schedule,
            "status": coordinator.status,
        }

    async def rpc_health(self, params: dict) -> dict:
        d = self.sources
        return {"ok": bool(d.healthy()), "state": str(d.state()), "peer_id": d.peer_id()}

    async def rpc_iterations(self, params: dict) -> dict:
        """Recent training iterations (the dashboard's loss curve)."""
        try:
            limit = max(1, int(params.get("limit", DEFAULT_RECENT_ITERATIONS)))
        except (TypeError, ValueError):
            raise ValueError("limit must be an integer") from None
        return {"peer_id": self.sources.peer_id(), "iterations": self.sources.metrics.recent_iterations(limit)}

    async def rpc_traffic(self, params: dict) -> dict:
        """Data-plane totals per peer as counted by this node (the dashboard's throughput)."""
        return {"peer_id": self.sources.peer_id(), "peers": self.sources.metrics.traffic()}

    async def http_metrics(self, params: dict) -> HttpReply:
        self.sources.update_view_metrics()
        return HttpReply(200, METRICS_CONTENT_TYPE, self.sources.metrics.render())

    async def http_dashboard(self, params: dict) -> HttpReply:
        return HttpReply(200, "text/html; charset=utf-8", dashboard_html())
