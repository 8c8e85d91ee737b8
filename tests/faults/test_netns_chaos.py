"""Chaos across real interfaces: daemons in network namespaces of their own, on capped links.

Six ``skippipe node run --train`` daemons, each in its own network namespace with its own address on a
veth pair plugged into one bridge, every uplink capped by ``tbf`` (:mod:`node.testing.netns`). So nothing
goes over 127.0.0.1 between nodes: adverts, gossip, the DHT, activations, gradients and averaging all cross
an interface under a bandwidth limit. 2 data nodes, stages 1-3 with 2, 1, 1 replicas, paths of 3 of 4
stages. A replica of stage 1 is SIGKILLed (its whole process group, like a machine losing power) once
training is under way; training must go on: every step committed exactly once and in order by the data
nodes, the loss falls, every survivor finishes, and the namespaces are gone afterwards.
"""

import signal

import pytest

from node.net.rpc import call_http
from node.testing.netns import NamespaceSwarm, NetnsLab, lab_leftovers, netns_unavailable, run_in_netns
from tests.faults.daemon_helpers import assert_each_step_committed_once, train_args, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.xdist_group("netns")]

WHY_NOT = netns_unavailable()
LAB = "spnc"
SIZES = [2, 2, 1, 1]
ITERATIONS = 30
VICTIM = 2  # first replica of stage 1 (stage 1 has nodes 2 and 3)
KILL_AT = 8
#: per-host uplink: slow enough that the cap shapes the tiny model's traffic, fast enough for CI
RATE_MBIT = 50.0


def _state_in_namespace(swarm):
    """A node's ``training`` RPC, read on the 127.0.0.1 of the node's own namespace."""
    def state_of(node):
        if not node.alive or not node.info:
            return None
        try:
            return run_in_netns(swarm.namespace_of(node), call_http, node.rpc_url, "training", {"limit": 1000},
                                timeout=10)
        except Exception:  # noqa: BLE001 - a node that cannot answer right now
            return None
    return state_of


@pytest.mark.skipif(WHY_NOT is not None, reason=f"network namespaces unavailable: {WHY_NOT}")
def test_daemons_on_their_own_addresses_survive_a_kill(tmp_path):
    lab = NetnsLab(LAB, hosts=sum(SIZES), rate_mbit=RATE_MBIT)
    with lab:
        swarm = NamespaceSwarm(lab, sum(SIZES), SIZES, base_dir=tmp_path / "swarm", run_id="netns", heartbeat_s=2.0,
                               path_length=3, extra_args=lambda i: train_args(ITERATIONS, sum(SIZES)))
        try:
            swarm.start(timeout=300)
            for node in swarm.nodes:  # every node advertises its own address, not loopback
                addresses = [m for m in node.info["maddrs"] if "/ip4/" in m]
                assert addresses and all(f"/ip4/{lab.address(node.index)}/" in m for m in addresses), node.info
            state_of = _state_in_namespace(swarm)
            wait_for(swarm, range(len(swarm.nodes)), lambda s: s.get("state") == "training", 600, "training to start",
                     poll_s=2.0, state_of=state_of)
            wait_for(swarm, [0, 1], lambda s: (s.get("committed_iteration") or -1) >= KILL_AT, 600,
                     f"iteration {KILL_AT}", poll_s=2.0, state_of=state_of)
            swarm.kill(VICTIM, signal.SIGKILL)
            survivors = [n.index for n in swarm.nodes if n.index != VICTIM]
            done = wait_for(swarm, survivors, lambda s: s.get("state") == "done", 600, "training to finish",
                            poll_s=2.0, state_of=state_of)
        finally:
            swarm.stop()
    assert lab_leftovers(LAB) == []

    assert_each_step_committed_once(done, (0, 1), survivors, ITERATIONS)
    losses = [h["loss"] for h in done[0]["history"]]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, f"loss did not fall: {losses}"
