"""The six-daemon swarm on a NAT lab, as the NAT tests and ``bench/nat.py`` run it.

Why one place: the tests check that volunteers behind NAT train correctly and the bench measures what
NAT costs; both must run the very same swarm (shape, which nodes sit behind which router, shaping), or
the bench would measure a swarm the tests never checked.

Shape (:data:`SIZES`): 2 data nodes (0, 1), stage 1 on node 2, stage 2 on nodes 3 and 4, stage 3 on
node 5; paths of :data:`PATH_LENGTH` of 4 stages. Behind NAT (``natted=True``): node 4 (a replica of
stage 2 beside public node 3) sits behind a port-preserving router and node 5 (stage 3's only node)
behind a strict one (:class:`node.testing.nat.NatKind`); the others on the public segment. Without
NAT all six are public. Every host's uplink is capped by ``tbf`` at the same rate either way.
``joiners`` more hosts follow for nodes added mid-run (:meth:`ProcessSwarm.add_node` takes the next
host): behind a router of their own when ``natted``, else public.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from node.launch.process_swarm import ProcessNode
from node.net.rpc import call_http
from node.testing.nat import Home, NatKind, NatLab
from node.testing.netns import NamespaceSwarm, run_in_netns

__all__ = ["SIZES", "NATTED", "PATH_LENGTH", "RATE_MBIT", "HEARTBEAT_S", "nat_swarm_lab", "nat_swarm",
           "rpc_in_namespace"]

#: 2 data nodes, then stages 1-3 with 1, 2, 1 replicas: stage 2 has a public and a NATed replica, stage 3
#: only a NATed one, so paths through stages 2 and 3 must take the public replica of stage 2.
SIZES = (2, 1, 2, 1)
#: The nodes behind routers when ``natted`` (node 4: plain router, node 5: strict router).
NATTED = (4, 5)
#: Paths visit 3 of the 4 stages, so a third of them visit stages 2 and 3 back to back.
PATH_LENGTH = 3
#: Per-host uplink cap (as the namespace chaos test): slow enough that the cap shapes the tiny model's
#: traffic, fast enough for CI.
RATE_MBIT = 50.0
#: Heartbeat of the swarm: as the other daemon tests (a loaded CI box keeps up with it).
HEARTBEAT_S = 2.0
#: Seconds an RPC to a daemon in its namespace may take before it counts as "no answer right now".
RPC_TIMEOUT_S = 10.0


def nat_swarm_lab(name: str, subnet: int, *, natted: bool = True, joiners: int = 0,
                  rate_mbit: float = RATE_MBIT) -> NatLab:
    """The lab for :func:`nat_swarm`: hosts for the six nodes and ``joiners`` more (see the module doc)."""
    n = sum(SIZES)
    if not natted:
        return NatLab(name, public=n + joiners, homes=(), subnet=subnet, rate_mbit=rate_mbit)
    homes = (Home(1, NatKind.PLAIN), Home(1, NatKind.STRICT)) + ((Home(joiners, NatKind.PLAIN),) if joiners else ())
    return NatLab(name, public=n - len(NATTED), homes=homes, subnet=subnet, rate_mbit=rate_mbit)


def nat_swarm(lab: NatLab, base_dir: Path, run_id: str,
              extra_args: Union[Sequence[str], Callable[[int], Sequence[str]]] = (),
              env: Optional[dict] = None) -> NamespaceSwarm:
    """The six daemons of :data:`SIZES` on ``lab`` (not started); ``extra_args`` as for ProcessSwarm."""
    return NamespaceSwarm(lab, sum(SIZES), list(SIZES), base_dir=base_dir, run_id=run_id, heartbeat_s=HEARTBEAT_S,
                          path_length=PATH_LENGTH, extra_args=extra_args, env=env)


def rpc_in_namespace(swarm: NamespaceSwarm, method: str,
                     params: Optional[dict] = None) -> Callable[[ProcessNode], Optional[dict]]:
    """``call(node)``: the node's ``method`` RPC, asked on the 127.0.0.1 of its own namespace; None while
    the node is not up or cannot answer."""
    def call(node: ProcessNode) -> Optional[dict]:
        if not node.alive or not node.info:
            return None
        try:
            return run_in_netns(swarm.namespace_of(node), call_http, node.rpc_url, method, params or {},
                                timeout=RPC_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a node that cannot answer right now
            return None
    return call
