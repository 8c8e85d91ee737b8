"""The daemon's built-in RPC methods and HTTP routes (``skippipe swarm status`` and the dashboard read them).

Only the handlers live here; what they report is the daemon's state, read through its public
members. Methods are served over libp2p and local HTTP alike (:class:`node.net.rpc.RpcServer`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from node.net.access import HELLO_PROOF_PARAM
from node.net.rpc import CALLER_PARAM, HttpReply
from node.ops.dashboard import dashboard_html
from node.ops.metrics import METRICS_CONTENT_TYPE

if TYPE_CHECKING:
    from node.swarm.daemon import Daemon

__all__ = ["DaemonRpcApi"]

logger = logging.getLogger(__name__)

#: Iterations the ``iterations`` RPC returns when the caller does not say.
DEFAULT_RECENT_ITERATIONS = 200


class DaemonRpcApi:
    """``hello``, ``status``, ``swarm``, ``schedule``, ``health``, ``iterations``, ``traffic``, ``/metrics``, ``/``."""

    def __init__(self, daemon: "Daemon"):
        self.daemon = daemon

    def register(self) -> None:
        d = self.daemon
        for name in ("hello", "status", "swarm", "schedule", "health", "iterations", "traffic"):
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
        }

    async def rpc_status(self, params: dict) -> dict:
        return self.daemon.status_json()

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
