"""Volunteers behind home NAT train, crash and join: six daemons, two of them behind source-NAT routers
(one strict), then a NATed replica SIGKILLed and a NATed joiner arriving mid-run.

:mod:`node.testing.nat_swarm`: nodes 0-3 on the public segment (2 data nodes, stage 1 on node 2, a
replica of stage 2 on node 3), node 4 (stage 2, beside public node 3) behind a port-preserving router,
node 5 (stage 3) behind a strict one that picks a new public port per destination; no port forward,
every uplink capped by ``tbf``. The NATed nodes join with the founder's join command unchanged and learn
that nobody can dial them (dial-back), their adverts say so, and the schedule never puts two of them next
to each other: a third of the paths visit stages 2 and 3 (paths of 3 of 4 stages, every stage its equal
share), and each of those must take public node 3, never node 4.

Once training is under way, as the loopback chaos tests do: NATed node 4 is SIGKILLed (its whole process
group, like a home machine losing power) and a seventh daemon joins with ``--auto`` from a third home
network behind its own router. Training must go on over the connections the NATed nodes opened: the
joiner learns it is outbound-only, downloads its stage's state and trains to the end; every step is
committed exactly once by the data nodes, every survivor finishes, the loss falls, and the last schedule
(with the joiner) still has no hop between two unreachable nodes.
"""

import signal
import time

import pytest

from node.testing.nat import nat_unavailable
from node.testing.nat_swarm import NATTED, SIZES, nat_swarm, nat_swarm_lab, rpc_in_namespace
from node.testing.netns import lab_leftovers
from scheduler.reachability import impossible_hops
from scheduler.schedule import Schedule
from tests.faults.daemon_helpers import assert_each_step_committed_once, train_args, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200), pytest.mark.xdist_group("netns")]

WHY_NOT = nat_unavailable()
LAB = "spnt"
#: Long enough that the joiner, started at :data:`KILL_AT`, still finds iterations left: its start-up
#: (process, DHT, dial-back) plus the coordinator's join lead (capped at half of what is left) take about
#: 40 iterations of this tiny model on a loaded 2-core box.
ITERATIONS = 60
#: The NATed replica that is killed (stage 2 keeps public node 3).
VICTIM = 4
#: Data nodes' committed iteration at which the victim is killed and the joiner started.
KILL_AT = 2


@pytest.mark.skipif(WHY_NOT is not None, reason=f"NAT lab unavailable: {WHY_NOT}")
def test_natted_volunteers_train_crash_and_join(tmp_path):
    lab = nat_swarm_lab(LAB, 94, joiners=1)
    n = sum(SIZES)
    with lab:
        # no relay: this test checks that the schedule keeps the NATed nodes apart (test_nat_relay joins them)
        swarm = nat_swarm(lab, tmp_path / "swarm", "nat",
                          extra_args=lambda i: train_args(ITERATIONS, n, "--relay", "off"))
        try:
            started = time.monotonic()
            swarm.start(timeout=300)
            status_of, training_of = rpc_in_namespace(swarm, "status"), rpc_in_namespace(swarm, "training",
                                                                                         {"limit": 1000})
            reach = {node.index: (status_of(node) or {}).get("reachability", {}) for node in swarm.nodes}
            wait_for(swarm, range(n), lambda s: s.get("state") == "training", 600, "training to start", poll_s=2.0,
                     state_of=training_of)
            wait_for(swarm, [0, 1], lambda s: (s.get("committed_iteration") or -1) >= KILL_AT, 600,
                     f"iteration {KILL_AT}", poll_s=2.0, state_of=training_of)
            before = rpc_in_namespace(swarm, "swarm")(swarm.nodes[0])
            swarm.kill(VICTIM, signal.SIGKILL)
            joiner = swarm.add_node(stage=None, timeout=300)
            j = joiner.index
            assert not lab.is_public(j)
            reach[j] = (status_of(joiner) or {}).get("reachability", {})
            survivors = [node.index for node in swarm.nodes if node.index != VICTIM]
            done = wait_for(swarm, survivors, lambda s: s.get("state") == "done", 900, "training to finish",
                            poll_s=2.0, state_of=training_of)
            print(f"trained {ITERATIONS} iterations in {time.monotonic() - started:.0f} s; the joiner took stage "
                  f"{joiner.stage} from iteration {done[j].get('start_iteration')}")
            schedule = rpc_in_namespace(swarm, "schedule")(swarm.nodes[0])
            view = rpc_in_namespace(swarm, "swarm")(swarm.nodes[0])
            logs = {i: swarm.nodes[i].log_path.read_text(errors="replace") for i in (*NATTED, j)}
        finally:
            swarm.stop()
    assert lab_leftovers(LAB) == []

    for i in (*NATTED, j):  # learned, not guessed: the public node saw the router's address and could not connect back
        r = reach[i]
        assert r.get("reachability") == "outbound_only", (i, r)
        assert r.get("observed_ip") == lab.router_address(lab.home_of(i)[0]), (i, r)
        assert "reachability: not reachable" in logs[i] and "forward TCP port" in logs[i], logs[i][-2000:]
    for i in range(4):
        assert reach[i].get("reachability") in ("direct", "unknown"), (i, reach[i])
    advertised = {p["peer_id"]: p.get("reachability") for p in before["peers"]}
    assert [advertised.get(swarm.nodes[i].peer_id) for i in NATTED] == ["outbound_only"] * 2, advertised
    advertised = {p["peer_id"]: p.get("reachability") for p in view["peers"]}
    assert [advertised.get(swarm.nodes[i].peer_id) for i in (NATTED[1], j)] == ["outbound_only"] * 2, advertised

    assert schedule.get("schedule"), schedule
    sched = Schedule.from_json(schedule["schedule"])
    members = schedule["members"]
    assert joiner.peer_id in members and swarm.nodes[VICTIM].peer_id not in members, members
    member_reach = [advertised.get(m, "unknown") for m in members]
    assert impossible_hops(sched, member_reach) == [], sched.paths

    assert_each_step_committed_once(done, (0, 1), survivors, ITERATIONS, f"joiner {j} at stage {joiner.stage}")
    assert done[j]["history"] and 0 < done[j]["start_iteration"] <= done[j]["history"][0]["iteration"], done[j]
    assert f"joined stage {joiner.stage} with the state of iteration" in logs[j], logs[j][-3000:]  # downloaded
    assert "Traceback" not in logs[j], logs[j][-3000:]
    losses = [h["loss"] for h in done[0]["history"]]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, f"loss did not fall: {losses}"
