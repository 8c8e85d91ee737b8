"""A daemon whose run has ended either stays, idle, saying so, or (``--exit-when-done``) leaves and exits 0."""

import time

import pytest

from node.launch.process_swarm import ProcessSwarm
from tests.faults.daemon_helpers import train_args, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ITERATIONS = 3


def test_exit_when_done_leaves_and_the_default_stays_idle(tmp_path):
    def args(i):  # node 1 exits by itself; node 0 (the data node) stays, idle
        return train_args(ITERATIONS, 2) + (["--exit-when-done"] if i == 1 else [])

    swarm = ProcessSwarm(2, [1, 1], base_dir=tmp_path / "swarm", run_id="done", heartbeat_s=1.0, extra_args=args)
    try:
        swarm.start(timeout=240)
        wait_for(swarm, [0], lambda s: s.get("state") == "done", 400, "the data node to finish")
        deadline = time.monotonic() + 120
        while swarm.nodes[1].alive and time.monotonic() < deadline:
            time.sleep(0.5)
        exit_code = swarm.nodes[1].proc.poll()
        still_up = swarm.nodes[0].alive
    finally:
        swarm.stop()
    assert exit_code == 0, f"node 1 did not exit 0 by itself: {exit_code}; {swarm.last_error(swarm.nodes[1])}"
    assert still_up, "node 0 exited without --exit-when-done"
    assert "stays in the swarm, idle" in swarm.nodes[0].log_path.read_text(errors="replace")
