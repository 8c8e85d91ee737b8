"""A stage held only by replicas behind NAT averages through a reducer: a public node of another stage.

Four daemons in the NAT lab: two public data nodes (stage 0), and stage 1 held only by nodes 2 and 3, each
behind its own router (one strict). Nodes 2 and 3 can never be connected to each other and neither can be
dialled, so hivemind's all-reduce has no peer to reduce their parts: before reducers they never averaged
(each replica's averager had nobody to meet) and their weights drifted apart. Now one data node reduces
stage 1's all-reduce as an auxiliary peer (:mod:`node.train.reducer`) and both replicas average every round.
"""

import time

import pytest

from node.testing.nat import Home, NatKind, NatLab, nat_unavailable
from node.testing.nat_swarm import HEARTBEAT_S, RATE_MBIT, rpc_in_namespace
from node.testing.netns import NamespaceSwarm, lab_leftovers
from tests.faults.daemon_helpers import train_args, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WHY_NOT = nat_unavailable()
LAB = "spnx"
#: Two public data nodes, then stage 1 held by NATed nodes 2 and 3 only (one router each).
SIZES = (2, 2)
NATTED = (2, 3)
ITERATIONS = 4
#: Rounds a NATed replica may miss on a loaded box (a late groupmate); without a reducer it misses all.
MAX_MISSED_ROUNDS = 1


@pytest.mark.skipif(WHY_NOT is not None, reason=f"NAT lab unavailable: {WHY_NOT}")
def test_a_stage_held_only_behind_nat_averages_through_a_public_reducer(tmp_path):
    lab = NatLab(LAB, public=2, homes=(Home(1, NatKind.PLAIN), Home(1, NatKind.STRICT)), subnet=105,
                 rate_mbit=RATE_MBIT)
    n = sum(SIZES)
    with lab:
        swarm = NamespaceSwarm(lab, n, list(SIZES), base_dir=tmp_path / "swarm", run_id="natred", heartbeat_s=HEARTBEAT_S,
                               path_length=len(SIZES), extra_args=lambda i: train_args(ITERATIONS, n))
        try:
            started = time.monotonic()
            swarm.start(timeout=300)
            status_of = rpc_in_namespace(swarm, "status")
            reach = {node.index: (status_of(node) or {}).get("reachability", {}).get("reachability")
                     for node in swarm.nodes}
            done = wait_for(swarm, range(n), lambda s: s.get("state") == "done", 600, "training to finish",
                            poll_s=2.0, state_of=rpc_in_namespace(swarm, "training", {"limit": 1000}))
            print(f"trained {ITERATIONS} iterations in {time.monotonic() - started:.0f} s from start")
            logs = {i: swarm.nodes[i].log_path.read_text(errors="replace") for i in range(n)}
        finally:
            swarm.stop()
    assert lab_leftovers(LAB) == []

    assert [reach[i] for i in NATTED] == ["outbound_only"] * 2, reach
    for i in NATTED:
        history = done[i]["history"]
        assert [h["iteration"] for h in history] == list(range(ITERATIONS)), (i, history)
        missed = [h["iteration"] for h in history if h["averaged"] is not True]
        assert len(missed) <= MAX_MISSED_ROUNDS, f"node {i} did not average in iterations {missed}: {logs[i][-3000:]}"
        assert not any(h["resynced"] for h in history), (i, history)
        assert "replicas disagree" not in logs[i], logs[i][-3000:]
    reducers = [i for i in range(n) if "reducing stage 1's averaging" in logs[i]]
    assert len(reducers) == 1 and reducers[0] not in NATTED, {i: logs[i][-2000:] for i in range(n)}
