"""A replica whose checkpoint disk fills leaves with one line; the others train on, on observed deadlines.

Three ``skippipe node run --train`` daemons: a data node and two replicas of stage 1. The second replica
checkpoints every iteration, and its disk fills at the checkpoint of iteration ``FULL_AT``
(``--inject diskfull@...``: the write fails half-way with ENOSPC). It must say "disk full" in one line (no
traceback), keep its checkpoint of the iteration before, advertise OFFLINE, and the other two must go on
committing every iteration to the end. The same swarm checks the data node's deadlines: after a few
iterations its microbatch budgets come from the round trips it measured (median + k x MAD of what its
training RPC reports), not from the cost model. And its hedges: the first attempt of microbatch ``SLOW_MB``
of iteration ``SLOW_AT`` straggles at whichever replica the schedule sends it to (the same ``--inject
delay@...,attempt=0`` rule on both: a schedule planned from start-up benchmarks taken under load may give
one replica every microbatch), past the hedge time of half the ~10 s budget; the data node sends it to the
other replica too, the first attempt back wins, the other is discarded, and every microbatch counts once
(losses plus drops are the schedule's, and the two replicas together ran each counted microbatch's
backward once).
"""

import pytest

from node.launch.process_swarm import ProcessSwarm
from node.net.rpc import call_http
from node.train.checkpoint import CheckpointStore
from node.train.deadlines import ObservedDeadlineConfig
from tests.faults.daemon_helpers import assert_each_step_committed_once, train_args, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ITERATIONS = 8
FULL_AT = 2  # the checkpoint of this iteration finds the disk full
FULL = 2  # the second replica of stage 1
SLOW_AT, SLOW_MB, SLOW_S = 1, 1, 8  # the first attempt of this microbatch of this iteration stalls this long
MICROBATCHES = 4


def test_a_full_checkpoint_disk_leaves_cleanly_and_deadlines_follow_observation(tmp_path):
    ckpt = tmp_path / "ckpt"

    def args(i):
        extra = ["--node-name", f"node{i}"]
        if i == FULL:
            extra += ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "1",
                      "--inject", f"diskfull@iteration={FULL_AT}"]
        if i != 0:
            extra += ["--inject", f"delay@iteration={SLOW_AT},hop=1,direction=forward,microbatch={SLOW_MB},attempt=0,"
                                  f"delay={SLOW_S}"]
        # four microbatches an iteration: the data node's route has enough round trips for its own budget soon
        return train_args(ITERATIONS, 3, *extra) + ["--microbatches", str(MICROBATCHES)]

    swarm = ProcessSwarm(3, [1, 2], base_dir=tmp_path / "swarm", run_id="diskfull", heartbeat_s=1.0, extra_args=args)
    try:
        swarm.start(timeout=240)
        failed = wait_for(swarm, [FULL], lambda s: s.get("state") == "error", 300, "the full disk to be noticed",
                          fail_on_error=False)
        status = call_http(swarm.nodes[FULL].rpc_url, "status", {}, timeout=10)
        done = wait_for(swarm, [0, 1], lambda s: s.get("state") == "done", 400, "the others to finish")
    finally:
        swarm.stop()

    error = failed[FULL]["error"]
    assert error.startswith("disk full: ") and "\n" not in error, error
    assert status["state"] == "OFFLINE" and status["failure"].startswith("disk full"), status
    log = swarm.nodes[FULL].log_path.read_text(errors="replace")
    assert "Traceback" not in log and "disk full" in log, log[-3000:]
    store = CheckpointStore(ckpt, "diskfull", 1, f"node{FULL}")
    assert store.load().iteration == FULL_AT - 1  # the last good checkpoint, intact and loadable
    assert [p.name for p in store.path.parent.iterdir()] == [store.path.name]  # no temp file left

    # the others went on after it left, every step committed once
    assert_each_step_committed_once(done, [0], [0, 1], ITERATIONS, "after the disk-full replica left")

    # the straggler's microbatches were hedged to the other replica, and each counted once
    stalls = [swarm.nodes[i].log_path.read_text(errors="replace").count("fault injection: delay") for i in (1, FULL)]
    assert sorted(stalls) == [0, 1], stalls  # the rule's first attempt ran at one replica, its hedge at the other
    hedges = done[0]["recovery"]["hedges"]
    assert hedges["sent"] >= 1 and hedges["discarded"] >= 1, hedges
    history = {h["iteration"]: h for h in done[0]["history"]}
    assert all(h["microbatches"] + h["dropped"] == MICROBATCHES for h in history.values()), history
    slow = history[SLOW_AT]
    replicas = [{h["iteration"]: h for h in s["history"]}[SLOW_AT]["local_visits"] for s in (done[1], failed[FULL])]
    assert slow["local_visits"] == sum(replicas) == slow["microbatches"], (slow, replicas)

    deadlines = done[0]["recovery"]["deadlines"]
    assert deadlines["last_basis"] == "observed", deadlines
    cfg = ObservedDeadlineConfig()
    observed = [r for r in deadlines["routes"] if r["budget_s"] is not None]
    assert observed, deadlines
    for r in observed:  # the budget is what the measured round trips give, recomputed from their median and MAD
        want = min(cfg.cap_s, max(cfg.floor_s, r["floor_s"], r["median_s"] + cfg.k * r["mad_s"],
                                  r["median_s"] * cfg.min_ratio))
        assert r["samples"] >= cfg.min_samples and r["budget_s"] == pytest.approx(want), r
    assert deadlines["last_budget_s"] in [r["budget_s"] for r in observed], deadlines
