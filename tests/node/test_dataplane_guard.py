"""Hostile data-plane input: the guard's rules one by one, then real hivemind streams on 127.0.0.1.

Unit tests build messages in memory and ask :class:`MicrobatchGuard` directly. The stream tests
run a receiving :class:`DataPlane` (with a guard), an honest peer (its own DataPlane) and a
hostile peer writing raw frames, and check that only good messages reach ``on_message``, every
refusal is counted under its reason, and the receiver keeps serving everyone. Waits are bounded
polls on what was received (no timing assertions).
"""

from __future__ import annotations

import asyncio
import math
import random
import time

import pytest

import node.compat  # noqa: F401  (before hivemind)
from node.compat import import_hivemind
from node.dataplane.transport import DataPlane
from node.dataplane.guard import ENVELOPE_MARGIN_BYTES, FRAME_SIZE_FACTOR, MicrobatchGuard
from node.ops.metrics import NodeMetrics
from protocol import HopFailure, encode
from tests.node.hostile_peer import (
    LOCAL,
    HostilePeer,
    activation,
    frame,
    gradient,
    iteration_done,
    malformed_msgpack,
    random_bytes,
)

pytestmark = pytest.mark.timeout(180)

RUN = "guard-test"
SHAPE = (2, 4, 8)
ME, PREV, NEXT, DATA = "me", "prev", "next", "data"
ROUTE = (DATA, PREV, ME, NEXT, DATA)
EPOCH, ITERATION = 3, 10
#: Bounded wait for something to arrive on a loaded 2-core box (never asserted on).
WAIT_S = 60.0


class Position:
    """A mutable (epoch, iteration), like the trainer's."""

    def __init__(self, epoch=EPOCH, iteration=ITERATION):
        self.value = (epoch, iteration)

    def __call__(self):
        return self.value


def make_guard(position=None, **kwargs) -> MicrobatchGuard:
    return MicrobatchGuard(run_id=RUN, hidden_shape=SHAPE, position=position or Position(), self_id=ME, **kwargs)


def good_activation(**kw):
    kw.setdefault("epoch", EPOCH)
    kw.setdefault("iteration", ITERATION)
    return activation(RUN, ROUTE, 2, frame(SHAPE, 0.5), **kw)


def good_gradient(**kw):
    kw.setdefault("epoch", EPOCH)
    kw.setdefault("iteration", ITERATION)
    return gradient(RUN, ROUTE, 2, frame(SHAPE, 0.5), **kw)


# ---------------------------------------------------------------------- unit: MicrobatchGuard
def test_good_messages_pass():
    g = make_guard()
    assert g.check(good_activation(), PREV) is None
    assert g.check(good_gradient(), NEXT) is None
    assert g.check(iteration_done(RUN, DATA, ITERATION, EPOCH), DATA) is None
    # a data node's own hops: activation back at hop len-1 (loss), gradient from route[1] at hop 0
    own = (ME, PREV, ME)
    assert g.check(activation(RUN, own, 2, frame(SHAPE), epoch=EPOCH, iteration=ITERATION), PREV) is None
    assert g.check(gradient(RUN, own, 0, frame(SHAPE), epoch=EPOCH, iteration=ITERATION), PREV) is None
    assert g.check(HopFailure(activation(RUN, own, 1, frame(SHAPE)).mb, 1, PREV, "x"), PREV) is None


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int64"])
def test_wrong_dtype_is_rejected(dtype):
    import torch

    msg = activation(RUN, ROUTE, 2, frame(SHAPE, 1, getattr(torch, dtype)), epoch=EPOCH, iteration=ITERATION)
    assert make_guard().check(msg, PREV) == "wrong_dtype"


def test_other_dtypes_can_be_allowed():
    import torch

    msg = activation(RUN, ROUTE, 2, frame(SHAPE, 1, torch.bfloat16), epoch=EPOCH, iteration=ITERATION)
    assert make_guard(dtypes=("float32", "bfloat16")).check(msg, PREV) is None


@pytest.mark.parametrize("shape", [(2, 4, 9), (2, 4), (1, 4, 8), (2, 4, 8, 1), (64,)])
def test_wrong_shape_is_rejected(shape):
    msg = activation(RUN, ROUTE, 2, frame(shape), epoch=EPOCH, iteration=ITERATION)
    assert make_guard().check(msg, PREV) == "wrong_shape"


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_tensors_are_rejected(bad):
    import torch

    t = torch.zeros(SHAPE)
    t[1, 2, 3] = bad
    from protocol import TensorFrame

    g = make_guard()
    assert g.check(activation(RUN, ROUTE, 2, TensorFrame.from_tensor(t), epoch=EPOCH, iteration=ITERATION),
                   PREV) == "non_finite"
    assert g.check(gradient(RUN, ROUTE, 2, TensorFrame.from_tensor(t), epoch=EPOCH, iteration=ITERATION),
                   NEXT) == "non_finite"


def test_wrong_run_is_rejected():
    g = make_guard()
    assert g.check(activation("other-run", ROUTE, 2, frame(SHAPE), epoch=EPOCH, iteration=ITERATION), PREV) == "wrong_run"
    assert g.check(iteration_done("other-run", DATA, ITERATION), DATA) == "wrong_run"
    assert g.check(HopFailure(activation("other-run", (ME, PREV, ME), 1, frame(SHAPE)).mb, 1, PREV, "x"),
                   PREV) == "wrong_run"


def test_older_epoch_is_rejected_newer_passes():
    g = make_guard()
    assert g.check(good_activation(epoch=EPOCH - 1), PREV) == "out_of_epoch"
    assert g.check(good_activation(epoch=EPOCH + 1), PREV) is None


def test_epoch_may_be_given_as_a_set():
    g = make_guard(position=lambda: (frozenset({EPOCH, EPOCH + 1}), ITERATION))
    assert g.check(good_activation(epoch=EPOCH - 1), PREV) == "out_of_epoch"
    assert g.check(good_activation(epoch=EPOCH), PREV) is None


def test_iteration_window():
    g = make_guard()
    assert g.check(good_activation(iteration=ITERATION - 1), PREV) == "stale_iteration"
    assert g.check(good_activation(iteration=ITERATION + 2), PREV) == "future_iteration"
    assert g.check(good_activation(iteration=ITERATION + 1), PREV) is None
    assert g.check(good_gradient(iteration=ITERATION - 1), NEXT) == "stale_iteration"
    assert g.check(iteration_done(RUN, DATA, ITERATION + 5), DATA) == "future_iteration"
    assert g.check(iteration_done(RUN, DATA, ITERATION - 3), DATA) == "stale_iteration"


def test_unknown_position_skips_the_window_only():
    g = make_guard(position=lambda: None)
    assert g.check(good_activation(epoch=0, iteration=0), PREV) is None
    assert g.check(good_activation(epoch=0, iteration=1, index=1), NEXT) == "wrong_sender"


def test_hop_owned_by_another_node_is_rejected():
    g = make_guard()
    other = (DATA, PREV, "someone", NEXT, DATA)
    assert g.check(activation(RUN, other, 2, frame(SHAPE), epoch=EPOCH, iteration=ITERATION), PREV) == "not_for_us"
    assert g.check(HopFailure(good_activation().mb, 2, PREV, "x"), PREV) == "not_for_us"  # data node is DATA
    # ... but the data node itself may say it gave an attempt up (a hedge beat it): a route node forgets it
    assert g.check(HopFailure(good_activation().mb, 2, DATA, "discarded"), DATA) is None


def test_impossible_hops_are_rejected():
    g = make_guard()
    own = (ME, PREV, ME)
    # nobody sends an activation to hop 0 (the data node starts it) or a gradient to the last hop
    assert g.check(activation(RUN, own, 0, frame(SHAPE), epoch=EPOCH, iteration=ITERATION), PREV) == "bad_hop"
    assert g.check(gradient(RUN, own, 2, frame(SHAPE), epoch=EPOCH, iteration=ITERATION), PREV) == "bad_hop"


def test_wrong_sender_is_rejected():
    g = make_guard()
    assert g.check(good_activation(), NEXT) == "wrong_sender"
    assert g.check(good_activation(index=1), "stranger") == "wrong_sender"
    assert g.check(good_gradient(), PREV) == "wrong_sender"


def test_members_rule_when_given():
    g = make_guard(members=lambda: {DATA, NEXT})
    assert g.check(good_activation(), PREV) == "not_member"
    assert g.check(good_gradient(), NEXT) is None


def test_replay_is_rejected_but_new_attempts_and_directions_pass():
    g = make_guard()
    assert g.check(good_activation(), PREV) is None
    assert g.check(good_activation(), PREV) == "replayed"
    assert g.check(good_activation(attempt=1), PREV) is None
    assert g.check(good_activation(index=1), PREV) is None
    assert g.check(good_gradient(), NEXT) is None
    assert g.check(good_gradient(), NEXT) == "replayed"
    assert g.remembered == 4


def test_rejected_frames_are_not_remembered():
    g = make_guard()
    import torch

    from protocol import TensorFrame

    t = torch.zeros(SHAPE)
    t[0, 0, 0] = math.nan
    nan = activation(RUN, ROUTE, 2, TensorFrame.from_tensor(t), epoch=EPOCH, iteration=ITERATION)
    assert g.check(nan, PREV) == "non_finite"
    assert g.remembered == 0
    assert g.check(good_activation(), PREV) is None  # same id, good tensor: not a replay


def test_replay_memory_is_bounded():
    position = Position()
    g = make_guard(position=position, max_replay_entries=5)
    for i in range(8):
        assert g.check(good_activation(index=i), PREV) is None
    assert g.remembered == 5
    assert g.check(good_activation(index=7), PREV) == "replayed"  # the newest are kept
    position.value = (EPOCH, ITERATION + 2)  # two iterations on: iteration ITERATION is forgotten
    assert g.check(good_activation(iteration=ITERATION + 2), PREV) is None
    assert g.remembered == 1


def test_iteration_done_in_another_data_nodes_name_is_rejected():
    g = make_guard()
    assert g.check(iteration_done(RUN, DATA, ITERATION), "impostor") == "wrong_sender"
    assert g.check(iteration_done(RUN, DATA, ITERATION), DATA) is None


def test_frame_cap_is_derived_from_the_hidden_shape():
    g = make_guard()
    assert g.max_frame_bytes == FRAME_SIZE_FACTOR * math.prod(SHAPE) * 4 + ENVELOPE_MARGIN_BYTES
    assert len(encode(good_activation())) < g.max_frame_bytes
    big = MicrobatchGuard(run_id=RUN, hidden_shape=(8, 1024, 1024), position=Position(), self_id=ME)
    assert big.max_frame_bytes > 2 * 8 * 1024 * 1024 * 4
    with pytest.raises(ValueError):
        MicrobatchGuard(run_id=RUN, hidden_shape=(0, 4), position=Position(), self_id=ME)


def test_self_delivery_bypasses_the_guard():
    class FakeP2P:
        peer_id = ME

    got = []
    plane = DataPlane(FakeP2P(), RUN, lambda m, s: got.append(m), guard=make_guard())
    bad = activation(RUN, ROUTE, 2, frame((1, 1)), epoch=0, iteration=0)  # wrong shape, old epoch
    asyncio.run(plane.send(ME, bad))
    assert got == [bad] and not plane.rejected


# ---------------------------------------------------------------------- real streams
async def _peers(n: int):
    hivemind = import_hivemind()
    first = await hivemind.p2p.P2P.create(host_maddrs=LOCAL)
    initial = [str(m) for m in await first.get_visible_maddrs()]
    rest = [await hivemind.p2p.P2P.create(host_maddrs=LOCAL, initial_peers=initial) for _ in range(n - 1)]
    return [first, *rest], initial


async def _shutdown(*things):
    for t in things:
        if isinstance(t, DataPlane):
            await t.close()
        elif isinstance(t, HostilePeer):
            await t.close()
        else:
            try:
                await asyncio.wait_for(t.shutdown(), 30)
            except Exception:  # noqa: BLE001
                pass


async def _until(cond, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class Receiver:
    """A DataPlane with a guard at (EPOCH, ITERATION), recording what reaches ``on_message``."""

    def __init__(self, p2p, **kwargs):
        self.got: list = []
        self.id = str(p2p.peer_id)
        guard = MicrobatchGuard(run_id=RUN, hidden_shape=SHAPE, position=Position(), self_id=self.id)
        self.plane = DataPlane(p2p, RUN, lambda m, s: self.got.append((m, s)), guard=guard, **kwargs)

    def indices(self, sender: str) -> list:
        return [m.mb.index for m, s in self.got if s == sender and hasattr(m, "mb")]


def _act(sender: str, receiver: str, index: int, fill: float = 0.25, shape=SHAPE, **kw):
    kw.setdefault("epoch", EPOCH)
    kw.setdefault("iteration", ITERATION)
    return activation(RUN, (sender, receiver, sender), 1, frame(shape, fill), index=index, **kw)


async def test_each_bad_kind_is_refused_over_a_real_stream_and_only_good_ones_arrive():
    (r, h, g), _ = await _peers(3)
    hostile = HostilePeer(h, RUN)
    metrics = NodeMetrics()
    rx = Receiver(r, metrics=metrics)
    await rx.plane.start()
    honest = DataPlane(g, RUN, lambda m, s: None)
    H, R, G = hostile.peer_id, rx.id, str(g.peer_id)
    rng = random.Random(1)
    try:
        good = _act(H, R, 0)
        bad = {
            "undecodable": [random_bytes(rng), malformed_msgpack(rng, encode(good))],
            "non_finite": [encode(_act(H, R, 1, math.nan)), encode(_act(H, R, 2, math.inf))],
            "wrong_shape": [encode(_act(H, R, 3, shape=(2, 4, 9)))],
            "wrong_run": [encode(activation("other", (H, R, H), 1, frame(SHAPE), epoch=EPOCH, iteration=ITERATION))],
            "out_of_epoch": [encode(_act(H, R, 4, epoch=EPOCH - 1))],
            "stale_iteration": [encode(_act(H, R, 5, iteration=ITERATION - 1))],
            "future_iteration": [encode(_act(H, R, 6, iteration=ITERATION + 2))],
            "not_for_us": [encode(_act(H, G, 7))],
            "wrong_sender": [encode(activation(RUN, (G, R, G), 1, frame(SHAPE), epoch=EPOCH, iteration=ITERATION)),
                             encode(iteration_done(RUN, G, ITERATION))],
            "replayed": [encode(good)],
        }
        import torch

        bad["wrong_dtype"] = [encode(activation(RUN, (H, R, H), 1, frame(SHAPE, 0, torch.float16), index=8,
                                                epoch=EPOCH, iteration=ITERATION))]
        assert await hostile.send(R, encode(good))
        for frames in bad.values():
            for data in frames:
                assert await hostile.send(R, data)
        marker = _act(H, R, 99)
        assert await hostile.send(R, encode(marker))
        await _until(lambda: 99 in rx.indices(H), "the hostile peer's last good frame")
        # an honest neighbour on its own stream is still served
        await honest.send(R, _act(G, R, 0))
        await _until(lambda: rx.indices(G) == [0], "the honest peer's frame")
    finally:
        await _shutdown(rx.plane, honest, hostile, r, g)
    assert rx.indices(H) == [0, 99]
    assert dict(rx.plane.rejected) == {reason: len(frames) for reason, frames in bad.items()}
    for reason, frames in bad.items():
        assert metrics.sample("skippipe_dataplane_rejected_total", {"reason": reason}) == len(frames)
    assert metrics.traffic()[H]["microbatches_in"] == 2  # only accepted hops count as traffic
    assert metrics.traffic()[G]["bytes_in"] > 0


async def test_peer_outside_the_allowlist_is_refused_and_counted():
    (r, h, g), _ = await _peers(3)
    hostile = HostilePeer(h, RUN)
    allowed = {str(g.peer_id)}
    rx = Receiver(r, allow=lambda p: p in allowed)
    await rx.plane.start()
    honest = DataPlane(g, RUN, lambda m, s: None)
    H, R, G = hostile.peer_id, rx.id, str(g.peer_id)
    try:
        await hostile.send(R, encode(_act(H, R, 0)))  # the stream is closed on us; sending may or may not fail
        await _until(lambda: rx.plane.rejected["not_allowed"] >= 1, "the refusal")
        await honest.send(R, _act(G, R, 0))
        await _until(lambda: rx.indices(G) == [0], "the allowed peer's frame")
        # an allowed peer removed mid-stream loses its open stream at its next frame
        allowed.discard(G)
        before = rx.plane.rejected["not_allowed"]
        try:
            await honest.send(R, _act(G, R, 1))
        except Exception:  # noqa: BLE001
            pass
        await _until(lambda: rx.plane.rejected["not_allowed"] > before, "the refusal of the removed peer")
    finally:
        await _shutdown(rx.plane, honest, hostile, r, g)
    assert rx.indices(H) == []
    assert rx.indices(G) == [0]


async def test_oversized_frames_close_that_stream_only():
    (r, h, g), _ = await _peers(3)
    hostile = HostilePeer(h, RUN)
    rx = Receiver(r)
    await rx.plane.start()
    honest = DataPlane(g, RUN, lambda m, s: None)
    H, R, G = hostile.peer_id, rx.id, str(g.peer_id)
    cap = rx.plane.max_frame_bytes
    try:
        await honest.send(R, _act(G, R, 0))  # an honest stream is open before the attack
        await _until(lambda: rx.indices(G) == [0], "the honest peer's first frame")
        # a header promising a terabyte is refused at once (if the body were read first, this would hang)
        assert await hostile.send_length_header(R, 1 << 40)
        await _until(lambda: rx.plane.rejected["oversized"] == 1, "the header-only refusal")
        # a real frame just over the cap
        await hostile.send(R, b"\0" * (cap + 1), attempts=1)  # the receiver resets the stream mid-write
        await _until(lambda: rx.plane.rejected["oversized"] == 2, "the oversized frame's refusal")
        # the receiver still serves the honest stream and a fresh stream of the same peer
        await honest.send(R, _act(G, R, 1))
        await _until(lambda: rx.indices(G) == [0, 1], "the honest peer's second frame")
        hostile._drop(R)
        assert await hostile.send(R, encode(_act(H, R, 5)))
        await _until(lambda: rx.indices(H) == [5], "the hostile peer's good frame on a new stream")
    finally:
        await _shutdown(rx.plane, honest, hostile, r, g)
    assert set(rx.plane.rejected) == {"oversized"}


async def test_a_flood_is_rate_limited_while_another_peer_gets_through():
    (r, h, g), _ = await _peers(3)
    hostile = HostilePeer(h, RUN)
    # a tiny bucket so the test floods with few frames: 20 at once, then 1 per second
    rx = Receiver(r, frame_rate_per_s=1.0, frame_burst=20)
    await rx.plane.start()
    honest = DataPlane(g, RUN, lambda m, s: None)
    H, R, G = hostile.peer_id, rx.id, str(g.peer_id)
    flood = 300
    try:
        for i in range(flood):
            assert await hostile.send(R, encode(_act(H, R, i)))
        await _until(lambda: len(rx.indices(H)) + rx.plane.rejected["rate_limited"] == flood, "the whole flood")
        for i in range(5):
            await honest.send(R, _act(G, R, i))
        await _until(lambda: len(rx.indices(G)) == 5, "the honest peer's frames")
    finally:
        await _shutdown(rx.plane, honest, hostile, r, g)
    assert rx.plane.rejected["rate_limited"] > 0
    assert len(rx.indices(H)) < flood
    assert rx.indices(G) == list(range(5))
    assert set(rx.plane.rejected) == {"rate_limited"}


async def test_a_failing_handler_does_not_end_the_stream():
    (r, g), _ = await _peers(2)
    got = []

    def on_message(msg, sender):
        got.append(msg.mb.index)
        if msg.mb.index == 0:
            raise RuntimeError("trainer bug")

    R = str(r.peer_id)
    guard = MicrobatchGuard(run_id=RUN, hidden_shape=SHAPE, position=Position(), self_id=R)
    plane = DataPlane(r, RUN, on_message, guard=guard)
    await plane.start()
    honest = DataPlane(g, RUN, lambda m, s: None)
    G = str(g.peer_id)
    try:
        await honest.send(R, _act(G, R, 0))
        await honest.send(R, _act(G, R, 1))
        await _until(lambda: got == [0, 1], "both frames")
    finally:
        await _shutdown(plane, honest, r, g)
    assert got == [0, 1]


async def test_one_peer_cannot_hold_more_than_its_share_of_streams():
    (r, h), _ = await _peers(2)
    hivemind = import_hivemind()
    rx = Receiver(r, max_streams_per_peer=3)
    await rx.plane.start()
    H, R = str(h.peer_id), rx.id
    writers = []
    try:
        for i in range(5):
            _, _, w = await h.call_binary_stream_handler(hivemind.p2p.PeerID.from_base58(R), rx.plane.name)
            writers.append(w)
            try:
                await hivemind.p2p.P2P.send_raw_data(encode(_act(H, R, i)), w)
            except Exception:  # noqa: BLE001 - a refused stream may be reset under us
                pass
            # one stream at a time, so which ones are refused does not depend on scheduling
            await _until(lambda: len(rx.indices(H)) + rx.plane.rejected["too_many_streams"] == i + 1,
                         f"stream {i} to be served or refused")
        assert rx.indices(H) == [0, 1, 2]
        assert rx.plane.rejected["too_many_streams"] == 2
        writers.pop(0).close()  # a stream ends: the peer may open another
        await _until(lambda: rx.plane._streams[H] < 3, "the closed stream's handler to end")
        _, _, w = await h.call_binary_stream_handler(hivemind.p2p.PeerID.from_base58(R), rx.plane.name)
        writers.append(w)
        await hivemind.p2p.P2P.send_raw_data(encode(_act(H, R, 9)), w)
        await _until(lambda: 9 in rx.indices(H), "the frame on the new stream")
    finally:
        for w in writers:
            w.close()
        await _shutdown(rx.plane, r, h)
    assert rx.indices(H) == [0, 1, 2, 9]
