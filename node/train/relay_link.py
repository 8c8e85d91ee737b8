"""The data plane's relay for one trainer, from what its host (the daemon) knows: which members relay
(their adverts), which peers nobody can dial from here (both adverts say outbound-only), and whether this
node itself serves as a relay (``--relay``, :func:`node.dataplane.relay.serves_relay`).

Only members of the current epoch are relays or relayed for: the relay and the client both check the
swarm's access rule (``allow``, members only in a private swarm) on every stream and frame.
"""

from __future__ import annotations

from typing import Callable, List, Optional

from node.dataplane.relay import RELAYS_PER_CLIENT, Relay, RelayClient, RelayMode, RelayServer, serves_relay
from node.dataplane.transport import MAX_FRAME_BYTES
from protocol.messages import Reachability
from scheduler.reachability import choose_relays

__all__ = ["relay_of", "reachability_of", "state_via", "state_route", "reaches_or_relayed"]


def relay_of(host, allow: Optional[Callable[[str], bool]]) -> Optional[Relay]:
    """A :class:`Relay` for a trainer on ``host`` (a daemon: ``p2p``, ``config.run_id``/``config.relay``,
    ``view``, ``reachability``, ``peer_alive``, ``metrics``); None for a host without a view (a bare test host)."""
    if getattr(host, "view", None) is None or not hasattr(host, "reachability"):
        return None
    mode = getattr(host.config, "relay", RelayMode.AUTO)

    def own() -> str:
        return host.reachability.value

    def relays() -> List[str]:
        live = {p: (e.advert.reachability, e.advert.relay) for p, e in host.view.peers.items() if host.peer_alive(p)}
        return choose_relays(live, str(host.peer_id), RELAYS_PER_CLIENT)

    def needs_relay(peer: str) -> bool:
        return not host.view.reaches(own(), peer)

    client = RelayClient(host.p2p, host.config.run_id, relays, needs_relay,
                         behind_nat=lambda: own() == Reachability.OUTBOUND_ONLY.value, allow=allow,
                         max_frame_bytes=MAX_FRAME_BYTES)
    server = (RelayServer(host.p2p, host.config.run_id, allow, MAX_FRAME_BYTES, metrics=host.metrics,
                          enabled=lambda: serves_relay(mode, own()), vouch=getattr(allow, "vouch", None))
              if mode is not RelayMode.OFF else None)
    return Relay(client, server)


def state_via(relay: Optional[Relay]) -> Optional[Callable[[str], Optional[str]]]:
    """How a trainer reaches a replica's state handler (:data:`node.dataplane.state_transfer.Via`): through
    the relay its data plane would use for that peer (one both keep a stream to), else directly."""
    return relay.route if relay is not None else None


def reachability_of(host) -> Optional[Callable[[str], str]]:
    """``peer -> reachability`` as ``host`` (a daemon) knows it: its own for itself, a peer's advertised one,
    ``unknown`` for a peer not in its view; None for a host without a view (a bare test host)."""
    if getattr(host, "view", None) is None or not hasattr(host, "reachability"):
        return None
    me = str(host.peer_id)

    return lambda peer: host.reachability.value if peer == me else host.view.reachability_of(peer)


def state_route(host) -> Optional[Callable[[str], Optional[str]]]:
    """:func:`state_via` for a host that has no trainer yet (an admission candidate taking its proof): the relay a
    data plane on ``host`` would pick for each peer; None for a host without a view."""
    relay = relay_of(host, getattr(host, "is_peer_allowed", None))
    return relay.route if relay is not None else None


def reaches_or_relayed(reaches: Callable[[str], bool], via: Optional[Callable[[str], Optional[str]]]
                       ) -> Callable[[str], bool]:
    """Whether a peer's state can be fetched: a direct connection can exist (``reaches``), or ``via`` names a relay."""
    return lambda peer: bool(reaches(peer) or (via is not None and via(peer)))
