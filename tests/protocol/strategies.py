"""Hypothesis strategies for every protocol message type, shared by the protocol tests."""

from __future__ import annotations

from hypothesis import strategies as st

from protocol.messages import (
    MEMBERSHIP_KINDS,
    PEER_STATES,
    ActivationMessage,
    GradientMessage,
    HopFailure,
    IterationDone,
    LinkReport,
    MembershipEvent,
    MicrobatchId,
    NormReport,
    RpcRequest,
    RpcResponse,
    ScheduleEpoch,
    StageAdvert,
)
from protocol.tensor import DTYPES, TensorFrame

__all__ = ["ids", "plain_values", "tensor_frames", "MESSAGE_STRATEGIES", "messages"]

#: msgpack's integer range.
INT_MIN, INT_MAX = -(2**63), 2**64 - 1

ids = st.text(max_size=16)
counters = st.integers(0, INT_MAX)
any_ints = st.integers(INT_MIN, INT_MAX)
#: NaN never equals itself, so round-trip equality tests use every other float (inf included).
floats = st.floats(allow_nan=False)
small_shapes = st.lists(st.integers(0, 4), max_size=4).map(tuple)

plain_values = st.recursive(
    st.none() | st.booleans() | any_ints | floats | st.text(max_size=8) | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=16,
)


@st.composite
def tensor_frames(draw: st.DrawFn, dtype: str | None = None) -> TensorFrame:
    """Frames of any dtype and small shape (including () and zero-size) with arbitrary bit patterns."""
    dtype = dtype or draw(st.sampled_from(sorted(DTYPES)))
    shape = draw(small_shapes)
    frame = TensorFrame(dtype=dtype, shape=shape, data=b"")
    size = frame.nbytes
    return TensorFrame(dtype=dtype, shape=shape, data=draw(st.binary(min_size=size, max_size=size)))


microbatch_ids = st.builds(
    MicrobatchId, run_id=ids, epoch=counters, iteration=counters, data_node=ids, index=counters
)


@st.composite
def _hop_messages(draw: st.DrawFn, cls: type) -> object:
    mb = draw(microbatch_ids)
    middle = draw(st.lists(ids, max_size=5))
    route = (mb.data_node, *middle, mb.data_node)
    hop = draw(st.integers(0, len(route) - 1))
    return cls(mb=mb, hop=hop, route=route, tensor=draw(tensor_frames()))


MESSAGE_STRATEGIES: dict[type, st.SearchStrategy] = {
    ActivationMessage: _hop_messages(ActivationMessage),
    GradientMessage: _hop_messages(GradientMessage),
    HopFailure: st.builds(HopFailure, mb=microbatch_ids, hop=counters, peer_id=ids, reason=st.text(max_size=40)),
    IterationDone: st.builds(
        IterationDone,
        run_id=ids,
        epoch=counters,
        iteration=counters,
        data_node=ids,
        visits=st.dictionaries(ids, counters, max_size=5),
        dropped=counters,
    ),
    NormReport: st.builds(
        NormReport,
        run_id=ids,
        epoch=counters,
        iteration=counters,
        peer_id=ids,
        stage=counters,
        sq=st.floats(0, allow_nan=False),
        checksum=floats,
        loss_sum=floats,
        n_mb=counters,
        tokens=counters,
        dropped=counters,
        avg_group=st.lists(ids, max_size=3).map(tuple),
        epochs=st.lists(st.binary(max_size=16), max_size=3).map(tuple),
        loss_scale=st.floats(min_value=1e-30, max_value=1e30),
    ),
    StageAdvert: st.builds(
        StageAdvert,
        run_id=ids,
        peer_id=ids,
        gossip_peer_id=ids,
        maddrs=st.lists(ids, max_size=3).map(tuple),
        gossip_maddrs=st.lists(ids, max_size=3).map(tuple),
        stages=st.lists(counters, max_size=4).map(tuple),
        state=st.sampled_from(sorted(PEER_STATES)),
        compute_s_per_sample_per_layer=st.floats(0, 1e6),
        memory_slots=counters,
        free_slots=counters,
        protocol_version=any_ints,
        rpc_port=st.none() | st.integers(0, 65535),
        location=st.none() | ids,
        timestamp=floats,
        measured_compute_s_per_sample_per_layer=st.none() | st.floats(1e-9, 3600.0),
        movable=st.booleans(),
    ),
    MembershipEvent: st.builds(
        MembershipEvent,
        run_id=ids,
        peer_id=ids,
        kind=st.sampled_from(sorted(MEMBERSHIP_KINDS)),
        stages=st.lists(counters, max_size=4).map(tuple),
        timestamp=floats,
    ),
    LinkReport: st.builds(
        LinkReport,
        run_id=ids,
        src=ids,
        timestamp=floats,
        rtt_ms=st.dictionaries(ids, st.floats(0, allow_nan=False), max_size=4),
        bandwidth_Bps=st.dictionaries(ids, st.floats(0, allow_nan=False), max_size=4),
    ),
    ScheduleEpoch: st.builds(
        ScheduleEpoch,
        run_id=ids,
        epoch=counters,
        coordinator=ids,
        issued_at=floats,
        members=st.lists(ids, max_size=5).map(tuple),
        schedule=st.dictionaries(st.text(max_size=6), plain_values, max_size=4),
        signature=st.binary(max_size=64),
    ),
    RpcRequest: st.builds(RpcRequest, method=ids, params=st.dictionaries(st.text(max_size=6), plain_values, max_size=4)),
    RpcResponse: st.builds(RpcResponse, ok=st.booleans(), result=plain_values, error=st.none() | st.text(max_size=20)),
}

messages = st.one_of(*MESSAGE_STRATEGIES.values())
