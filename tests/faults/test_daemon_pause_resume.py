"""A stage loses its only replica: training pauses with a clear status, then resumes from a checkpoint.

Five ``skippipe node run --train`` daemons (2 data nodes, stages 1-3 with one replica each) save
a checkpoint every iteration. Stage 2's only node is SIGKILLed. Training must pause at the next
iteration boundary instead of training a model without stage 2: the trainer state is ``paused``
with the stage named, and ``swarm status`` prints ``MISSING STAGES``. A fresh daemon then joins
with ``--auto`` (it takes stage 2, the stage with no replica) and ``--resume`` from the dead
node's checkpoint folder (no live replica can hand over the state). Training resumes and
finishes; the data nodes commit every iteration exactly once.
"""

import signal

import pytest

from node.cli.swarm_cmd import fetch_status, format_status
from node.launch.process_swarm import ProcessSwarm
from tests.faults.daemon_helpers import train_args, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ITERATIONS = 40
VICTIM = 3  # the only stage-2 node


def test_missing_stage_pauses_then_a_checkpoint_resumes_it(tmp_path):
    ckpt = tmp_path / "ckpt"

    def args(i):
        name = f"node{VICTIM}" if i == 5 else f"node{i}"  # the newcomer takes over the victim's checkpoint
        extra = ["--checkpoint-dir", str(ckpt), "--node-name", name, "--checkpoint-every", "1"]
        return train_args(ITERATIONS, 5, *extra) + (["--resume"] if i == 5 else [])

    swarm = ProcessSwarm(5, [2, 1, 1, 1], base_dir=tmp_path / "swarm", run_id="pause", heartbeat_s=2.0,
                       extra_args=args)
    try:
        swarm.start(timeout=240)
        wait_for(swarm, range(5), lambda s: s.get("state") == "training" and (s.get("committed_iteration") or -1) >= 2,
                 400, "training to start")
        swarm.kill(VICTIM, signal.SIGKILL)
        live = [0, 1, 2, 4]
        paused = wait_for(swarm, live, lambda s: s.get("state") == "paused", 300, "training to pause")
        assert all("[2]" in s["paused"] for s in paused.values()), paused
        at = paused[0]["committed_iteration"]
        shown = format_status(fetch_status(swarm.nodes[0].rpc_url, None, 10))
        assert "MISSING STAGES: [2]" in shown, shown
        assert "paused: stage(s) [2] have no live replica" in shown, shown

        newcomer = swarm.add_node(stage=None, timeout=240)
        assert newcomer.stage == 2, f"--auto picked stage {newcomer.stage}"
        done = wait_for(swarm, live + [newcomer.index], lambda s: s.get("state") == "done", 600, "training to finish")
        log = newcomer.log_path.read_text(errors="replace")
    finally:
        swarm.stop()

    assert "continuing from the checkpoint" in log, log[-3000:]
    for i in (0, 1):
        its = [h["iteration"] for h in done[i]["history"]]
        assert its == list(range(ITERATIONS)), (i, its)
    its = [h["iteration"] for h in done[newcomer.index]["history"]]
    assert its and its[0] > at and its[-1] == ITERATIONS - 1, (its, at)
    losses = [h["loss"] for h in done[0]["history"]]
    assert losses[-1] < losses[0], losses
