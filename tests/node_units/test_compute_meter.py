"""A node's compute speed measured while it trains: the running median the coordinator re-plans with, and the
advert field that carries it (bounded like every peer input, absent from older senders)."""

import dataclasses

import msgpack
import pytest
import torch

from node.dataplane.emulation import ComputePadder
from node.swarm.daemon import measured_compute_of
from node.train.compute_meter import ComputeMeter, ComputeMeterConfig
from node.train.model import build_stage, model_config
from node.train.runtime import OptimConfig, StageRuntime
from protocol.errors import MalformedMessage
from protocol.limits import MAX_MEASURED_COMPUTE_S
from protocol.messages import StageAdvert, decode, encode
from tests.protocol.test_errors import ADVERT


def test_the_estimate_is_the_median_of_recent_forward_equivalent_steps():
    meter = ComputeMeter(ComputeMeterConfig(window=8, min_samples=4, backward_ratio=1.5))
    for _ in range(3):
        meter.record("forward", 0.8, samples=4, layers=2)  # 0.1 s per sample per layer
    assert meter.estimate() is None  # fewer than min_samples
    meter.record("backward", 1.2, samples=4, layers=2)  # a backward 1.5x the forward: the same speed
    assert meter.estimate() == pytest.approx(0.1)
    meter.record("loss", 100.0, samples=4, layers=2)  # the LM head does not scale with layers: ignored
    meter.record("forward", 80.0, samples=4, layers=2)  # one stalled step does not move the median
    assert meter.estimate() == pytest.approx(0.1)
    for _ in range(8):  # slow for good: the window fills with the new speed
        meter.record("forward", 3.2, samples=4, layers=2)
    assert meter.estimate() == pytest.approx(0.4)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        meter.record("forward", bad, samples=4, layers=2)
    assert meter.steps == 13 and meter.estimate() == pytest.approx(0.4)


def test_the_runtime_measures_the_emulated_compute_factor():
    """The straggler bench slows a replica with compute emulation: the stage runtime's meter must see it."""
    target = 0.01
    cfg = model_config("tiny", n_stages=3)
    rt = StageRuntime(build_stage(cfg, 1, 0), OptimConfig(), padder=ComputePadder(target))
    x = torch.randn(2, 8, cfg.d_model)
    for i in range(ComputeMeterConfig().min_samples):
        out = rt.forward(i, x)
        rt.backward(i, torch.ones_like(out))
    estimate = rt.meter.estimate()
    assert estimate is not None and target <= estimate < 5 * target, estimate  # the padding dominates


def test_the_advert_carries_a_bounded_measurement_and_reads_older_senders():
    measured = dataclasses.replace(ADVERT, measured_compute_s_per_sample_per_layer=0.02)
    assert decode(encode(measured), expect=StageAdvert).measured_compute_s_per_sample_per_layer == 0.02
    envelope = msgpack.unpackb(encode(measured), raw=False)
    del envelope["b"]["measured_compute_s_per_sample_per_layer"]  # an older sender
    older = decode(msgpack.packb(envelope, use_bin_type=True), expect=StageAdvert)
    assert older.measured_compute_s_per_sample_per_layer is None
    for bad in (0.0, -0.5, float("nan"), float("inf"), MAX_MEASURED_COMPUTE_S * 2):
        envelope["b"]["measured_compute_s_per_sample_per_layer"] = bad
        with pytest.raises(MalformedMessage):
            decode(msgpack.packb(envelope, use_bin_type=True), expect=StageAdvert)


def test_the_daemon_advertises_only_what_an_advert_can_carry():
    class Log:
        def debug(self, *a, **k):
            pass

    assert measured_compute_of(lambda: 0.03, Log()) == 0.03
    assert measured_compute_of(None, Log()) is None
    assert measured_compute_of(lambda: None, Log()) is None
    assert measured_compute_of(lambda: float("nan"), Log()) is None
    assert measured_compute_of(lambda: 1 / 0, Log()) is None  # a broken hook: the start-up figure serves
