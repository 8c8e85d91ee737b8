"""The training branch scale of each stage: its inverse visit share under a schedule (pure units)."""

import pytest
import torch

from node.errors import UserError
from node.launch.schedules import build_schedule
from node.spec import BRANCH_SCALING_MODES
from node.train.branch_scaling import BranchScaling, inference_branch_scale, training_branch_scale, visit_share
from node.train.epochs import parse_schedule
from node.train.model import build_stage, model_config
from node.train.runtime import OptimConfig, StageRuntime


def test_visit_shares_count_microbatches_and_a_full_pipeline_keeps_scale_one():
    plan = parse_schedule({"stages": [[0], [1], [2], [3, 4]], "path_length": 3, "memory": 1,
                           "paths": [{"data_node": 0, "route": [0, 1, 2], "microbatches": 3},
                                     {"data_node": 0, "route": [0, 3, 1], "microbatches": 1}]})
    assert [visit_share(plan, s) for s in range(4)] == [1.0, 1.0, 0.75, 0.25]
    assert training_branch_scale("inverse", plan, 3) == 4.0  # replica 3 of the stage counts; 4 is never visited
    assert training_branch_scale("inverse", plan, 2) == pytest.approx(4 / 3)
    assert training_branch_scale("none", plan, 3) == 1.0
    full = parse_schedule(build_schedule(6, data_nodes=2, replicas=[1] * 5, path_length=6, microbatches=3, memory=2))
    assert {training_branch_scale("inverse", full, s) for s in range(6)} == {1.0}
    with pytest.raises(UserError, match="--branch-scaling"):
        training_branch_scale("half", full, 1)
    assert {m.value for m in BranchScaling} == set(BRANCH_SCALING_MODES)  # the flag's choices


def test_runtime_scale_applies_to_training_forwards_only():
    cfg = model_config("tiny", n_stages=3)
    module = build_stage(cfg, 1, seed=0)
    rt = StageRuntime(module, OptimConfig())
    x = torch.randn(2, 8, cfg.d_model)
    plain = rt.forward("a", x)
    rt.branch_scale = 1.5
    scaled = rt.forward("b", x)
    module.branch_scale = 1.5
    with torch.no_grad():
        expected = module(x)
    module.branch_scale = 1.0
    assert torch.allclose(scaled, expected.to(scaled.dtype), atol=1e-6)
    assert not torch.allclose(scaled, plain)
    assert rt.module.branch_scale == 1.0


def test_an_inverse_trained_model_at_reduced_depth_scales_its_kept_stages_as_training_did():
    assert inference_branch_scale("none", 6, 3) is None  # plain models keep their own scale
    assert inference_branch_scale("inverse", 6, 6) == 1.0  # full depth: the plain model
    assert inference_branch_scale("inverse", 6, 4) == pytest.approx(5 / 3)  # a training path's 1/p (p = 3/5)
    assert inference_branch_scale("inverse", 6, 3) == 2.5
    assert inference_branch_scale("inverse", 6, 1) == 1.0  # stage 0 alone: no branch to scale
