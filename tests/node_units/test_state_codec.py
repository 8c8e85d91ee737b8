"""The stage-state blob decodes without running anything and refuses whatever is not exactly a state of
the receiver's stage: hostile headers, manifests, shapes and dtypes."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from node.dataplane.state_codec import (MAX_DEPTH, ExpectedState, StateCodecError, decode_state, encode_state,
                                        sketches_agree, weights_sketch)
from node.train.model import build_stage, model_config
from node.train.runtime import OptimConfig, StageRuntime


def _runtime(stage: int = 1, seed: int = 0) -> StageRuntime:
    rt = StageRuntime(build_stage(model_config("tiny", n_stages=3), stage, seed), OptimConfig())
    for p in rt.parameters():
        p.grad = torch.ones_like(p)
    rt.optimizer.step()
    return rt


def _blob(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def test_round_trip_keeps_types_and_loads_into_a_fresh_stage():
    rt = _runtime()
    blob = encode_state(rt.state_dict(), {"stage": 1, "iteration": 9})
    manifest, state = decode_state(blob, ExpectedState.of_module(rt.module))
    assert manifest == {"stage": 1, "iteration": 9}
    assert state["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)  # a tuple stays a tuple
    assert all(isinstance(k, int) for k in state["optimizer"]["state"])  # parameter indices stay integers
    fresh = _runtime(seed=5)
    fresh.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), rt.parameters()))


@pytest.mark.parametrize("blob", [
    b"",
    b"\x80\x04\x95" + bytes(64),  # a pickle
    struct.pack("<Q", 1 << 40) + b"{}",  # a header that claims a terabyte
    _blob({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)),  # no manifest
    _blob({"__metadata__": {"skippipe": json.dumps({"state": {"x": 1, "y": 2}})}}),  # untyped node
    _blob({"__metadata__": {"skippipe": json.dumps({"state": {"o": "os.system"}})}}),  # unknown kind
    _blob({"__metadata__": {"skippipe": json.dumps({"state": {"t": "missing"}})}}),  # dangling tensor
    _blob({"__metadata__": {"skippipe": json.dumps({"state": {"l": [{"l": []}] * 2}})},
           "w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, bytes(8)),  # size != shape
    _blob({"__metadata__": {"skippipe": json.dumps({"state": {"t": "w"}})},
           "w": {"dtype": "O", "shape": [1], "data_offsets": [0, 8]}}, bytes(8)),  # unknown dtype
    _blob({"__metadata__": {"skippipe": json.dumps({"state": {"t": "w"}})},
           "w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8)),  # beyond the data
])
def test_malformed_blobs_are_refused(blob):
    with pytest.raises(StateCodecError):
        decode_state(blob)


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 100_000])
def test_deep_nesting_is_refused_without_recursion_errors(depth):
    tree = '{"l":[' * depth + '{"t":"w"}' + "]}" * depth
    with pytest.raises(StateCodecError, match="deeper"):
        decode_state(_blob({"__metadata__": {"skippipe": '{"state":' + tree + "}"}}))


def test_another_stage_or_shape_or_dtype_is_refused_before_loading():
    rt = _runtime()
    expected = ExpectedState.of_module(rt.module)
    other = _runtime(stage=0).state_dict()
    with pytest.raises(StateCodecError, match="model tensors differ"):
        decode_state(encode_state(other), expected)
    state = rt.state_dict()
    name = next(iter(state["model"]))
    for bad in (torch.zeros(3), state["model"][name].double()):
        with pytest.raises(StateCodecError, match=name):
            decode_state(encode_state({**state, "model": {**state["model"], name: bad}}), expected)
    opt = state["optimizer"]
    bad_opt = {**opt, "state": {**opt["state"], 0: {**opt["state"][0], "exp_avg": torch.zeros(7)}}}
    with pytest.raises(StateCodecError, match="optimizer tensor"):
        decode_state(encode_state({**state, "optimizer": bad_opt}), expected)


def test_sketches_tolerate_rounding_but_not_changes():
    rt = _runtime()
    model = rt.module.state_dict()
    nonce = b"n" * 16
    base = weights_sketch(model, nonce)
    rounding = {k: v * (1 + 1e-7) for k, v in model.items()}
    assert sketches_agree(base, weights_sketch(rounding, nonce))
    g = torch.Generator().manual_seed(0)
    changed = {k: v + 0.01 * v.abs().mean() * torch.randn(v.shape, generator=g) for k, v in model.items()}
    assert not sketches_agree(base, weights_sketch(changed, nonce))
    assert not sketches_agree(base, weights_sketch({k: torch.zeros_like(v) for k, v in model.items()}, nonce))
    assert not sketches_agree(base, weights_sketch(model, b"m" * 16))  # another nonce, other directions
