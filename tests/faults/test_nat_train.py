"""Volunteers behind home NAT train: six daemons, two of them behind source-NAT routers (one strict).

:mod:`node.testing.nat`: nodes 0-3 on the public segment (2 data nodes, a replica of stage 1 each), node 4
(stage 2, beside public node 3) behind a port-preserving router, node 5 (stage 3) behind a strict one that
picks a new public port per destination; no port forward, every uplink capped by ``tbf``. The NATed nodes join with the founder's
join command unchanged and learn that nobody can dial them (dial-back), their adverts say so, and the
schedule never puts them next to each other: a third of the paths visit stages 2 and 3 (paths of 3 of 4
stages, every stage its equal share), and each of those must take public node 3, never node 4. Training
runs over the connections they opened: every step committed exactly once, the loss falls.
"""

import time

import pytest

from node.net.rpc import call_http
from node.testing.nat import Home, NatKind, NatLab, nat_unavailable
from node.testing.netns import NamespaceSwarm, lab_leftovers, run_in_netns
from scheduler.reachability import impossible_hops
from scheduler.schedule import Schedule
from tests.faults.daemon_helpers import assert_each_step_committed_once, train_args, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WHY_NOT = nat_unavailable()
LAB = "spnt"
SIZES = [2, 1, 2, 1]
ITERATIONS = 15
NATTED = (4, 5)
#: per-host uplink: as the namespace chaos test
RATE_MBIT = 50.0


def _rpc_in_namespace(swarm, method, params=None):
    def call(node):
        if not node.alive or not node.info:
            return None
        try:
            return run_in_netns(swarm.namespace_of(node), call_http, node.rpc_url, method, params or {}, timeout=10)
        except Exception:  # noqa: BLE001 - a node that cannot answer right now
            return None
    return call


@pytest.mark.skipif(WHY_NOT is not None, reason=f"NAT lab unavailable: {WHY_NOT}")
def test_two_natted_volunteers_train(tmp_path):
    lab = NatLab(LAB, public=4, homes=(Home(1, NatKind.PLAIN), Home(1, NatKind.STRICT)), subnet=94,
                 rate_mbit=RATE_MBIT)
    with lab:
        swarm = NamespaceSwarm(lab, sum(SIZES), SIZES, base_dir=tmp_path / "swarm", run_id="nat", heartbeat_s=2.0,
                               path_length=3, extra_args=lambda i: train_args(ITERATIONS, sum(SIZES)))
        try:
            started = time.monotonic()
            swarm.start(timeout=300)
            status_of, training_of = _rpc_in_namespace(swarm, "status"), _rpc_in_namespace(swarm, "training",
                                                                                             {"limit": 1000})
            reach = {n.index: (status_of(n) or {}).get("reachability", {}) for n in swarm.nodes}
            done = wait_for(swarm, range(len(swarm.nodes)), lambda s: s.get("state") == "done", 600,
                            "training to finish", poll_s=2.0, state_of=training_of)
            print(f"trained {ITERATIONS} iterations in {time.monotonic() - started:.0f} s")
            epoch = (status_of(swarm.nodes[0]) or {}).get("epoch")
            schedule = _rpc_in_namespace(swarm, "schedule")(swarm.nodes[0])
            view = _rpc_in_namespace(swarm, "swarm")(swarm.nodes[0])
            logs = {i: swarm.nodes[i].log_path.read_text() for i in NATTED}
        finally:
            swarm.stop()
    assert lab_leftovers(LAB) == []

    for i in NATTED:  # learned, not guessed: the public node saw the router's address and could not connect back
        r = reach[i]
        assert r.get("reachability") == "outbound_only", (i, r)
        assert r.get("observed_ip") == lab.router_address(lab.home_of(i)[0]), (i, r)
        assert "reachability: not reachable" in logs[i] and "forward TCP port" in logs[i], logs[i][-2000:]
    for i in range(4):
        assert reach[i].get("reachability") in ("direct", "unknown"), (i, reach[i])
    advertised = {p["peer_id"]: p.get("reachability") for p in view["peers"]}
    assert sorted(advertised[swarm.nodes[i].peer_id] for i in NATTED) == ["outbound_only"] * 2, advertised

    assert epoch is not None and schedule.get("schedule"), schedule
    sched = Schedule.from_json(schedule["schedule"])
    members = schedule["members"]
    member_reach = [advertised.get(m, "unknown") for m in members]
    assert impossible_hops(sched, member_reach) == [], sched.paths

    assert_each_step_committed_once(done, (0, 1), range(len(swarm.nodes)), ITERATIONS)
    losses = [h["loss"] for h in done[0]["history"]]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, f"loss did not fall: {losses}"
