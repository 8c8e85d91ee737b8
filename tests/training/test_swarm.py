"""Swarm training on real hivemind P2P/DHT instances on 127.0.0.1 against the single-process reference.

Each test builds an in-process :class:`node.launch.inproc_swarm.InProcessSwarm` (one p2pd + DHT per node, a
bootstrap peer, real libp2p streams, real DecentralizedAverager) with a hand-built schedule.
"""

import dataclasses

import pytest
import torch

from node.launch.inproc_swarm import InProcessSwarm
from node.launch.schedules import build_schedule
from node.train.data import DataConfig, validation_batches
from node.train.model import model_config
from node.train.reference import ReferenceTrainer, evaluate_loss
from node.train.runtime import OptimConfig
from node.train.trainer import TrainerConfig

pytestmark = pytest.mark.timeout(400)  # generous: the CI box may be shared

#: fp32 tolerance of "same parameters as single-process training"
MAX_ABS_DIFF = 1e-5


def _config(run_id, **kw):
    return TrainerConfig(run_id=run_id, model=model_config("tiny"), optim=OptimConfig(lr=3e-3),
                         data=DataConfig(microbatch_size=4), **kw)


def _max_diff(swarm, reference):
    worst = 0.0
    for stage, nodes in enumerate(swarm.schedule["stages"]):
        ref = reference.stages[stage].module
        for n in nodes:  # every replica, not just one
            mod = swarm.nodes[n].runtime.module
            for (name, p), q in zip(mod.named_parameters(), ref.parameters()):
                worst = max(worst, float((p.detach() - q.detach()).abs().max()))
    return worst


def _replica_gap(modules):
    gap = 0.0
    for other in modules[1:]:
        for p, q in zip(modules[0].parameters(), other.parameters()):
            gap = max(gap, float((p.detach() - q.detach()).abs().max()))
    return gap


async def test_full_path_swarm_matches_single_process_training(splits):
    # every path visits every stage in order; one replica per stage, two data nodes (stage 0 is averaged)
    iterations = 4
    schedule = build_schedule(6, data_nodes=2, replicas=[1] * 5, path_length=6, microbatches=3, memory=2)
    cfg = _config("equiv")
    reference = ReferenceTrainer(cfg.model, cfg.optim, cfg.data, splits, schedule, seed=cfg.seed)
    ref_losses = [reference.train_iteration() for _ in range(iterations)]
    async with InProcessSwarm(schedule, cfg, splits) as swarm:
        stats = await swarm.train(iterations)
        diff = _max_diff(swarm, reference)
        peaks = [n.runtime.peak_in_flight for n in swarm.nodes]
    assert len(stats) == iterations and all(s.microbatches == 6 for s in stats)
    assert [s.iteration for s in stats] == list(range(iterations))
    assert stats[0].loss == pytest.approx(ref_losses[0], abs=1e-5)
    assert stats[-1].loss == pytest.approx(ref_losses[-1], abs=1e-4)
    assert diff <= MAX_ABS_DIFF, f"swarm parameters differ from the reference by {diff}"
    assert max(peaks) <= 2  # memory slots honoured
    # the run really trained (a no-op swarm would also "match" an untrained reference)
    assert ref_losses[-1] < ref_losses[0]


async def test_skipping_swarm_lowers_validation_loss(splits):
    # k = 1/3: 6 stages, paths of 4, two replicas for stages 1 and 2, some paths reordered
    iterations = 30
    schedule = build_schedule(6, data_nodes=2, replicas=[2, 2, 1, 1, 1], path_length=4, microbatches=3,
                              memory=2, reorder=True)
    cfg = _config("skip")
    val = validation_batches(splits, cfg.data, 8)
    async with InProcessSwarm(schedule, cfg, splits) as swarm:
        before = evaluate_loss(swarm.stage_modules(), val)
        stats = await swarm.train(iterations)
        after = evaluate_loss(swarm.stage_modules(), val)
        replica_gap = max(_replica_gap([swarm.nodes[n].runtime.module for n in nodes]) for nodes in schedule["stages"])
        averaged = [s.averaged for n in swarm.nodes for s in n.history if n.averager is not None]
        peaks = [n.runtime.peak_in_flight for n in swarm.nodes]
    assert len(stats) == iterations
    assert before - after > 1.0, f"validation loss {before:.3f} -> {after:.3f}"
    assert all(averaged) and averaged  # every averaging round succeeded
    # hivemind applies the average as local += (avg - local), so replicas agree to rounding, not bitwise
    assert replica_gap <= MAX_ABS_DIFF, f"replicas diverged by {replica_gap}"
    assert max(peaks) <= 2


async def test_resume_continues_from_the_last_committed_step(splits, tmp_path):
    schedule = build_schedule(6, data_nodes=1, replicas=[1] * 5, path_length=6, microbatches=2, memory=1)
    cfg = _config("resume", checkpoint_dir=str(tmp_path), checkpoint_every=2)
    reference = ReferenceTrainer(cfg.model, cfg.optim, cfg.data, splits, schedule, seed=cfg.seed)
    for _ in range(5):
        reference.train_iteration()
    async with InProcessSwarm(schedule, cfg, splits) as swarm:
        await swarm.train(3)  # checkpoint at 2 (every K) and 3 (clean shutdown)
    async with InProcessSwarm(schedule, dataclasses.replace(cfg, resume=True), splits) as swarm:
        assert swarm.start_iteration == 3
        stats = await swarm.train(5)
        assert [s.iteration for s in stats] == [3, 4]
        diff = _max_diff(swarm, reference)
    assert diff <= MAX_ABS_DIFF


async def test_opposite_reordered_paths_with_one_memory_slot_finish_and_match_reference(splits):
    # data node 0 goes 0 -> s1 -> s2 -> 0, data node 1 goes 1 -> s2 -> s1 -> 1, one slot per node:
    # each stage node can end up holding a microbatch whose next hop is the other (a cyclic wait)
    cfg = dataclasses.replace(_config("cycle", memory_deadlock_grace_s=0.5), model=model_config("tiny", n_stages=3))
    schedule = {"stages": [[0, 1], [2], [3]], "path_length": 3, "memory": 1,
                "paths": [{"data_node": 0, "route": [0, 2, 3], "microbatches": 2},
                          {"data_node": 1, "route": [1, 3, 2], "microbatches": 2}]}
    reference = ReferenceTrainer(cfg.model, cfg.optim, cfg.data, splits, schedule, seed=cfg.seed)
    for _ in range(3):
        reference.train_iteration()
    async with InProcessSwarm(schedule, cfg, splits) as swarm:
        stats = await swarm.train(3)
        diff = _max_diff(swarm, reference)
    assert [s.microbatches for s in stats] == [4, 4, 4]
    assert diff <= MAX_ABS_DIFF


async def test_skipping_swarm_scales_each_stage_by_its_inverse_visit_share_as_the_reference_does(splits):
    # paths of 4 of 6 stages: the skipped stages see a share p < 1 of the microbatches and train with their
    # residual branches scaled by 1/p (the default branch scaling); the modules stay plain models
    iterations = 3
    schedule = build_schedule(6, data_nodes=1, replicas=[1] * 5, path_length=4, microbatches=5, memory=2)
    cfg = _config("inverse")
    assert cfg.branch_scaling == "inverse"
    reference = ReferenceTrainer(cfg.model, cfg.optim, cfg.data, splits, schedule, seed=cfg.seed)
    plain = ReferenceTrainer(cfg.model, cfg.optim, cfg.data, splits, schedule, seed=cfg.seed, branch_scaling="none")
    for _ in range(iterations):
        reference.train_iteration()
        plain.train_iteration()
    async with InProcessSwarm(schedule, cfg, splits) as swarm:
        await swarm.train(iterations)
        diff, diff_plain = _max_diff(swarm, reference), _max_diff(swarm, plain)
        scales = {swarm.nodes[n].runtime.stage: swarm.nodes[n].runtime.branch_scale for n in range(len(swarm.nodes))}
        module_scales = {n.runtime.module.branch_scale for n in swarm.nodes}
    assert scales[0] == 1.0 and sum(scales[s] > 1.0 for s in range(1, 6)) >= 3, scales  # skipped stages
    assert scales == {s: st.branch_scale for s, st in enumerate(reference.stages)}
    assert module_scales == {1.0}  # sketches, exports and evaluation see the plain model
    assert diff <= MAX_ABS_DIFF, f"swarm parameters differ from the inverse-scaled reference by {diff}"
    assert diff_plain > 100 * MAX_ABS_DIFF, "the swarm trained as plain skip training: no scale was applied"
