"""Which data nodes' finish times a route change can move: the components of replica sharing.

In the simulator two data nodes interact only through nodes both of their routes visit (a node
runs one task at a time and has its own memory slots; links are per node pair). So data nodes
fall into components, connected through shared replicas, and a changed route can only move the
finish times of the data nodes in the component of the data node it belongs to, taken over the
routes before and after the change. Simulating that component alone gives each of its data nodes
the finish time a simulation of the whole iteration gives it.

Where every data node has replicas of its own (:func:`scheduler.paths.replica_set_routes`) the
components hold one to a few data nodes, and a local-search step simulates a hundredth of the
iteration at 1,000 nodes; where routes share replicas everywhere the component is the whole
iteration and nothing is saved.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

__all__ = ["Sharing"]


class Sharing:
    """Per replica, how many microbatches of each data node visit it, kept up to date as
    routes change; :meth:`component` closes a set of data nodes over shared replicas."""

    def __init__(self, routes: Mapping[int, Sequence[Sequence[int]]]):
        self.users: dict[int, dict[int, int]] = {}
        for d, rs in routes.items():
            for r in rs:
                self.add(d, r)

    def add(self, d: int, route: Sequence[int]) -> None:
        for v in route[1:]:
            u = self.users.setdefault(v, {})
            u[d] = u.get(d, 0) + 1

    def remove(self, d: int, route: Sequence[int]) -> None:
        for v in route[1:]:
            u = self.users[v]
            u[d] -= 1
            if not u[d]:
                del u[d]

    def component(self, routes: Mapping[int, Sequence[Sequence[int]]], seeds: Iterable[int],
                  limit: int | None = None) -> set[int]:
        """The data nodes reachable from ``seeds`` through replicas their routes share; stops
        early (returning what it has, more than ``limit``) once it holds more than ``limit``."""
        out = set(seeds)
        stack = list(out)
        seen_nodes: set[int] = set()
        while stack:
            d = stack.pop()
            for r in routes[d]:
                for v in r[1:]:
                    if v in seen_nodes:
                        continue
                    seen_nodes.add(v)
                    for x in self.users.get(v, ()):
                        if x not in out:
                            out.add(x)
                            stack.append(x)
                            if limit is not None and len(out) > limit:
                                return out
        return out

    def largest(self, routes: Mapping[int, Sequence[Sequence[int]]]) -> int:
        """Data nodes in the largest component."""
        left = set(routes)
        best = 0
        while left:
            c = self.component(routes, [next(iter(left))])
            best = max(best, len(c))
            left -= c
        return best
