"""How the daemon hands its parts what they use: the coordinator, admission, membership's network parts and
the RPC handlers each get explicit inputs (values, or callables for what starts late or is set later by a
service), read from the daemon here and nowhere else, so none of them keeps the daemon."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from node.swarm.admission import STAGE_PROBE_METHOD, Admission, rpc_over_p2p
from node.swarm.coordinator import Coordinator, epoch_membership
from node.swarm.membership import MembershipParts
from node.swarm.rpc_api import DaemonRpcApi, RpcSources
from node.dataplane.relay import serves_relay

if TYPE_CHECKING:
    from node.swarm.host import SwarmHost
    from protocol.messages import ScheduleEpoch

__all__ = ["admission_of", "coordinator_of", "membership_parts", "move_to_stage", "rpc_api_of"]


def membership_parts(daemon: "SwarmHost") -> MembershipParts:
    """What membership works with once the daemon's network, coordinator and admission are up."""
    return MembershipParts(
        peer_id=daemon.peer_id, public_key=daemon.identity.public_key_bytes, stages=daemon.stages, view=daemon.view,
        adverts=daemon.adverts, run=daemon.run, gossip=daemon.gossip, coordinator=daemon.coordinator,
        admission=daemon.admission)


async def move_to_stage(daemon: "SwarmHost", stage: int) -> None:
    """The epoch this node trains on gives it ``stage``: a node that joined with ``--auto`` (its advert says
    ``movable``) advertises that stage from now on, at once, when it is a new one; a node given ``--stages``
    keeps its advert (it may hold several, of which the coordinator assigns one)."""
    if daemon.config.stages is not None or tuple(daemon.stages) == (int(stage),):
        return
    daemon.stages = (int(stage),)
    if daemon.membership is not None:
        await daemon.membership.move_to(daemon.stages)


def coordinator_of(daemon: "SwarmHost", on_adopt: Callable[["ScheduleEpoch"], None]) -> Coordinator:
    """The daemon's coordinator over its view, run and admission, publishing through its membership; the
    training service's hooks (progress, blocker) are read at each call, as the service sets them after."""
    cfg = daemon.config
    coordinator = Coordinator(
        run_id=cfg.run_id, identity=daemon.identity, view=daemon.view, run=daemon.run, memory=cfg.memory_slots,
        debounce_s=cfg.epoch_debounce_s, takeover_s=cfg.coordinator_timeout_s, budget_s=cfg.schedule_budget_s,
        publish=daemon.membership.publish_epoch, on_adopt=on_adopt,
        progress=lambda lead_s=0.0: daemon.training_progress(lead_s) if daemon.training_progress is not None else None,
        admission=daemon.admission, replan=cfg.replan)
    coordinator.blocker = lambda: daemon.coordination_blocker() if daemon.coordination_blocker is not None else None
    return coordinator


def admission_of(daemon: "SwarmHost") -> Admission:
    """The daemon's admission: challenges over its libp2p host, progress from its training service."""
    return Admission(
        daemon.peer_id, daemon.config_digest, rpc_over_p2p(daemon), lambda: daemon.stages, daemon.log,
        iteration=lambda: daemon.training_iteration() if daemon.training_iteration is not None else None,
        epoch_start=lambda: int(daemon.current_epoch.start_iteration) if daemon.current_epoch is not None else 0,
        ready=lambda: daemon.training_ready() if daemon.training_ready is not None else True,
        reachable=lambda peer: can_connect(daemon, peer),
        sketch=lambda stage, nonce: _stage_sketch(daemon, stage, nonce),
        replicas=lambda stage: [p for p, s in (epoch_membership(daemon.current_epoch) if daemon.current_epoch else ())
                                if s == stage and daemon.peer_alive(p)],  # live ones: references and sources
        ask_replica=rpc_over_p2p(daemon, STAGE_PROBE_METHOD),
        is_member=lambda peer: daemon.current_epoch is not None and peer in daemon.current_epoch.members)


async def _stage_sketch(daemon: "SwarmHost", stage: int, nonce: bytes):
    """The training service's stage probe sketch (None without a service, or for a stage it does not hold)."""
    hook = daemon.training_sketch
    return await hook(stage, nonce) if hook is not None else None


def can_connect(daemon: "SwarmHost", peer_id: str) -> bool:
    """Can a connection between this node and ``peer_id`` exist, by what both adverts say (unknown: yes)?"""
    return daemon.view is None or daemon.view.reaches(daemon.reachability.value, peer_id)


def rpc_api_of(daemon: "SwarmHost") -> DaemonRpcApi:
    """The built-in RPC handlers over the daemon's parts (made with the daemon, before any part starts)."""
    return DaemonRpcApi(RpcSources(
        config=daemon.config, protocol_version=daemon.protocol_version, metrics=daemon.metrics, log=daemon.log,
        status=lambda: {**daemon.status_json(), "reachability": daemon.reachability.to_json(),
                        "relay": {"serving": serves_relay(daemon.config.relay, daemon.reachability.value),
                                  **daemon.metrics.relay_json()}},
        access=lambda: daemon.access, peer_id=lambda: daemon.peer_id, state=lambda: daemon.state,
        run=lambda: daemon.run, training_summary=lambda: daemon.training_summary, view=lambda: daemon.view,
        coordinator=lambda: daemon.coordinator, admission=lambda: daemon.admission,
        healthy=lambda: (daemon.p2p is not None and daemon.p2p.is_alive and daemon.dht is not None
                         and daemon.dht.is_alive()),
        update_view_metrics=daemon.membership.update_view_metrics))
