"""The daemon's built-in RPC methods and HTTP routes (``skippipe swarm status`` and the dashboard read them).

Only the handlers live here; what they report is the daemon's state, read through its public
members. Methods are served over libp2p and local HTTP alike (:class:`node.net.rpc.RpcServer`).

In a private swarm (``--swarm-key``) every method but ``hello`` and ``health`` answers a libp2p caller only if it
is a member (an advert with a valid swarm-key proof in this node's view, and listed if there is an
allowlist) or proves the swarm key for its own peer id in the call (``swarm_proof``, as ``hello``
does; ``skippipe swarm status --peer ... --swarm-key FILE``). Everyone else gets "access denied".
Local HTTP (bound to ``--rpc-host``, 127.0.0.1 by default) is the operator's and stays open.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from node.net.access import HELLO_PROOF_PARAM
from node.net.rpc import CALLER_PARAM, HttpReply
from node.ops.dashboard import dashboard_html
from node.ops.metrics import METRICS_CONTENT_TYPE

if TYPE_CHECKING:
    from node.swarm.host import SwarmHost

__all__ = ["DaemonRpcApi", "members_only"]

logger = logging.getLogger(__name__)

#: Iterations the ``iterations`` RPC returns when the caller does not say.
DEFAULT_RECENT_ITERATIONS = 200


#: Methods anyone may call: the access handshake itself and the liveness probe ({ok, state, peer id}).
OPEN_METHODS = frozenset({"hello", "health"})


def rpc_refusal(daemon: "SwarmHost", name: str, params: dict) -> str | None:
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


def members_only(daemon: "SwarmHost", name: str, method: Callable[[dict], Awaitable[Any]]):
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


class DaemonRpcApi:
    """``hello``, ``status``, ``swarm``, ``schedule``, ``health``, ``iterations``, ``traffic``, ``admit``,
    ``/metrics``, ``/``."""

    def __init__(self, daemon: "SwarmHost"):
        self.daemon = daemon

    def register(self) -> None:
        d = self.daemon
        for name in ("hello", "status", "swarm", "schedule", "health", "iterations", "traffic", "admit"):
            d.register_rpc(name, getattr(self, f"rpc_{name}"))
        d.rpc.register_http_route("/metrics", self.http_metrics)
        d.rpc.register_http_route("/", self.http_dashboard)

    async def rpc_hello(self, params: dict) -> dict:
        d = self.daemon
        refusal = d.access.check_hello(params.get(CALLER_PARAM), params.get(HELLO_PROOF_PARAM))
        if refusal is not None:
            d.log.warning("hello from %s refused: %s", params.get(CALLER_PARAM), refusal)
            raise PermissionError(refusal)
        return {
            "run_id": d.config.run_id,
            "protocol_version": d.protocol_version,
            "peer_id": d.peer_id,
            "run": d.run.to_json() if d.run else None,
            # what a joiner must train to be admitted (checked before it announces itself)
            "training": d.training_summary,
        }

    async def rpc_admit(self, params: dict) -> dict:
        """The admission challenge (:mod:`node.swarm.admission`): echo the nonce, say what we train."""
        d = self.daemon
        if d.admission is None:
            raise RuntimeError("not started")
        return d.admission.answer(params)

    async def rpc_status(self, params: dict) -> dict:
        return {**self.daemon.status_json(), "reachability": self.daemon.reachability.to_json()}

    async def rpc_swarm(self, params: dict) -> dict:
        view = self.daemon.view
        return view.to_json() if view else {"peers": [], "links": []}

    async def rpc_schedule(self, params: dict) -> dict:
        d = self.daemon
        epoch = d.current_epoch
        if epoch is None:
            return {"epoch": None, "status": d.coordinator.status if d.coordinator else "starting"}
        return {
            "epoch": epoch.epoch,
            "coordinator": epoch.coordinator,
            "issued_at": epoch.issued_at,
            "members": list(epoch.members),
            "schedule": epoch.schedule,
            "status": d.coordinator.status,
        }

    async def rpc_health(self, params: dict) -> dict:
        d = self.daemon
        ok = d.p2p is not None and d.p2p.is_alive and d.dht is not None and d.dht.is_alive()
        return {"ok": bool(ok), "state": str(d.state), "peer_id": d.peer_id}

    async def rpc_iterations(self, params: dict) -> dict:
        """Recent training iterations (the dashboard's loss curve)."""
        try:
            limit = max(1, int(params.get("limit", DEFAULT_RECENT_ITERATIONS)))
        except (TypeError, ValueError):
            raise ValueError("limit must be an integer") from None
        return {"peer_id": self.daemon.peer_id, "iterations": self.daemon.metrics.recent_iterations(limit)}

    async def rpc_traffic(self, params: dict) -> dict:
        """Data-plane totals per peer as counted by this node (the dashboard's throughput)."""
        return {"peer_id": self.daemon.peer_id, "peers": self.daemon.metrics.traffic()}

    async def http_metrics(self, params: dict) -> HttpReply:
        d = self.daemon
        if d.view is not None and d.membership is not None:
            d.membership.update_view_metrics()
        return HttpReply(200, METRICS_CONTENT_TYPE, d.metrics.render())

    async def http_dashboard(self, params: dict) -> HttpReply:
        return HttpReply(200, "text/html; charset=utf-8", dashboard_html())
