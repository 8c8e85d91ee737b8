"""Unit tests of the stage model, data shards, schedule builder and checkpoint files (no network)."""

import os

import pytest
import torch

from node.train.checkpoint import CheckpointStore
from node.launch.schedules import build_schedule
from node.train.data import DataConfig, DataShard, validation_batches
from node.errors import UserError
from node.train.model import MODEL_SIZES, DecoderLayer, apply_rotary, build_stage, model_config, rotary_tables
from node.train.epochs import parse_schedule, routes_for, stage_index


def _stages(cfg, seed=0):
    return [build_stage(cfg, s, seed) for s in range(cfg.n_stages)]


def test_500m_layer_matches_paper_parameter_count():
    cfg = MODEL_SIZES["500m"]
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.ffn_dim, cfg.context) == (1024, 24, 16, 4096, 1024)
    assert (cfg.n_stages, cfg.layers_per_stage) == (6, 4)
    # 4*d^2 + 3*d*ffn + 2*d (attention, SwiGLU, two norms)
    assert sum(p.numel() for p in DecoderLayer(cfg).parameters()) == 16_779_264


def test_initialisation_is_a_function_of_seed_and_stage():
    cfg = MODEL_SIZES["tiny"]
    a, b = build_stage(cfg, 2, seed=7), build_stage(cfg, 2, seed=7)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    c = build_stage(cfg, 3, seed=7)
    assert not torch.equal(a.layers[0].attn.q_proj.weight, c.layers[0].attn.q_proj.weight)


def test_reordered_and_partial_paths_run_and_differ():
    cfg = model_config("tiny")
    stages = _stages(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    targets = torch.randint(0, cfg.vocab_size, (2, 16))

    def loss(order):
        h = stages[0].embed(tokens)
        for s in order:
            h = stages[s](h)
        return stages[0].head_loss(h, targets)

    full, skip, swapped = loss([1, 2, 3, 4, 5]), loss([1, 3, 5]), loss([1, 3, 2, 5])
    assert all(torch.isfinite(x) for x in (full, skip, swapped))
    assert len({round(x.item(), 6) for x in (full, skip, swapped)}) == 3
    swapped.backward()
    assert stages[2].layers[0].mlp.down_proj.weight.grad is not None
    assert stages[4].layers[0].mlp.down_proj.weight.grad is None  # stage 4 was skipped


def test_attention_is_causal_and_position_aware():
    cfg = model_config("tiny")
    st = build_stage(cfg, 1)
    x = torch.randn(1, 10, cfg.d_model)
    y = st(x)
    x2 = x.clone()
    x2[:, 7:] += 1.0  # changing the future must not change the past
    assert torch.allclose(st(x2)[:, :7], y[:, :7], atol=1e-6)
    # RoPE: without positions, the last output would not change when the context is permuted
    perm = torch.cat([torch.randperm(9), torch.tensor([9])])
    assert (st(x[:, perm])[:, -1] - y[:, -1]).abs().max() > 1e-5


def test_rotary_tables_live_on_the_positions_device():
    """A stage on a GPU built its rotary tables half on the CPU and crashed (seen on an H200); the
    meta device stands in for the GPU here: mixing it with a CPU tensor fails the same way."""
    cos, sin = rotary_tables(16, torch.arange(5, device="meta"))
    assert cos.device.type == "meta" and sin.device.type == "meta"
    assert tuple(cos.shape) == (5, 8)
    stage = build_stage(model_config("tiny"), 1, seed=0).to("meta")
    assert stage(torch.empty(2, 5, stage.cfg.d_model, device="meta")).device.type == "meta"


def test_rotary_scores_depend_only_on_relative_position():
    head_dim = 16
    q, k = torch.randn(head_dim), torch.randn(head_dim)
    cos, sin = rotary_tables(head_dim, torch.arange(12))

    def score(m, n):
        qm = apply_rotary(q.view(1, 1, 1, -1), cos[m:m + 1], sin[m:m + 1]).flatten()
        kn = apply_rotary(k.view(1, 1, 1, -1), cos[n:n + 1], sin[n:n + 1]).flatten()
        return float(qm @ kn)

    assert abs(score(5, 2) - score(9, 6)) < 1e-4
    assert abs(score(5, 2) - score(5, 4)) > 1e-4


def test_explicit_dims_and_bad_configs():
    cfg = model_config("tiny", d_model=32, n_heads=4, n_kv_heads=1, n_stages=3)
    assert cfg.n_layers == 3 and cfg.head_dim == 8
    with pytest.raises(UserError):
        model_config("tiny", n_heads=3)
    with pytest.raises(UserError):
        model_config("huge")


def test_shards_are_disjoint_deterministic_and_hold_out_validation(splits):
    cfg = DataConfig()
    a, b = DataShard(splits, cfg, 0, 2), DataShard(splits, cfg, 1, 2)
    x1, y1 = a.batch(3, 1)
    x2, y2 = a.batch(3, 1)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are inputs shifted by one
    assert not torch.equal(a.batch(3, 2)[0], x1)
    rows_a = {tuple(r.tolist()) for r in a.windows[:2000]}
    rows_b = {tuple(r.tolist()) for r in b.windows[:2000]}
    assert not rows_a & rows_b
    assert len(a.windows) + len(b.windows) == (len(splits.train) - 1) // cfg.seq_len
    val = validation_batches(splits, cfg, 2)
    assert val[0][0].shape == (cfg.microbatch_size, cfg.seq_len)
    assert len(splits.train) > 10 * len(splits.val) > 0


def test_build_schedule_is_balanced_and_valid():
    sched = build_schedule(6, 2, [2, 2, 1, 1, 1], path_length=4, microbatches=5, memory=2, reorder=True)
    plan = parse_schedule(sched)
    stage_of = stage_index(plan)
    routes = routes_for(plan, 0) + routes_for(plan, 1)
    assert len(routes) == 10 and all(len(r) == 4 for r in routes)
    visits = {s: 0 for s in range(1, 6)}
    for r in routes:
        for n in r[1:]:
            visits[stage_of[n]] += 1
    assert max(visits.values()) - min(visits.values()) <= 1
    assert any([stage_of[n] for n in r[1:]] != sorted(stage_of[n] for n in r[1:]) for r in routes)
    with pytest.raises(UserError):
        parse_schedule({"stages": [[0], [1]], "paths": [{"data_node": 0, "route": [0, 1, 1]}]})


def test_checkpoint_write_is_atomic(tmp_path):
    store = CheckpointStore(tmp_path, "run", 2, "node/2")
    assert store.load() is None
    store.save(4, {"w": torch.ones(3)}, {"k": 1})
    store.save(5, {"w": torch.full((3,), 2.0)})
    ck = store.load()
    assert ck.iteration == 5 and torch.equal(ck.state["w"], torch.full((3,), 2.0))
    assert os.listdir(store.path.parent) == [store.path.name]  # no temp files left behind


def test_branch_scale_interpolates_between_skipping_and_the_plain_stage():
    """branch_scale 1.0 is the plain stage, 0.0 turns a stage into the identity (the stage skipped),
    and values in between shrink its residual update (the stochastic-depth inference rule)."""
    cfg = model_config("tiny")
    stage = build_stage(cfg, 2, seed=3)
    x = torch.randn(2, 16, cfg.d_model)
    with torch.no_grad():
        plain = stage(x)
        stage.branch_scale = 0.0
        assert torch.equal(stage(x), x)
        stage.branch_scale = 0.5
        half = stage(x)
        stage.branch_scale = 1.0
        assert torch.equal(stage(x), plain)
    assert 0 < (half - x).norm() < (plain - x).norm()
    assert "branch_scale" not in stage.state_dict()


@pytest.mark.parametrize("stage_index", [0, 1])
def test_forward_time_probe_runs_on_the_stages_device(stage_index):
    """The trainer times one forward at setup; its probe tensors must be built on the stage's device.

    The meta device stands in for a GPU: a probe built on the CPU fails against a meta stage the same way
    it failed against a CUDA stage."""
    from node.train.runtime import OptimConfig, StageRuntime
    from node.train.timing import measure_forward_s
    from node.train.trainer import TrainerConfig

    cfg = TrainerConfig(device="meta")
    runtime = StageRuntime(build_stage(cfg.model, stage_index, seed=0), OptimConfig(), "meta")
    assert measure_forward_s(runtime, cfg, stage_index, emulation=None) >= 0.0
