"""A whole training iteration of two stages on the ``meta`` device, which stands in for a GPU.

Beyond forward, loss and backward (tests/training/test_device_precision.py): gradient means, the squared
norm and clipping, the optimizer step, the checksum, state snapshots, the averager's copies in and out
of its host buffers, a frame made from a device tensor and the copy of a received one onto the device.
:class:`MetaAsGpu` records the device of every tensor each aten op takes or returns, and answers what
would be a device-to-host transfer on a GPU (a ``.item()``/``float()``, a ``.to("cpu")``, a copy into
a host tensor) with zeros on the host, counting each: on a GPU every one of them waits for the device,
so they are counted per step (one per norm and per checksum, not one per parameter).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from node.dataplane.state_codec import ExpectedState, decode_state, encode_state
from node.train.averaging import StageAverager
from node.train.model import build_stage, model_config
from node.train.runtime import HostToDevice, OptimConfig, StageRuntime, clip_coefficient
from node.train.timing import measure_forward_s, synchronize
from protocol.tensor import TensorFrame

aten = torch.ops.aten


class MetaAsGpu(TorchDispatchMode):
    """Records (op, device) of every tensor an aten op sees; turns meta-to-host transfers into host zeros."""

    def __init__(self):
        super().__init__()
        self.seen = []
        self.transfers = []  # ops that move data from the device to the host (a GPU sync each)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if func is aten._local_scalar_dense.default and first.device.type == "meta":
            self.transfers.append("item")
            return False if first.dtype == torch.bool else 0
        if (func is aten._to_copy.default and first.device.type == "meta"
                and torch.device(kwargs.get("device") or "meta").type == "cpu"):
            self.transfers.append("to_cpu")
            return torch.zeros(first.shape, dtype=kwargs.get("dtype") or first.dtype)
        if func is aten.copy_.default and first.device.type == "cpu" and args[1].device.type == "meta":
            self.transfers.append("copy_to_host")
            return first
        out = func(*args, **kwargs)
        for t in tree_flatten((args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor):
                self.seen.append((str(func), t.device.type, t.dim()))
        return out

    def off_device(self, device: str = "meta"):
        """Ops that touched a tensor off ``device``, but for 0-dim host scalars (a GPU kernel takes
        those as arguments: AdamW keeps its step counts on the host by design)."""
        return sorted({op for op, dev, dim in self.seen if dev != device and dim > 0})

    def reset(self):
        self.seen.clear()
        self.transfers.clear()


class _HostBuffers:
    """hivemind's averager holds its tensors in host buffers, lent out by ``get_tensors()``."""

    def __init__(self, tensors):
        self.tensors = tensors

    @contextlib.contextmanager
    def get_tensors(self):
        yield self.tensors


def _two_stages():
    cfg = model_config("tiny", n_stages=3)
    optim = OptimConfig()
    return cfg, StageRuntime(build_stage(cfg, 0, seed=0), optim, "meta"), StageRuntime(build_stage(cfg, 1, seed=0),
                                                                                          optim, "meta")


def test_a_whole_iteration_stays_on_the_device_and_syncs_once_per_reading():
    cfg, data, middle = _two_stages()
    stages = (data, middle)
    tokens = torch.zeros(2, 8, dtype=torch.long, device="meta")
    rec = MetaAsGpu()
    with rec:
        h = data.start("mb", tokens)
        h = middle.forward("mb", h)
        loss, g = data.loss_and_grad(h, tokens)
        g = middle.backward("mb", g)
        data.finish("mb", g)
        for rt in stages:
            rt.mean_grads()
    assert rec.off_device() == [] and rec.transfers == []

    # the norm exchange: each stage's squared norm is one reading, clipping scales on the device
    rec.reset()
    with rec:
        total = sum(rt.grad_squared_norm() for rt in stages)
    assert rec.transfers == ["item", "item"], rec.transfers
    rec.reset()
    with rec:
        for rt in stages:
            rt.scale_grads(clip_coefficient(total + 4.0, 1.0))  # a norm of 2 against a clip of 1: factor 0.5
    assert rec.off_device() == [] and rec.transfers == []
    assert any("mul" in op for op, _, _ in rec.seen)

    # the averager's copies: our gradients into its host buffers, the averaged ones back
    for rt in stages:
        avg = StageAverager.__new__(StageAverager)
        avg._avg = _HostBuffers([torch.zeros(p.shape) for p in rt.parameters()])
        rec.reset()
        with rec:
            avg._load(rt.grads())
        assert rec.transfers == ["copy_to_host"] * len(rt.parameters())
        rec.reset()
        with rec:
            assert avg._store(rt.grads())
        assert not rec.transfers and {dev for op, dev, _ in rec.seen if "copy_" in op} == {"cpu", "meta"}

    # the step, the checksum (one reading per stage) and a snapshot restored on the device
    rec.reset()
    with rec:
        for rt in stages:
            rt.step()
        sums = [rt.checksum() for rt in stages]
        state = middle.state_dict()
        middle.load_state_dict(state)
    assert rec.off_device() == [], rec.off_device()
    assert rec.transfers == ["item", "item"] and len(sums) == 2
    assert any("adam" in op or "addcdiv" in op or "lerp" in op for op, _, _ in rec.seen)
    assert all(t.device.type == "meta" for t in state["model"].values())
    assert all(p.device.type == "meta" for p in middle.parameters())

    # the snapshot as bytes (state transfer, checkpoints): each tensor leaves the device once, in the
    # encoder, and a received blob is loaded back onto the device
    on_device = len(state["model"]) + sum(  # AdamW's step counts are host scalars already
        isinstance(v, torch.Tensor) and v.device.type == "meta"
        for st in state["optimizer"]["state"].values() for v in st.values())
    rec.reset()
    with rec:
        blob = encode_state(state, {"stage": 1, "iteration": 0})
    assert rec.transfers.count("to_cpu") == on_device and set(rec.transfers) == {"to_cpu"}, rec.transfers
    _, received = decode_state(blob, ExpectedState.of_module(build_stage(cfg, 1, seed=0)))
    rec.reset()
    with rec:
        middle.load_state_dict(received)
    assert all(p.device.type == "meta" for p in middle.parameters())
    assert rec.transfers == []

    # a frame from a device tensor (one transfer), and a received frame back onto the device
    rec.reset()
    with rec:
        frame = TensorFrame.from_tensor(h)
        back = HostToDevice("meta")(frame.to_tensor())
    assert rec.transfers == ["to_cpu"]
    assert frame.shape == tuple(h.shape) and len(frame.data) == h.numel() * 4
    assert back.device.type == "meta" and back.shape == h.shape


def test_the_forward_time_probe_waits_for_the_device():
    """On a GPU the clock must be read after the forward's kernels ran, not after they were queued."""
    cfg, data, middle = _two_stages()
    calls = []

    class Cfg:
        model, data = cfg, type("D", (), {"microbatch_size": 2, "seq_len": 8})()

    seconds = measure_forward_s(middle, Cfg, 1, sync=lambda device: calls.append(torch.device(device).type))
    assert seconds >= 0 and calls == ["meta"] * 6  # before and after each of the 3 timed forwards


def test_synchronize_waits_for_cuda_and_nothing_on_the_cpu(monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(str(device)))
    synchronize("cpu")
    assert waited == []
    synchronize("cuda:0")
    assert waited == ["cuda:0"]
