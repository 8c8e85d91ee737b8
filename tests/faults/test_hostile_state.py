"""A hostile replica serving stage state to joiners, on real daemons: no code of its runs, its weights
are refused, and the joiners take the honest replicas' state.

``skippipe node run --train`` daemons: a data node (stage 0) and three stage-1 replicas (two honest ones
outvote the liar: with one honest replica against one hostile one, neither can re-sync the other nor back a
joiner's download, docs/operations.md), the first of which (the lowest peer id, so joiners ask it first)
is turned hostile by ``tests/faults/evil_state`` (a
``sitecustomize`` on the daemons' ``PYTHONPATH`` that acts only in the daemon started with its identity).
Joiner A arrives while it serves a pickle whose ``__reduce__`` creates a marker file; joiner B while it
serves all-zero weights (and vouches for them), and then ``skippipe export --peer`` pulls the stages.
Both joiners must join from an honest replica and the export must hold no all-zero tensor; the marker
must never appear; training goes on.
"""

import os
import pathlib
import shutil

import pytest

from node.cli.export_pull import pull_stages
from node.eval.export import check_weights
from node.net.identity import load_or_create_identity
from node.launch.process_swarm import ProcessSwarm
from tests.faults.daemon_helpers import train_args, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

HOOKS = pathlib.Path(__file__).resolve().parent / "evil_state"
ITERATIONS = 100000  # the swarm is stopped by the test, not by the end of the run


def _joined_line(log: str) -> str:
    lines = [line for line in log.splitlines() if "joined stage 1 with the state of iteration" in line]
    assert lines, log[-4000:]
    return lines[-1]


def test_a_hostile_replica_cannot_run_code_in_or_hand_wrong_weights_to_joiners(tmp_path):
    base = tmp_path / "swarm"
    # stage-1 identities made up front: the hostile node 1 gets the lowest peer id of all five (the three
    # first replicas and joiners A = node 4 and B = node 5), so that each joiner asks it first
    ids = [(load_or_create_identity(tmp_path / f"id{i}.key"), tmp_path / f"id{i}.key") for i in range(5)]
    ids = sorted(ids, key=lambda pair: pair[0].peer_id.to_base58())
    for node_index, (_, path) in zip((1, 2, 3, 4, 5), ids):
        (base / f"node{node_index}").mkdir(parents=True)
        shutil.copy(path, base / f"node{node_index}" / "identity.key")
    evil, honest = (ident.peer_id.to_base58() for ident, _ in ids[:2])
    mode, marker = tmp_path / "mode", tmp_path / "pwned"
    mode.write_text("pickle")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HOOKS), os.environ.get("PYTHONPATH", "")]),
               SKIPPIPE_TEST_EVIL_IDENTITY=str(base / "node1" / "identity.key"),
               SKIPPIPE_TEST_EVIL_MODE=str(mode), SKIPPIPE_TEST_EVIL_MARKER=str(marker))
    swarm = ProcessSwarm(4, [1, 3], base_dir=base, run_id="hostile", heartbeat_s=2.0, env=env,
                         extra_args=lambda i: train_args(ITERATIONS, 4, "--node-name", f"node{i}"))
    try:
        swarm.start(timeout=300)
        wait_for(swarm, range(4), lambda s: (s.get("committed_iteration") or -1) >= 2, 600, "training to start")
        a = swarm.add_node(stage=1, timeout=300)
        # B starts as soon as A holds its state (A's proof and join downloads met the pickle), while A's epoch
        # is still ahead: the two joins overlap instead of taking turns
        source_a = wait_for(swarm, [a.index], lambda s: s.get("state_source") is not None, 600,
                            "joiner A's state")[a.index]["state_source"]
        mode.write_text("zeros")
        b = swarm.add_node(stage=1, timeout=300)
        trains = lambda s: s.get("state") == "training" and (s.get("committed_iteration") or -1) >= (
            s.get("start_iteration") or 0)  # noqa: E731
        wait_for(swarm, [a.index, b.index], trains, 600, "joiners A and B to train")
        log_a, log_b = (n.log_path.read_text(errors="replace") for n in (a, b))
        # skippipe export --peer, still with the zeros on offer: it must pull the honest weights
        loaded = pull_stages([swarm.nodes[0].maddr])
        after = wait_for(swarm, [0], lambda s: s.get("state") == "training", 60, "the data node")[0]
    finally:
        swarm.stop()
    assert not marker.exists(), "the hostile replica's pickle ran code in a joiner"
    # A: the pickle was refused as state (it never decoded), the honest replica's state taken
    assert f"state from {evil[-8:]} refused" in log_a, log_a[-4000:]
    assert f"from {honest[-8:]}" in _joined_line(log_a), _joined_line(log_a)
    assert source_a["source"] == honest and evil in source_a["backed_by"], source_a
    # B: the zeros were disputed by the other replicas and refused, the honest replica's state taken
    assert f"from {evil[-8:]} refused: 3 replica(s) hold other weights" in log_b, log_b[-4000:]
    joined_b = _joined_line(log_b)
    assert evil[-8:] not in joined_b and "other replica(s), disputed by 1" in joined_b, joined_b
    assert after["state"] == "training"
    assert check_weights(loaded) == [], "the export took a replica's all-zero weights"
