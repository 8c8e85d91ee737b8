"""A replica whose checkpoint fails verification leaves the swarm instead of spreading its state.

Three ``skippipe node run --train`` daemons (a data node, two replicas of stage 1) train a few iterations with a
checkpoint every iteration and stop. 4 KiB in the middle of one replica's checkpoint are flipped. Restarted
with ``--resume``, that replica refuses the file with one line naming it, advertises OFFLINE (so the swarm
leaves it out and never re-syncs from it) and keeps the reason visible over RPC; the others resume from
their own checkpoints and train on to the end.
"""

import pytest

from node.net.rpc import call_http
from node.launch.process_swarm import ProcessSwarm
from tests.faults.daemon_helpers import train_args, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FIRST, SECOND = 4, 10  # iterations of the first session, then of the whole run
BAD = 2  # the second replica of stage 1


def _flip_middle(path, nbytes=4096):
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, min(len(data), mid + nbytes)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupt_checkpoint_is_refused_and_its_node_leaves(tmp_path):
    ckpt = tmp_path / "ckpt"

    def args(iterations, members, resume):
        def of(i):
            extra = ["--checkpoint-dir", str(ckpt), "--node-name", f"node{i}", "--checkpoint-every", "1"]
            return train_args(iterations, members, *extra) + (["--resume"] if resume else [])
        return of

    first = ProcessSwarm(3, [1, 2], base_dir=tmp_path / "swarm", run_id="corrupt", heartbeat_s=2.0,
                         extra_args=args(FIRST, 3, False))
    try:
        first.start(timeout=240)
        wait_for(first, range(3), lambda s: s.get("state") == "done", 600, "the first session to finish")
    finally:
        first.stop()

    bad_file = ckpt / "corrupt" / "stage1" / f"node{BAD}.pt"
    assert bad_file.is_file(), sorted(str(p) for p in ckpt.rglob("*"))
    _flip_middle(bad_file)

    second = ProcessSwarm(3, [1, 2], base_dir=tmp_path / "swarm", run_id="corrupt", heartbeat_s=2.0,
                          extra_args=args(SECOND, 2, True))
    try:
        second.start(timeout=240)
        failed = wait_for(second, [BAD], lambda s: s.get("state") == "error", 400, "the bad replica to refuse",
                          fail_on_error=False)
        status = call_http(second.nodes[BAD].rpc_url, "status", {}, timeout=10)
        done = wait_for(second, [0, 1], lambda s: s.get("state") == "done", 600, "the others to finish")
        seen_by_data_node = call_http(second.nodes[0].rpc_url, "swarm", {}, timeout=10)
    finally:
        second.stop()

    error = failed[BAD]["error"]
    assert str(bad_file) in error and "\n" not in error, error
    assert status["state"] == "OFFLINE" and status["failure"], status
    its = [h["iteration"] for h in done[0]["history"]]
    assert its and its[0] == FIRST and its[-1] == SECOND - 1, its
    peers = {p["peer_id"]: p for p in seen_by_data_node.get("peers", [])}
    entry = peers.get(second.nodes[BAD].peer_id)
    assert entry is None or entry.get("state") == "OFFLINE", entry
