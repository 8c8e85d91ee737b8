"""Deterministic fault injection into a training swarm (in-process harness, real libp2p and DHT).

Each case installs one rule (node.train.faults) on one node: drop / delay / kill at iteration i, hop j,
forward or backward. For every case the run must complete: every surviving node commits exactly
the requested iterations in order, the loss at the end is finite and lower than at the start, and
the recovery path the case is about really ran (the rule fired; a retry, drop, re-route or skip
was counted). A hang fails the test through its timeout.

Swarm: 4 stages (tiny model), 2 data nodes, 2 replicas of every other stage, full-length paths
(d -> s1 -> s2 -> s3 -> d), so hop 1 / 2 / 3 is processed by a stage-1 / 2 / 3 node and hop 4 is
the loss at the data node; ``max_extra_skips=1`` lets recovery drop one stage from a path.
"""

import dataclasses
import math

import pytest

from node.launch.inproc_swarm import InProcessSwarm
from node.launch.schedules import build_schedule
from node.train.data import DataConfig
from node.train.faults import FaultInjector, parse_fault
from node.train.hedging import HedgeConfig
from node.train.model import model_config
from node.train.runtime import OptimConfig
from node.train.trainer import TrainerConfig

pytestmark = pytest.mark.timeout(420)

ITERATIONS = 6
#: node indices: 0,1 data nodes; 2,3 stage 1; 4,5 stage 2; 6,7 stage 3
SCHEDULE = build_schedule(4, data_nodes=2, replicas=[2, 2, 2], path_length=4, microbatches=3, memory=2)

CASES = {
    # a lost activation: only the data node's deadline can notice (hedging off here: a hedge would rescue it
    # sooner, as in delay-forward); the microbatch is recomputed
    "drop-forward": (2, "drop@iteration=1,hop=1,direction=forward,times=2"),
    # a lost gradient: the loss is already computed, so the microbatch is dropped and the step re-weighted
    "drop-backward": (4, "drop@iteration=1,hop=2,direction=backward"),
    # a straggler: a hop late past its hedge time (half its ~13 s budget) but not its deadline is hedged to
    # the other replica; the first attempt back wins and the other is discarded (counted once either way)
    "delay-forward": (6, "delay@iteration=2,hop=3,direction=forward,delay=10"),
    # a stage node dies mid-forward: in-flight activations re-route to the other replica
    "kill-forward": (3, "kill@iteration=2,hop=1,direction=forward"),
    # a stage node dies mid-backward: the microbatches it held are dropped
    "kill-backward": (5, "kill@iteration=2,hop=2,direction=backward"),
    # a data node dies starting an iteration: the others finish it without its microbatches
    "kill-data-node": (1, "kill@iteration=3,hop=0,direction=forward"),
}


#: cases that run with hedging off, so that the recovery path they are about is the one that runs
NO_HEDGING = {"drop-forward"}


def _config(run_id, hedging: bool = True):
    return TrainerConfig(run_id=run_id, model=model_config("tiny", n_stages=4), optim=OptimConfig(lr=3e-3),
                         hedging=HedgeConfig(enabled=hedging),
                         data=DataConfig(microbatch_size=4), max_extra_skips=1)


@pytest.mark.parametrize("case", sorted(CASES))
async def test_training_survives_injected_fault(case, splits):
    victim, spec = CASES[case]
    injectors = {victim: FaultInjector([parse_fault(spec)])}
    rule = injectors[victim].rules[0]
    async with InProcessSwarm(SCHEDULE, _config(f"fault-{case}", case not in NO_HEDGING), splits,
                          faults_for=lambda i: injectors.get(i)) as swarm:
        await swarm.train(ITERATIONS)
        nodes = swarm.nodes
        survivors = [n for n in nodes if not n.killed]
        histories = {n.node_name: [s.iteration for s in n.history] for n in survivors}
        data_stats = [s for n in survivors if n.is_data_node for s in n.history]
        recovery = {
            "retried": sum(s.retried for s in data_stats),
            "dropped": sum(s.dropped for s in data_stats),
            "reroutes": sum(n.reroutes for n in survivors),
            "skips": sum(n.skips for n in survivors),
        }
        killed = [n.node_name for n in nodes if n.killed]
        losses = [s.loss for s in survivors[0].history]
        hedges = [n.recovery.hedges for n in survivors if n.is_data_node]
        # per iteration: the microbatches whose backward ran at each stage's replicas together
        visits = [{s: sum(n.history[i].local_visits for n in survivors if n.stage == s) for s in range(4)}
                  for i in range(ITERATIONS)]
        counted = [(s.microbatches, s.dropped) for s in survivors[0].history]
    assert injectors[victim].fired, f"rule {spec} never fired"
    assert all(h == list(range(ITERATIONS)) for h in histories.values()), histories
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    if rule.action == "kill":
        assert killed == [f"node{victim}"]
        assert len(survivors) == len(nodes) - 1
    else:
        assert not killed
    if case == "drop-forward":
        assert recovery["retried"] >= 1, recovery
    if case == "drop-backward":
        assert recovery["dropped"] >= 1, recovery
    if case == "kill-forward":
        assert recovery["reroutes"] + recovery["retried"] >= 1, recovery
    if case == "delay-forward":
        # each microbatch counted exactly once: losses plus drops are the schedule's microbatches, and every
        # stage ran the backward of each counted microbatch once (no stage is skipped by a delay)
        assert all(n + d == 6 for n, d in counted), counted
        assert all(set(v.values()) == {n} for v, (n, _) in zip(visits, counted)), (visits, counted)
        assert sum(h.sent for h in hedges) >= 1 and sum(h.won for h in hedges) >= 1, hedges
        assert sum(h.discarded for h in hedges) >= 1, hedges
    if case == "kill-backward":
        assert recovery["dropped"] + recovery["retried"] >= 1, recovery


async def test_a_stage_with_no_live_replica_is_skipped_then_training_pauses(splits):
    """Both replicas of stage 3 die: in-flight microbatches skip it (within the skip budget), the
    iteration commits, and then training pauses with the missing stage named instead of
    training a model without it."""
    injectors = {6: FaultInjector([parse_fault("kill@iteration=1,hop=3,direction=forward")]),
                 7: FaultInjector([parse_fault("kill@iteration=1,hop=3,direction=forward")])}
    import asyncio

    async with InProcessSwarm(SCHEDULE, _config("fault-pause"), splits, faults_for=lambda i: injectors.get(i)) as swarm:
        task = asyncio.create_task(swarm.train(ITERATIONS))
        for _ in range(600):
            if all(n.paused_reason for n in swarm.nodes if not n.killed):
                break
            await asyncio.sleep(0.2)
        paused = {n.node_name: n.paused_reason for n in swarm.nodes if not n.killed}
        committed = {n.committed_iteration for n in swarm.nodes if not n.killed}
        skips = sum(n.skips for n in swarm.nodes)
        for n in swarm.nodes:
            n.request_stop()
        await asyncio.wait_for(task, 60)
    assert all(r and "[3]" in r for r in paused.values()), paused
    assert committed == {1}  # iteration 1 finished by skipping stage 3, nothing after it
    assert skips >= 1
