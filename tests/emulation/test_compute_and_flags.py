"""Compute padding in StageRuntime (lower bounds only) and the emulation flags (off by default)."""

from __future__ import annotations

import argparse
import time
import types

import pytest
import torch

from node.cli.emulation_args import add_emulation_arguments, daemon_peer_locations, emulation_from_args
from node.errors import UserError
from node.dataplane.emulation import ComputePadder
from node.train.model import build_stage, model_config
from node.train.runtime import OptimConfig, StageRuntime

S_PER_SAMPLE_PER_LAYER = 0.02
SAMPLES = 4
#: time.sleep never returns early, but the monotonic clock has finite resolution.
CLOCK_TOLERANCE_S = 0.001


def runtime(stage: int, padder=None) -> StageRuntime:
    cfg = model_config("tiny")
    return StageRuntime(build_stage(cfg, stage, 0), OptimConfig(), padder=padder)


def timed(fn, *args):
    t0 = time.monotonic()
    out = fn(*args)
    return time.monotonic() - t0, out


def test_runtime_without_padder_is_not_padded():
    assert runtime(1).padder is None


def test_forward_backward_and_loss_are_padded_to_their_targets():
    pad = ComputePadder(S_PER_SAMPLE_PER_LAYER)
    cfg = model_config("tiny")
    mid, data = runtime(1, pad), runtime(0, pad)
    layers = cfg.layers_per_stage
    hidden = torch.randn(SAMPLES, 16, cfg.d_model)
    f_s, y = timed(mid.forward, "k", hidden)
    assert f_s >= pad.target_s("forward", SAMPLES, layers) - CLOCK_TOLERANCE_S
    b_s, _ = timed(mid.backward, "k", torch.ones_like(y))
    assert b_s >= pad.target_s("backward", SAMPLES, layers) - CLOCK_TOLERANCE_S
    tokens = torch.randint(0, cfg.vocab_size, (SAMPLES, 16))
    s_s, h = timed(data.start, "m", tokens)
    assert s_s >= pad.target_s("forward", SAMPLES, layers) - CLOCK_TOLERANCE_S
    l_s, (_, g) = timed(data.loss_backward, h, tokens)
    assert l_s >= pad.target_s("loss", SAMPLES, layers) - CLOCK_TOLERANCE_S
    fin_s, _ = timed(data.finish, "m", g)
    assert fin_s >= pad.target_s("backward", SAMPLES, layers) - CLOCK_TOLERANCE_S


def test_padding_counts_from_ready_at_so_dispatch_latency_is_inside_the_target():
    """A step that could start ``early`` seconds before it was called is padded to end at
    ready_at + target, not call + target; a ready_at in the future is ignored (never padded more)."""
    pad = ComputePadder(S_PER_SAMPLE_PER_LAYER)
    cfg = model_config("tiny")
    mid = runtime(1, pad)
    target = pad.target_s("forward", SAMPLES, cfg.layers_per_stage)
    hidden = torch.randn(SAMPLES, 16, cfg.d_model)
    ready = time.monotonic() - target  # the whole budget was already spent waiting to be dispatched
    mid.forward("k", hidden, ready_at=ready)
    assert time.monotonic() - ready >= target - CLOCK_TOLERANCE_S
    assert pad.overruns == 1  # real work came on top of a spent budget: counted, not hidden
    called = time.monotonic()
    mid.backward("k", torch.ones(SAMPLES, 16, cfg.d_model), ready_at=called + 3600.0)  # would hang if honoured
    assert pad.steps == 2
    assert time.monotonic() - called >= pad.target_s("backward", SAMPLES, cfg.layers_per_stage) - CLOCK_TOLERANCE_S


def parse(argv, location=True):
    p = argparse.ArgumentParser()
    if not location:
        p.add_argument("--location")
    add_emulation_arguments(p, location=location)
    return p.parse_args(argv)


def test_flags_are_off_by_default():
    assert emulation_from_args(parse([])) is None
    assert emulation_from_args(parse([], location=False)) is None


def test_flags_build_an_emulation(tmp_path):
    import json

    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"locations": ["A", "B"], "links": {"A-B": {"latency_ms": 10, "bandwidth_GiBps": 1}}}))
    s = emulation_from_args(parse(["--network-profile", str(prof), "--location", "A", "--latency-scale", "2",
                                   "--compute-s-per-sample-per-layer", "0.01"], location=False))
    emu = s.build({"peer": "B"})
    link = emu.link_emulator._link_for("peer")
    assert link.latency_s == pytest.approx(0.02)
    assert emu.padder.s_per_sample_per_layer == 0.01
    with pytest.raises(UserError):
        emulation_from_args(parse(["--network-profile", str(prof)]))
    with pytest.raises(UserError):
        emulation_from_args(parse(["--network-profile", str(prof), "--location", "Z"]))


def test_daemon_view_locations():
    advert = types.SimpleNamespace(location="B")
    view = types.SimpleNamespace(get=lambda pid: types.SimpleNamespace(advert=advert) if pid == "p" else None)
    lookup = daemon_peer_locations(types.SimpleNamespace(view=view))
    assert lookup("p") == "B" and lookup("q") is None


def test_node_run_accepts_the_flags_and_builds_a_trainer_service_with_them(tmp_path):
    import json

    from node.cli import build_parser
    from node.cli.train_args import training_services_from_args

    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"locations": ["A", "B"], "links": {"A-B": {"latency_ms": 10, "bandwidth_GiBps": 1}}}))
    args = build_parser().parse_args(["node", "run", "--train", "--location", "B", "--network-profile", str(prof),
                                      "--compute-s-per-sample-per-layer", "0.001"])
    (service,) = training_services_from_args(args)
    assert service.emulation.location == "B" and service.emulation.compute_s_per_sample_per_layer == 0.001
    plain = build_parser().parse_args(["node", "run", "--train"])
    assert training_services_from_args(plain)[0].emulation is None


def test_up_places_nodes_round_robin_and_passes_the_flags_to_daemons(tmp_path):
    import json

    from node.cli import build_parser
    from node.cli.emulation_args import emulation_node_args, round_robin_emulation_for

    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"locations": ["A", "B"], "links": {"A-B": {"latency_ms": 10, "bandwidth_GiBps": 1}},
                                "same_location": {"latency_ms": 0, "bandwidth_GiBps": 1}}))
    args = build_parser().parse_args(["up", "--in-process", "--network-profile", str(prof)])
    settings = emulation_from_args(args, require_location=False)
    emu = round_robin_emulation_for(settings)(1, ["p0", "p1", "p2"])  # node 1 at B; p0, p2 at A
    assert emu.link_emulator._link_for("p0").latency_s == pytest.approx(0.010)
    assert emu.link_emulator._link_for("p2").latency_s == pytest.approx(0.010)
    assert emu.link_emulator._link_for("p1").latency_s == 0.0
    argv = emulation_node_args(settings, 3)
    assert argv[argv.index("--location") + 1] == "B"
    assert emulation_node_args(None, 0) == []
    assert emulation_from_args(build_parser().parse_args(["up"]), require_location=False) is None


def test_arrival_is_backdated_to_the_stamp_only_on_a_node_that_emulates_links():
    from node.train.trainer import arrival_time

    # delivered at its stamp 0.25 s ago, so its work could start then
    assert arrival_time(50.0, 1000.0, 999.75, emulates_links=True) == pytest.approx(49.75)
    assert arrival_time(50.0, 1000.0, 1000.5, emulates_links=True) == 50.0  # early (clock skew): never later than now
    assert arrival_time(50.0, 1000.0, None, emulates_links=True) == 50.0
    assert arrival_time(50.0, 1000.0, 999.75, emulates_links=False) == 50.0  # stamp ignored, as its data plane does
