"""A replica frozen for a while, then continued, catches up before it counts as a member again.

Real ``skippipe node run --train`` daemons on 127.0.0.1 (tiny model, one torch thread): a data node and two
stage-1 replicas. One replica's whole process group (daemon, p2pd, DHT child) is stopped with SIGSTOP, as a
machine that froze: the others find it silent, issue an epoch without it and train on. After SIGCONT it wakes
up in an iteration the swarm finished long ago; it must leave that old iteration, be admitted again only as a
joiner (never as a member still at its old iteration), take the stage's state of the current iteration from the
other replica, and train on with the swarm.

No timing assertion: each step waits (bounded) for progress, and a hang fails through the timeout.
"""

import os
import signal

import pytest

from node.launch.process_swarm import ProcessSwarm
from tests.faults.daemon_helpers import train_args, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

#: Iterations the swarm must train while the replica is frozen (it is then far behind, not one iteration).
AHEAD = 20
#: Iterations every node must train after the frozen one re-joined.
AFTER = 10


def _signal_group(node, sig) -> None:
    os.killpg(node.proc.pid, sig)


def test_a_frozen_replica_catches_up_with_verified_state_and_training_goes_on(tmp_path):
    swarm = ProcessSwarm(3, [1, 2], base_dir=tmp_path / "swarm", run_id="frozen", heartbeat_s=1.0,
                         extra_args=lambda i: train_args(100000, 3, "--node-name", f"node{i}"))
    frozen = swarm.nodes[2]
    stopped = False
    try:
        swarm.start(timeout=300)
        wait_for(swarm, range(3), lambda s: s.get("state") == "training" and (s.get("committed_iteration") or -1) >= 2,
                 400, "training to start")
        _signal_group(frozen, signal.SIGSTOP)
        stopped = True
        at_stop = wait_for(swarm, [0, 1], lambda s: True, 60, "the progress at the freeze")[0]["committed_iteration"]
        wait_for(swarm, [0, 1], lambda s: (s.get("committed_iteration") or -1) >= at_stop + AHEAD, 400,
                 "training to go on without the frozen replica")
        _signal_group(frozen, signal.SIGCONT)
        stopped = False
        at_cont = wait_for(swarm, [0], lambda s: True, 60, "the progress at the continue")[0]["committed_iteration"]
        joined = wait_for(swarm, [2], lambda s: s.get("state") == "training"
                          and (s.get("committed_iteration") or -1) >= at_cont, 400,
                          "the frozen replica to re-join at the current iteration")[2]
        start = joined["committed_iteration"]
        wait_for(swarm, range(3), lambda s: (s.get("committed_iteration") or -1) >= start + AFTER, 400,
                 "all three to train on together")
    finally:
        if stopped:
            _signal_group(frozen, signal.SIGCONT)
        swarm.stop()
    log = frozen.log_path.read_text(errors="replace")
    rejoined = [line for line in log.splitlines() if "joined stage 1 with the state of iteration" in line]
    assert rejoined and int(rejoined[-1].split("iteration ")[1].split()[0]) >= at_cont - 1, log[-4000:]
    source = joined["state_source"]
    assert source is not None and source["source"] == swarm.nodes[1].peer_id, source
