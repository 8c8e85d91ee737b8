"""Device placement and mixed precision of a stage, on the CPU (no GPU needed).

Device: a :class:`TorchDispatchMode` sees every tensor each aten op of a stage's forward, loss and
backward takes or returns. The stage runs on the ``meta`` device, which stands in for a GPU: any
tensor created on the CPU (a table built without ``device=``, a constant, a probe) shows up as a
CPU tensor and fails the check, as it would have crashed on CUDA.

Precision: the loss scaler's arithmetic, and bf16/fp16 autocast training (CPU autocast supports
both) against fp32 and against the single-process reference, with stated tolerances.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from node.train.model import build_stage, model_config
from node.train.precision import (LossScaler, ScalerConfig, autocast_dtype, default_precision, loss_scales_agree,
                                  resolve_precision, wire_round_trip)
from node.train.runtime import BOUNDARY_DTYPE, HostToDevice, OptimConfig, StageRuntime


class DeviceRecorder(TorchDispatchMode):
    """Records (op, device) of every tensor an aten op receives or returns."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten((args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor):
                self.seen.append((str(func), t.device.type))
        return out

    def off_device(self, device: str):
        return sorted({op for op, dev in self.seen if dev != device})


def _meta_inputs(cfg, batch=2, seq=8):
    tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    hidden = torch.empty(batch, seq, cfg.d_model, device="meta")
    return tokens, hidden


def test_every_tensor_of_forward_loss_and_backward_lives_on_the_stages_device():
    cfg = model_config("tiny", n_stages=3)
    data = StageRuntime(build_stage(cfg, 0, seed=0), OptimConfig(), "meta")
    middle = StageRuntime(build_stage(cfg, 1, seed=0), OptimConfig(), "meta")
    tokens, hidden = _meta_inputs(cfg)
    rec = DeviceRecorder()
    with rec:
        h = data.start("mb", tokens)
        h = middle.forward("mb", h)
        loss, g = data.loss_and_grad(h, tokens)
        g = middle.backward("mb", g)
        data.finish("mb", g)
        middle.mean_grads()
        data.mean_grads()
    assert len(rec.seen) > 100  # the ops really went through the recorder, backward included
    assert any("mm" in op or "addmm" in op or "matmul" in op for op, _ in rec.seen)
    assert rec.off_device("meta") == [], f"ops touched non-meta tensors: {rec.off_device('meta')}"
    assert h.device.type == g.device.type == loss.device.type == "meta"
    assert h.dtype == g.dtype == BOUNDARY_DTYPE
    assert all(p.grad.device.type == "meta" for p in middle.parameters())


def test_the_check_fails_on_a_tensor_created_on_the_cpu():
    """Negative control: a stage that builds one constant without ``device=`` is caught."""
    cfg = model_config("tiny", n_stages=3)
    stage = build_stage(cfg, 1, seed=0)
    plain_forward = stage.forward

    def careless(x):
        return plain_forward(x) * torch.ones(x.shape[-1]).to(x.device)  # created on the CPU, then moved

    stage.forward = careless
    rt = StageRuntime(stage, OptimConfig(), "meta")
    rec = DeviceRecorder()
    with rec:
        rt.forward("mb", _meta_inputs(cfg)[1])
    assert rec.off_device("meta"), "a CPU-created tensor went unnoticed"


def test_host_to_device_copies_only_when_needed():
    cpu = HostToDevice("cpu")
    t = torch.ones(3)
    assert cpu(t) is t and cpu.copies == 0
    meta = HostToDevice("meta")
    assert not meta.pinned  # pinned staging is for CUDA only (pin_memory needs a CUDA runtime)
    out = meta(t)
    assert out.device.type == "meta" and meta.copies == 1
    assert meta(out) is out
    assert HostToDevice("cuda").pinned


def test_meta_stage_refuses_autocast():
    with pytest.raises(ValueError, match="autocast"):
        StageRuntime(build_stage(model_config("tiny", n_stages=3), 1, seed=0), OptimConfig(), "meta",
                     precision="bf16")


# ------------------------------------------------------------------ precision settings and loss scaler
def test_precision_names_and_defaults():
    assert autocast_dtype("fp32") is None
    assert autocast_dtype("bf16") is torch.bfloat16 and autocast_dtype("fp16") is torch.float16
    with pytest.raises(ValueError):
        autocast_dtype("fp8")
    assert default_precision("cpu") == "fp32"
    assert resolve_precision(None, "cpu") == resolve_precision("auto", "cpu") == "fp32"
    assert resolve_precision("bf16", "cpu") == "bf16"


def test_loss_scaler_backs_off_grows_and_is_bounded():
    s = LossScaler(ScalerConfig(init_scale=8.0, growth_interval=3, min_scale=1.0, max_scale=16.0))
    s.update(overflow=True)
    assert s.scale == 4.0 and s.skipped == 1
    for _ in range(3):
        s.update(overflow=False)
    assert s.scale == 8.0
    for _ in range(2):
        s.update(overflow=False)
    s.update(overflow=True)  # an overflow resets the run of good steps
    assert s.scale == 4.0 and s.good_steps == 0
    for _ in range(12):
        s.update(overflow=False)
    assert s.scale == 16.0  # capped
    for _ in range(10):
        s.update(overflow=True)
    assert s.scale == 1.0  # floored


def test_loss_scalers_that_see_the_same_overflows_agree_and_state_travels():
    import random

    rng = random.Random(0)
    events = [rng.random() < 0.1 for _ in range(5000)]
    a, b = LossScaler(), LossScaler()
    for e in events:
        a.update(e)
    for e in events[:2500]:
        b.update(e)
    c = LossScaler()
    c.load_state_dict(b.state_dict())  # a joiner / re-synced replica takes the state half-way
    for e in events[2500:]:
        c.update(e)
    assert a.state_dict() == c.state_dict()
    with pytest.raises(ValueError):
        c.load_state_dict({"scale": math.inf, "good_steps": 0})
    with pytest.raises(ValueError):
        LossScaler(ScalerConfig(init_scale=0.5, min_scale=1.0))


def test_loss_scales_agree_compares_with_the_data_nodes_records():
    records = {"a": {"stage": 0, "loss_scale": 1024.0}, "b": {"stage": 0, "loss_scale": 1024.0},
               "c": {"stage": 2, "loss_scale": 5.0}}
    assert loss_scales_agree(records, 1024.0)
    assert not loss_scales_agree(records, 2048.0)
    assert loss_scales_agree({"a": {"stage": 0}}, 7.0)  # records without a scale (older members)
    # data nodes that disagree: the lowest peer id (the canonical stage-0 replica) decides
    split = {"a": {"stage": 0, "loss_scale": 8.0}, "b": {"stage": 0, "loss_scale": 4.0}}
    assert loss_scales_agree(split, 8.0) and not loss_scales_agree(split, 4.0)


def test_fp16_overflow_makes_the_norm_infinite_and_halves_the_scale():
    cfg = model_config("tiny", n_stages=3)
    rt = StageRuntime(build_stage(cfg, 1, seed=0), OptimConfig(), "cpu", precision="fp16")
    scale = rt.loss_scale
    assert scale == 2.0**16
    x = torch.randn(2, 8, cfg.d_model)
    rt.forward("mb", x)
    g = rt.backward("mb", torch.full((2, 8, cfg.d_model), 1e30))  # an inf in fp16
    assert torch.isfinite(g).all() and float(g.abs().sum()) == 0.0  # sent as zeros, never as inf
    rt.mean_grads()
    assert rt.grad_squared_norm() == math.inf
    rt.skip_step()
    assert rt.loss_scale == scale / 2 and rt.grad_squared_norm() == 0.0
    state = rt.state_dict()
    assert state["loss_scaler"]["scale"] == scale / 2


def test_fp16_gradients_are_unscaled_before_anyone_reads_them():
    cfg = model_config("tiny", n_stages=3)
    torch.manual_seed(0)
    x = torch.randn(2, 8, cfg.d_model)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    grads = {}
    for precision in ("fp32", "fp16"):
        rt = StageRuntime(build_stage(cfg, 0, seed=0), OptimConfig(), "cpu", precision=precision)
        loss, g = rt.loss_and_grad(x, tokens)
        rt.mean_grads()
        grads[precision] = (float(loss), g, rt.grad_squared_norm())
    (l32, g32, n32), (l16, g16, n16) = grads["fp32"], grads["fp16"]
    assert l16 == pytest.approx(l32, rel=1e-2)
    # the boundary gradient leaves scaled (the next stage's backward and the norm divide once)
    assert float((g16 / 2.0**16 - g32).abs().max()) <= 2e-2 * float(g32.abs().max())
    assert n16 == pytest.approx(n32, rel=5e-2)  # the parameter gradients came back unscaled


# ------------------------------------------------------------------ against the reference
def _schedule():
    from node.launch.schedules import build_schedule

    return build_schedule(3, data_nodes=1, replicas=[1, 1], path_length=3, microbatches=2, memory=2)


def _reference(splits, precision, wire="fp32", iterations=4):
    from node.train.data import DataConfig
    from node.train.reference import ReferenceTrainer

    cfg = model_config("tiny", n_stages=3)
    ref = ReferenceTrainer(cfg, OptimConfig(lr=3e-3), DataConfig(microbatch_size=2, seq_len=32), splits,
                           _schedule(), seed=0, precision=precision, wire=wire)
    losses = [ref.train_iteration() for _ in range(iterations)]
    return ref, losses


def _param_gap(a, b):
    gap = 0.0
    for sa, sb in zip(a.stages, b.stages):
        for p, q in zip(sa.parameters(), sb.parameters()):
            gap = max(gap, float((p.detach() - q.detach()).abs().max()))
    return gap


#: bf16 (8 significant bits) against fp32 after 4 AdamW steps of lr 3e-3: losses within 2 %
#: relative, parameters within 2e-2 absolute (an AdamW step moves a weight by up to lr = 3e-3;
#: the rounding only changes which way the smallest updates go)
BF16_LOSS_REL = 2e-2
BF16_PARAM_ABS = 2e-2


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_reference_tracks_fp32_within_tolerance(splits, precision):
    ref32, losses32 = _reference(splits, "fp32")
    ref, losses = _reference(splits, precision)
    for a, b in zip(losses, losses32):
        assert a == pytest.approx(b, rel=BF16_LOSS_REL)
    assert losses[-1] < losses[0]
    assert _param_gap(ref, ref32) <= BF16_PARAM_ABS
    # master weights and optimizer state stay float32
    for st in ref.stages:
        assert all(p.dtype == torch.float32 for p in st.parameters())
        assert all(v.dtype == torch.float32 for s in st.optimizer.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor) and v.is_floating_point())


def test_mixed_precision_reference_is_deterministic():
    """Same inputs, same bf16 result: the swarm can be compared with it exactly on one machine."""
    from node.train.data import DataConfig, load_splits

    splits = load_splits(DataConfig())
    a, _ = _reference(splits, "bf16", iterations=2)
    b, _ = _reference(splits, "bf16", iterations=2)
    assert _param_gap(a, b) == 0.0


@pytest.mark.parametrize("wire", ["bf16", "fp16", "int8"])
def test_wire_quantization_in_the_reference(splits, wire):
    ref32, losses32 = _reference(splits, "fp32")
    ref, losses = _reference(splits, "fp32", wire=wire)
    assert losses[0] == pytest.approx(losses32[0], rel=1e-2)  # the first loss only sees forward rounding
    assert losses[-1] == pytest.approx(losses32[-1], rel=2e-2)
    assert 0 < _param_gap(ref, ref32) <= 2e-2


def test_wire_round_trip_keeps_device_and_dtype():
    t = torch.randn(4, 300)
    for codec in ("none", "bf16", "fp16", "int8"):
        out = wire_round_trip(t, codec)
        assert out.dtype == t.dtype and out.shape == t.shape
        assert float((out - t).abs().max()) <= 0.02 * float(t.abs().max())
