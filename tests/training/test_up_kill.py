"""``skippipe up`` on daemons survives a SIGKILLed replica, and ``--resume`` works after it.

Four daemons (data node, two replicas of stage 1, stage 2). Once the run has committed a couple
of iterations, one stage-1 replica is SIGKILLed (its whole process group: daemon, p2pd, DHT). The
run must still finish every iteration on the survivors, reporting the death instead of tearing
the swarm down; then ``--resume`` with more iterations must start, although the killed replica's
checkpoint is older than the others' (it catches up from its stage's other replica).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import replace

import pytest

from node.cli.up_runners import UP_SPEC, UpOptions, align_checkpoints, run_up_swarm
from node.errors import UserError
from node.net.rpc import call_http

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

FIRST = 8
MORE = 11
VICTIM = 2  # node2: the second replica of stage 1


def _opts(out, iterations, resume=False):
    spec = replace(UP_SPEC, iterations=iterations, num_stages=3, path_length=3, microbatches=2, checkpoint_every=2,
                   heartbeat=1.0, resume=resume)
    return UpOptions(spec, out=str(out), replicas="2,1", data_nodes=1, quiet=True, start_timeout_s=400.0,
                     stall_timeout_s=400.0)


def _committed(ready) -> int:
    try:
        info = json.loads(ready.read_text())
        st = call_http(f"http://127.0.0.1:{info['rpc_port']}", "training", {"limit": 1}, timeout=5)
        return int(st.get("committed_iteration") if st.get("committed_iteration") is not None else -1)
    except Exception:  # noqa: BLE001 - not up yet
        return -1


def test_a_killed_replica_does_not_end_the_run_and_resume_works(tmp_path):
    out = tmp_path / "up"
    lead_ready, victim_ready = out / "nodes" / "node0" / "ready.json", out / "nodes" / f"node{VICTIM}" / "ready.json"
    done = threading.Event()
    state = {"killed": False}

    def killer():  # run_up_swarm installs signal handlers: it runs on the main thread
        while not done.is_set():
            if victim_ready.exists() and _committed(lead_ready) >= 2:
                os.killpg(json.loads(victim_ready.read_text())["pid"], signal.SIGKILL)
                state["killed"] = True
                return
            time.sleep(0.5)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    try:
        summary = run_up_swarm(_opts(out, FIRST))
    finally:
        done.set()
        t.join(timeout=30)
    killed = state["killed"]
    assert killed, "the run ended before the kill"
    assert summary["dead_nodes"] == [VICTIM]
    history = json.loads((out / "history.json").read_text())
    assert [h["iteration"] for h in history] == list(range(FIRST))
    assert summary["leftover_processes"] == 0

    again = run_up_swarm(_opts(out, MORE, resume=True))
    assert again["resumed_from"] == FIRST and again["dead_nodes"] == []
    history = json.loads((out / "history.json").read_text())
    assert [h["iteration"] for h in history] == list(range(MORE))


def test_align_checkpoints_catches_up_or_says_why(tmp_path):
    import torch

    from node.train.checkpoint import CheckpointStore

    def save(stage, name, it):
        CheckpointStore(tmp_path, "up", stage, name).save(it, {"w": torch.full((2,), float(it))})

    save(0, "node0", 13)
    save(1, "node1", 13)
    save(1, "node2", 9)  # killed mid-run
    names = {0: ["node0"], 1: ["node1", "node2"], 2: ["node3"]}
    save(2, "node3", 13)
    assert align_checkpoints(tmp_path, names) == 13
    caught_up = CheckpointStore(tmp_path, "up", 1, "node2").load()
    assert caught_up.iteration == 13 and float(caught_up.state["w"][0]) == 13.0
    save(2, "node3", 9)  # the only replica of stage 2 stopped early
    with pytest.raises(UserError, match="stage 2: 9"):
        align_checkpoints(tmp_path, names)
    assert align_checkpoints(tmp_path / "none", names) is None
