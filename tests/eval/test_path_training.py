"""Single-process path training: equals the reference, means over visits, deterministic, learns."""

import dataclasses

import pytest
import torch

from node.train.data import validation_batches
from node.train.model import model_config
from node.eval.path_training import (PathTrainer, branch_scales_for, full_pipeline_schedule, set_branch_scales,
                                     stage_routes, stage_visit_shares)
from node.train.reference import ReferenceTrainer, evaluate_loss
from node.train.runtime import OptimConfig
from tests.eval.conftest import skip_schedule

#: fp32 tolerance of "the same training as the reference" (the brief's bound)
MAX_ABS_DIFF = 1e-6
OPTIM = OptimConfig(lr=3e-3)


def _max_diff(a, b):
    return max(float((p.detach() - q.detach()).abs().max())
               for ma, mb in zip(a, b) for p, q in zip(ma.parameters(), mb.parameters()))


@pytest.mark.parametrize("schedule, scaling", [(full_pipeline_schedule(6, data_nodes=2, microbatches=3), "none"),
                                               (skip_schedule(), "none"), (skip_schedule(), "inverse")],
                         ids=["full-pipeline", "skip", "skip-inverse"])
def test_matches_reference_trainer(splits, data_cfg, schedule, scaling):
    # the bench's --train-branch-scale inverse is the swarm's (and the reference's) --branch-scaling inverse
    iterations = 4
    cfg = model_config("tiny")
    ref = ReferenceTrainer(cfg, OPTIM, data_cfg, splits, schedule, seed=0, branch_scaling=scaling)
    ours = PathTrainer(cfg, OPTIM, data_cfg, splits, schedule, seed=0)
    train_scales, _ = branch_scales_for(scaling, stage_visit_shares(ours.routes, cfg.n_stages))
    set_branch_scales(ours.stages, train_scales)
    assert [st.branch_scale for st in ref.stages] == pytest.approx(train_scales)
    ref_losses = [ref.train_iteration() for _ in range(iterations)]
    our_losses = [ours.train_iteration().loss for _ in range(iterations)]
    assert our_losses == pytest.approx(ref_losses, abs=1e-6)
    assert _max_diff(ref.modules(), ours.modules()) <= MAX_ABS_DIFF
    assert ref_losses[-1] < ref_losses[0]  # it trained: an untouched model would also "match"


def test_stage_gradient_is_mean_over_visiting_microbatches(splits, data_cfg):
    # one data node, 3 microbatches; stage 1 has 2 replicas and is visited by 2 microbatches,
    # stage 3 by one: dividing by replica count (2) would halve stage 3's gradient
    schedule = {"stages": [[0], [1, 2], [3], [4], [5], [6]], "path_length": 3, "memory": 1,
                "paths": [{"data_node": 0, "route": [0, 1, 3], "microbatches": 1},
                          {"data_node": 0, "route": [0, 2, 4], "microbatches": 1},
                          {"data_node": 0, "route": [0, 5, 6], "microbatches": 1}]}
    cfg = model_config("tiny")
    trainer = PathTrainer(cfg, dataclasses.replace(OPTIM, clip_norm=0.0), data_cfg, splits, schedule, seed=0)
    captured = {}
    for s, opt in enumerate(trainer.optimizers):
        def grab(s=s):
            captured[s] = [p.grad.clone() for p in trainer.stages[s].parameters()]
        opt.step = grab
    res = trainer.train_iteration()
    assert res.visits == [3, 2, 1, 1, 1, 1]
    # expected: per-microbatch gradients of fresh copies, averaged over the visitors of each stage
    expected = {s: None for s in range(6)}
    routes = stage_routes(schedule)[0]
    for j, route in enumerate(routes):
        fresh = PathTrainer(cfg, OPTIM, data_cfg, splits, schedule, seed=0)
        fresh._microbatch(0, j, route)
        for s in (0,) + route:
            g = [p.grad.clone() for p in fresh.stages[s].parameters()]
            expected[s] = g if expected[s] is None else [a + b for a, b in zip(expected[s], g)]
    for s in range(6):
        n = res.visits[s]
        for got, want in zip(captured[s], expected[s]):
            torch.testing.assert_close(got, want / n, rtol=1e-5, atol=1e-7)


def test_deterministic_given_seed(splits, data_cfg):
    cfg = model_config("tiny")
    runs = []
    for seed in (0, 0, 1):
        t = PathTrainer(cfg, OPTIM, data_cfg, splits, skip_schedule(), seed=seed)
        for _ in range(2):
            t.train_iteration()
        runs.append(t.modules())
    assert _max_diff(runs[0], runs[1]) == 0.0
    assert _max_diff(runs[0], runs[2]) > 0.0


def test_skip_training_lowers_validation_loss(splits, data_cfg):
    cfg = model_config("tiny")
    trainer = PathTrainer(cfg, OPTIM, data_cfg, splits, skip_schedule(), seed=0)
    val = validation_batches(splits, data_cfg, 8)
    before = evaluate_loss(trainer.modules(), val)
    for _ in range(30):
        trainer.train_iteration()
    after = evaluate_loss(trainer.modules(), val)
    assert after < before - 0.5, f"validation loss {before:.3f} -> {after:.3f}"


def test_checkpoint_resume_continues_identically(tmp_path, splits, data_cfg):
    cfg = model_config("tiny")
    straight = PathTrainer(cfg, OPTIM, data_cfg, splits, skip_schedule(), seed=0)
    for _ in range(3):
        straight.train_iteration()
    first = PathTrainer(cfg, OPTIM, data_cfg, splits, skip_schedule(), seed=0)
    for _ in range(2):
        first.train_iteration()
    paths = first.save_checkpoint(tmp_path, "run")
    assert [p.relative_to(tmp_path).as_posix() for p in paths] == [f"run/stage{s}/path-trainer.pt" for s in range(6)]
    resumed = PathTrainer(cfg, OPTIM, data_cfg, splits, skip_schedule(), seed=5)  # other init: must be overwritten
    assert resumed.load_checkpoint(tmp_path, "run") and resumed.iteration == 2
    resumed.train_iteration()
    assert _max_diff(straight.modules(), resumed.modules()) == 0.0
