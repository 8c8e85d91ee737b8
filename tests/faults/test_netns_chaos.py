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
import time

import pytest

from node.net.rpc import call_http
from node.testing.netns import NamespaceSwarm, NetnsLab, lab_leftovers, netns_unavailable, run_in_netns
from tests.faults.daemon_helpers import train_args

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WHY_NOT = netns_unavailable()
LAB = "spnc"
SIZES = [2, 2, 1, 1]
ITERATIONS = 30
VICTIM = 2  # first replica of stage 1 (stage 1 has nodes 2 and 3)
KILL_AT = 8
#: per-host uplink: slow enough that the cap shapes the tiny model's traffic, fast enough for CI
RATE_MBIT = 50.0


def _state(swarm, index):
    node = swarm.nodes[index]
    if not node.alive or not node.info:
        return None
    url = node.rpc_url  # 127.0.0.1 of the node's own namespace
    try:
        return run_in_netns(swarm.namespace_of(node), call_http, url, "training", {"limit": 1000}, timeout=10)
    except Exception:  # noqa: BLE001 - a node that cannot answer right now
        return None


def _wait(swarm, nodes, predicate, timeout, what):
    deadline = time.monotonic() + timeout
    states = {}
    while True:
        for i in nodes:
            assert swarm.nodes[i].alive, f"node {i} exited while waiting for {what}: {swarm.last_error(swarm.nodes[i])}"
            s = _state(swarm, i)
            if s is not None:
                states[i] = s
                assert s.get("state") != "error", f"node {i} failed: {s.get('error')}"
        if len(states) == len(nodes) and all(predicate(states[i]) for i in nodes):
            return states
        assert time.monotonic() < deadline, (
            f"timed out after {timeout:.0f} s waiting for {what}: "
            f"{ {i: (s.get('state'), s.get('committed_iteration')) for i, s in states.items()} }")
        time.sleep(2.0)


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
            _wait(swarm, range(len(swarm.nodes)), lambda s: s.get("state") == "training", 600, "training to start")
            _wait(swarm, [0, 1], lambda s: (s.get("committed_iteration") or -1) >= KILL_AT, 600,
                  f"iteration {KILL_AT}")
            swarm.kill(VICTIM, signal.SIGKILL)
            survivors = [n.index for n in swarm.nodes if n.index != VICTIM]
            done = _wait(swarm, survivors, lambda s: s.get("state") == "done", 600, "training to finish")
        finally:
            swarm.stop()
    assert lab_leftovers(LAB) == []

    committed = set()
    for i in (0, 1):
        its = [h["iteration"] for h in done[i]["history"]]
        assert its == sorted(set(its)), f"data node {i} committed {its}"
        committed |= set(its)
    assert committed == set(range(ITERATIONS)), f"steps never committed: {set(range(ITERATIONS)) - committed}"
    for i in survivors:
        its = [h["iteration"] for h in done[i]["history"]]
        assert its and its == sorted(set(its)) and its[-1] == ITERATIONS - 1, (i, its)
    losses = [h["loss"] for h in done[0]["history"]]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, f"loss did not fall: {losses}"
