"""Which links between nodes can exist at all, and what a relayed one costs.

A node behind a home router accepts no inbound connection. Two nodes can still exchange activations when
either can be dialled (the other dials it, and the answer flows back over that connection), or through a
relay one of them holds a reservation on (every byte then crosses the relay's uplink twice and takes an
extra hop). Public members serve as relays (``--relay``, :mod:`node.dataplane.relay`): with one in the
swarm (``relay=True`` below), a link between two nodes nobody can dial is relayed, priced by
:class:`RelayParams`. Two nodes that nobody can dial and that no relay carries cannot be connected at all:
such a link must never be on a path, whatever the measured numbers say.

Reachability values are :class:`protocol.messages.Reachability` strings, as adverts carry them. A node
whose reachability is not known (``unknown``, an older peer) is treated as dialable, as before.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Collection, Mapping, Sequence

from protocol.messages import Reachability
from scheduler.cost import CostMatrix
from scheduler.errors import ScheduleError
from scheduler.schedule import Schedule

__all__ = ["LinkKind", "RelayParams", "link_kind", "choose_relays", "connectable", "apply_reachability",
           "impossible_hops", "relayed_hops", "check_reachable", "stranded_stages", "stranded_replicas",
           "averaging_reducers"]

_DIALABLE = {Reachability.DIRECT.value, Reachability.UNKNOWN.value}


class LinkKind(enum.Enum):
    """How a connection between two nodes is made."""

    DIRECT = "direct"
    RELAYED = "relayed"
    IMPOSSIBLE = "impossible"


@dataclass(frozen=True)
class RelayParams:
    """What a relayed link costs when the link has not been measured through the relay (links are measured
    directly, and a link between two NATed nodes cannot be, so this is the usual case).

    relay_slowdown: a relayed transfer takes this times the direct estimate: the relay receives and sends
        every byte on one uplink, so at best half of it is left for each direction.
    relay_added_s: seconds added per relayed transfer: one more hop through a third machine's p2pd
        (about one wide-area round trip).
    impossible_link_s: the cost of a link that cannot be made. Large enough that a path search never
        prefers it while any other route exists (an iteration takes seconds); the schedule is then checked
        with :func:`check_reachable`, so it never carries such a link even if nothing else was possible.
    """

    relay_slowdown: float = 2.0
    relay_added_s: float = 0.1
    impossible_link_s: float = 1e6


def link_kind(a: str, b: str, relay: bool = False) -> LinkKind:
    """How nodes with reachability ``a`` and ``b`` connect (symmetric); ``relay``: a member of the swarm
    relays data-plane frames, so two nodes nobody can dial still exchange them through it."""
    if a in _DIALABLE or b in _DIALABLE:
        return LinkKind.DIRECT
    if relay or Reachability.RELAYED.value in (a, b):
        return LinkKind.RELAYED
    return LinkKind.IMPOSSIBLE


def connectable(a: str, b: str) -> bool:
    """Whether nodes with reachability ``a`` and ``b`` can be connected at all (directly or relayed)."""
    return link_kind(a, b) is not LinkKind.IMPOSSIBLE


def choose_relays(candidates: Mapping[str, tuple[str, bool]], own: str, limit: int) -> list[str]:
    """The relays a node uses, best first: of ``candidates`` (peer id -> (reachability, serves as relay)),
    those that relay and can be dialled, ``own`` left out, by peer id, at most ``limit``. By peer id because
    the sender and the receiver must pick the same relay from their own views with no exchange: both hold a
    stream to it (measured costs differ from node to node, a peer id does not)."""
    ok = sorted(p for p, (reach, relays) in candidates.items()
                if relays and p != own and reach in _DIALABLE)
    return ok[:limit]


def stranded_stages(own: str, replicas: Sequence[Collection[str]]) -> list[int]:
    """The stages a node of reachability ``own`` would hold stranded: stage ``s`` has live replicas
    (``replicas[s]``: their reachability values) and it can be connected to none of them, so it could
    neither take the stage's state from them nor average or re-sync with them. An empty stage is not
    stranded (its first replica has nobody to pair with anyway)."""
    return [s for s, theirs in enumerate(replicas) if theirs and not any(connectable(own, r) for r in theirs)]


def stranded_replicas(stage_of: Mapping[str, int], reachability: Mapping[str, str]) -> set[str]:
    """The nodes of ``stage_of`` (node -> stage) that share their stage with others but can be connected to
    none of them (``reachability``: node -> value; a node without one counts as ``unknown``, i.e. dialable)."""
    def reach(node: str) -> str:
        return reachability.get(node, Reachability.UNKNOWN.value)

    by_stage: dict[int, list[str]] = {}
    for node, s in stage_of.items():
        by_stage.setdefault(s, []).append(node)
    return {node for nodes in by_stage.values() if len(nodes) > 1 for node in nodes
            if not any(connectable(reach(node), reach(o)) for o in nodes if o != node)}


def averaging_reducers(stage_of: Mapping[str, int], reachability: Mapping[str, str]) -> dict[int, str]:
    """Stage -> the dialable node that reduces the gradient all-reduce of a stage whose replicas nobody can dial.

    A stage held by two or more replicas, none of them dialable and some two of them impossible to connect
    (:func:`connectable`), cannot average: each part of an all-reduce must be reduced by a peer every sender
    can reach. Such a stage gets a reducer: a dialable node of another stage (every replica can dial it)
    that joins the stage's all-reduce as an auxiliary peer, contributing nothing and reducing every part.
    Reducers are spread: each such stage, in stage order, takes the dialable node with the fewest reducer
    duties so far, ties broken by peer id, so every node computes the same answer from the same epoch and
    adverts. ``stage_of``: node -> stage; ``reachability``: node -> value (missing: ``unknown``, dialable).
    No stage gets a reducer when no node is dialable."""
    def reach(node: str) -> str:
        return reachability.get(node, Reachability.UNKNOWN.value)

    by_stage: dict[int, list[str]] = {}
    for node, s in stage_of.items():
        by_stage.setdefault(s, []).append(node)
    dialable = sorted(node for node in stage_of if reach(node) in _DIALABLE)
    duties = {node: 0 for node in dialable}
    reducers: dict[int, str] = {}
    for s in sorted(by_stage):
        nodes = sorted(by_stage[s])
        if len(nodes) < 2 or any(reach(n) in _DIALABLE for n in nodes) or not dialable:
            continue
        if all(connectable(reach(a), reach(b)) for i, a in enumerate(nodes) for b in nodes[i + 1:]):
            continue
        pick = min(dialable, key=lambda node: (duties[node], node))
        duties[pick] += 1
        reducers[s] = pick
    return reducers


def apply_reachability(cost: CostMatrix, reachability: Sequence[str], params: RelayParams = RelayParams(),
                       relay: bool = False) -> CostMatrix:
    """``cost`` with relayed links slowed down and impossible links priced out (node i has ``reachability[i]``;
    ``relay``: a member relays, see :func:`link_kind`)."""
    n = cost.n_nodes
    if len(reachability) != n:
        raise ScheduleError("cost", f"{len(reachability)} reachability values for {n} nodes")
    rows = []
    for u in range(n):
        row = list(cost.link_s[u])
        for v in range(n):
            if u == v:
                continue
            kind = link_kind(reachability[u], reachability[v], relay)
            if kind is LinkKind.RELAYED:
                row[v] = row[v] * params.relay_slowdown + params.relay_added_s
            elif kind is LinkKind.IMPOSSIBLE:
                row[v] = params.impossible_link_s
        rows.append(tuple(row))
    return CostMatrix(cost.compute_s, tuple(rows), cost.backward_ratio, cost.loss_ratio)


def _hops(route: Sequence[int]) -> list[tuple[int, int]]:
    """Every pair of nodes that exchange data on ``route``: each hop, and the last node back to the data node."""
    pairs = list(zip(route, route[1:]))
    if len(route) > 1:
        pairs.append((route[-1], route[0]))
    return pairs


def impossible_hops(schedule: Schedule, reachability: Sequence[str], relay: bool = False) -> list[tuple[int, int]]:
    """The hops of ``schedule`` between two nodes that cannot be connected (sorted, without repeats)."""
    return _hops_of(schedule, reachability, relay, LinkKind.IMPOSSIBLE)


def relayed_hops(schedule: Schedule, reachability: Sequence[str], relay: bool = True) -> list[tuple[int, int]]:
    """The hops of ``schedule`` that go through a relay (sorted, without repeats)."""
    return _hops_of(schedule, reachability, relay, LinkKind.RELAYED)


def _hops_of(schedule: Schedule, reachability: Sequence[str], relay: bool, kind: LinkKind) -> list[tuple[int, int]]:
    return sorted({(u, v) for p in schedule.paths for u, v in _hops(p.route)
                   if link_kind(reachability[u], reachability[v], relay) is kind})


def check_reachable(schedule: Schedule, reachability: Sequence[str], relay: bool = False) -> None:
    """Raise :class:`ScheduleError` if a path needs a connection that cannot exist."""
    bad = impossible_hops(schedule, reachability, relay)
    if bad:
        raise ScheduleError("reachability", f"hops {bad[:5]} join nodes nobody can dial and no relay carries")
