"""Two volunteers behind NAT next to each other on every path train through a public member's relay.

Three daemons in the NAT lab: the data node on the public segment, stage 1 behind a port-preserving router
and stage 2 behind a strict one; paths visit both stages, so every activation from stage 1 to stage 2 and
every gradient back must cross between two nodes nobody can dial. The data node relays (``--relay auto``:
others can dial it), the coordinator prices that hop as relayed instead of impossible, and the NATed nodes
exchange their frames through the relay (:mod:`node.dataplane.relay`) on the streams they opened to it.
Checked from the schedule (relayed hops, none impossible) and from the relay's counters (relayed bytes in
its status RPC and ``/metrics``). With ``--relay off`` no epoch can be scheduled at all
(``SKIPPIPE_TEST_RELAY=off`` runs this test so, to see it fail).
"""

import os
import re
import time
import urllib.request

import pytest

from node.cli.swarm_cmd import fetch_status, format_status
from node.testing.nat import Home, NatKind, NatLab, nat_unavailable
from node.testing.nat_swarm import HEARTBEAT_S, RATE_MBIT, rpc_in_namespace
from node.testing.netns import NamespaceSwarm, lab_leftovers, run_in_netns
from scheduler.reachability import impossible_hops, relayed_hops
from scheduler.schedule import Schedule
from tests.faults.daemon_helpers import assert_each_step_committed_once, train_args, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.xdist_group("netns")]

WHY_NOT = nat_unavailable()
LAB = "spry"
#: The data node, then stages 1 and 2 with one replica each: nodes 1 and 2, each behind its own router.
SIZES = (1, 1, 1)
NATTED = (1, 2)
#: Enough iterations that every one of them crosses the relay both ways, few enough for CI.
ITERATIONS = 3
#: ``--relay`` for every node; ``off`` (to check the test fails without the relay) from the environment.
RELAY = os.environ.get("SKIPPIPE_TEST_RELAY", "auto")


def _metrics_text(rpc_url: str) -> str:
    base = rpc_url.split("/", 3)
    with urllib.request.urlopen(f"{base[0]}//{base[2]}/metrics", timeout=10) as answer:
        return answer.read().decode()


@pytest.mark.skipif(WHY_NOT is not None, reason=f"NAT lab unavailable: {WHY_NOT}")
def test_two_natted_neighbours_train_through_a_relay(tmp_path):
    lab = NatLab(LAB, public=1, homes=(Home(1, NatKind.PLAIN), Home(1, NatKind.STRICT)), subnet=106,
                 rate_mbit=RATE_MBIT)
    n = sum(SIZES)
    with lab:
        swarm = NamespaceSwarm(lab, n, list(SIZES), base_dir=tmp_path / "swarm", run_id="natrelay",
                               heartbeat_s=HEARTBEAT_S, path_length=len(SIZES),
                               extra_args=lambda i: train_args(ITERATIONS, n, "--relay", RELAY))
        try:
            started = time.monotonic()
            swarm.start(timeout=300)
            status_of = rpc_in_namespace(swarm, "status")
            done = wait_for(swarm, range(n), lambda s: s.get("state") == "done", 300, "training to finish",
                            poll_s=2.0, state_of=rpc_in_namespace(swarm, "training", {"limit": 1000}))
            print(f"trained {ITERATIONS} iterations in {time.monotonic() - started:.0f} s from start")
            status = {node.index: status_of(node) or {} for node in swarm.nodes}
            schedule = rpc_in_namespace(swarm, "schedule")(swarm.nodes[0])
            view = rpc_in_namespace(swarm, "swarm")(swarm.nodes[0])
            shown = format_status(run_in_netns(swarm.namespace_of(swarm.nodes[0]), fetch_status,
                                               swarm.nodes[0].rpc_url, None, 10))
            metrics = run_in_netns(swarm.namespace_of(swarm.nodes[0]), _metrics_text, swarm.nodes[0].rpc_url)
            logs = {i: swarm.nodes[i].log_path.read_text(errors="replace") for i in range(n)}
        finally:
            swarm.stop()
    assert lab_leftovers(LAB) == []

    assert [status[i]["reachability"]["reachability"] for i in NATTED] == ["outbound_only"] * 2, status
    relay = status[0]["relay"]
    assert relay["serving"] and relay["relayed_bytes"] > 0 and relay["relayed_frames"] >= 4 * ITERATIONS, relay
    assert [status[i]["relay"]["relayed_bytes"] for i in NATTED] == [0, 0], status  # they relay for nobody
    advertised = {p["peer_id"]: p.get("reachability") for p in view["peers"]}
    members = schedule["members"]
    reach = [advertised.get(m, "unknown") for m in members]
    sched = Schedule.from_json(schedule["schedule"])
    assert relayed_hops(sched, reach), (sched.paths, reach)  # the NATed pair is adjacent on the paths ...
    assert impossible_hops(sched, reach, relay=True) == [], sched.paths  # ... through the relay
    relayed = re.search(r"^skippipe_relayed_bytes_total ([0-9.e+]+)$", metrics, re.M)
    assert relayed and float(relayed.group(1)) >= relay["relayed_bytes"] > 0, metrics
    assert " ~> " in shown and "relay: serving" in shown and "+relay" in shown, shown  # swarm status says so
    assert_each_step_committed_once(done, (0,), range(n), ITERATIONS)
    for i in range(n):
        assert "Traceback" not in logs[i], logs[i][-3000:]
    for i in NATTED:  # each NATed node is told how others reach it
        assert f"reachability: reachable via relay {swarm.nodes[0].peer_id[-8:]}" in logs[i], logs[i][-3000:]
