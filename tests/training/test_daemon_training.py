"""Training inside real daemons: ``skippipe node run --train`` processes and ``skippipe up`` on them.

Each daemon is a separate ``python -m node node run`` process (``node.launch.process_swarm``); these tests
check numbers (parameters equal to the single-process reference, loss falls) and that no process
of the swarm (daemon, p2pd, DHT, averager) outlives it.
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from node.train.checkpoint import CheckpointStore
from node.cli.swarm_cmd import fetch_status, format_status
from node.train.data import DataConfig
from node.launch.process_swarm import ProcessSwarm, training_state
from node.launch.procs import processes_mentioning
from node.train.model import model_config
from node.train.reference import ReferenceTrainer
from node.net.rpc import call_http
from node.train.runtime import OptimConfig, StageRuntime
from node.train.model import build_stage
from node.train.trainer import summary_differences, training_summary, TrainerConfig

pytestmark = pytest.mark.timeout(420)

ITERATIONS = 3


def _wait_all(swarm, predicate, timeout):
    deadline = time.monotonic() + timeout
    states = {}
    while time.monotonic() < deadline:
        for n in swarm.nodes:
            assert n.alive, f"node {n.index} exited: {swarm.last_error(n)}"
            st = training_state(n, limit=1)
            if st is not None:
                states[n.index] = st
        errors = {i: s["error"] for i, s in states.items() if s.get("state") == "error"}
        assert not errors, errors
        if len(states) == len(swarm.nodes) and all(predicate(s) for s in states.values()):
            return states
        time.sleep(1.0)
    raise AssertionError(f"timed out; states: {[(i, s.get('state'), s.get('committed_iteration')) for i, s in states.items()]}")


def test_node_run_train_full_path_matches_reference(tmp_path, splits):
    """5 daemons (2 data nodes + stages 1..3, one replica each), full path, 3 iterations:
    every node's parameters equal the single-process reference trained on the same schedule."""
    ckpt = tmp_path / "ckpt"
    sizes = [2, 1, 1, 1]
    swarm = ProcessSwarm(
        5, sizes, base_dir=tmp_path / "swarm", run_id="refcheck", heartbeat_s=1.0,
        extra_args=lambda i: ["--train", "--iterations", str(ITERATIONS), "--min-members", "5", "--threads", "1",
                              "--checkpoint-dir", str(ckpt), "--node-name", f"node{i}", "--microbatches", "2",
                              "--iteration-timeout", "120", "--agreement-timeout", "240"])
    try:
        swarm.start(timeout=240)
        states = _wait_all(swarm, lambda s: s.get("state") == "done", 300)
        epochs = {s["epoch"] for s in states.values()}
        assert len(epochs) == 1, f"members pinned different epochs: {epochs}"
        assert {s["members"] for s in states.values()} == {5}
        sched = call_http(swarm.nodes[0].rpc_url, "schedule", {})
        assert sched["epoch"] in epochs, "the swarm moved on to another epoch; the test cannot know the schedule"
        stages_of = {s["peer_id"]: s["stage"] for s in states.values()}
        assert sorted(stages_of.values()) == [0, 0, 1, 2, 3]
        hist = call_http(swarm.nodes[0].rpc_url, "training", {})["history"]
        assert [h["iteration"] for h in hist] == list(range(ITERATIONS))
        # a failed hivemind round ("could not find a group": 1 of 3 CI runs on 2026-12-03) makes the
        # replicas step on their local mean gradient, the documented degraded mode: then no
        # reference can match, and the run is reported as an expected failure instead
        failed_rounds = [(n.index, h["iteration"]) for n in swarm.nodes
                         for h in call_http(n.rpc_url, "training", {})["history"] if h.get("averaged") is False]
        shown = format_status(fetch_status(swarm.nodes[0].rpc_url, None, 10))
        assert f"training: done on epoch {sched['epoch']}, stage 0, iteration {ITERATIONS}/{ITERATIONS}" in shown
    finally:
        swarm.stop()
    assert not processes_mentioning(str(tmp_path)), "processes of the swarm outlived it"
    if failed_rounds:
        pytest.xfail(f"averaging round(s) failed (node, iteration): {failed_rounds}; replicas stepped on local "
                     "gradients, so the reference cannot match")

    mcfg = model_config("tiny", n_stages=len(sizes))
    ref = ReferenceTrainer(mcfg, OptimConfig(), DataConfig(), splits, sched["schedule"], seed=0)
    ref_losses = [ref.train_iteration() for _ in range(ITERATIONS)]
    ref_modules = ref.modules()
    worst = 0.0
    for node in swarm.nodes:
        store = CheckpointStore(ckpt, "refcheck", node.stage, f"node{node.index}")
        c = store.load()
        assert c is not None and c.iteration == ITERATIONS - 1
        rt = StageRuntime(build_stage(mcfg, node.stage, 0), OptimConfig())
        rt.load_state_dict(c.state)
        for (name, p), (_, q) in zip(rt.module.named_parameters(), ref_modules[node.stage].named_parameters()):
            worst = max(worst, float((p.detach() - q.detach()).abs().max()))
    assert worst <= 1e-5, f"max abs parameter difference {worst:.3g}"
    assert abs(hist[-1]["loss"] - ref_losses[-1]) < 1e-4


def test_up_on_daemons_end_to_end(tmp_path):
    """``skippipe up`` (no mode flag): 9 daemons, a few iterations; loss falls, outputs written,
    every process of the swarm is gone afterwards."""
    out = tmp_path / "up"
    proc = subprocess.run([sys.executable, "-m", "node", "up", "--iterations", "4", "--out", str(out)],
                          capture_output=True, text=True, timeout=400, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 4 iterations on 9 nodes" in proc.stdout
    assert "iter 4/4" in proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "daemons" and summary["leftover_processes"] == 0
    assert summary["final_loss"] < summary["first_loss"]
    assert summary["val_loss_after"] < summary["val_loss_before"]
    history = json.loads((out / "history.json").read_text())
    assert [h["iteration"] for h in history] == [0, 1, 2, 3]
    assert all(h["active_nodes"] == 9 for h in history)
    assert (out / "loss.png").stat().st_size > 0
    assert not processes_mentioning(str(tmp_path)), "processes of the swarm outlived skippipe up"


def test_training_summaries_name_what_differs():
    a = training_summary(TrainerConfig(), 10)
    b = training_summary(TrainerConfig(optim=OptimConfig(lr=0.5)), 12)
    diff = summary_differences(a, b)
    assert any(d.startswith("optim.lr:") for d in diff) and any(d.startswith("iterations:") for d in diff)
    assert summary_differences(a, json.loads(json.dumps(a))) == []
