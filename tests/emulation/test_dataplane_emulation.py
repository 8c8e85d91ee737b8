"""Link emulation in the real data plane: two hivemind peers on 127.0.0.1 with a synthetic profile.

The assertions are lower bounds only (a message is never delivered *before* its emulated time), which
hold however loaded the machine is; nothing here asserts that anything is fast. Hop messages are
stamped by the sender and held by the receiver, so both ends emulate (as every daemon of an emulated
swarm does).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

import node.compat  # noqa: F401  (before hivemind)
from node.compat import import_hivemind
from node.dataplane.transport import DataPlane
from node.dataplane.emulation import Emulation
from protocol import ActivationMessage, MicrobatchId, TensorFrame, encode
from scheduler.cost import LinkProfile

#: asyncio may fire a timer up to its clock resolution early; allow that much (and no more).
EARLY_WAKE_TOLERANCE_S = 0.002
LATENCY_MS = 150.0
#: 64 KiB of payload takes SERIALISE_S on the emulated link.
PAYLOAD_FLOATS = 16384
SERIALISE_S = 0.25
BANDWIDTH_BPS = PAYLOAD_FLOATS * 4 / SERIALISE_S
RUN = "emu-test"


def synthetic_profile() -> LinkProfile:
    return LinkProfile.from_dict({
        "name": "synthetic", "locations": ["A", "B"],
        "same_location": {"latency_ms": 0.0, "bandwidth_GiBps": 100.0},
        "links": {"A-B": {"latency_ms": LATENCY_MS, "bandwidth_GiBps": BANDWIDTH_BPS / 2**30}},
    })


def message(index: int) -> ActivationMessage:
    mb = MicrobatchId(RUN, 0, 0, "data", index)
    frame = TensorFrame.from_tensor(torch.zeros(PAYLOAD_FLOATS))
    return ActivationMessage(mb, 1, ("data", "b", "data"), frame)


async def _pair(emulate: bool, receiver_emulates: bool | None = None):
    hivemind = import_hivemind()
    local = ["/ip4/127.0.0.1/tcp/0"]
    a = await hivemind.p2p.P2P.create(host_maddrs=local)
    b = await hivemind.p2p.P2P.create(host_maddrs=local, initial_peers=[str(m) for m in await a.get_visible_maddrs()])
    arrivals: list = []
    received = asyncio.Event()

    def on_b(msg, sender):
        arrivals.append((time.monotonic(), msg.mb.index))
        received.set()

    emulation = emulation_b = None
    if emulate:
        emulation = Emulation.for_node(profile=synthetic_profile(), location="A",
                                       peer_locations={str(b.peer_id): "B"})
    if emulate if receiver_emulates is None else receiver_emulates:
        emulation_b = Emulation.for_node(profile=synthetic_profile(), location="B",
                                         peer_locations={str(a.peer_id): "A"})
    plane_a = DataPlane(a, RUN, lambda m, s: None, emulator=emulation.link_emulator if emulation else None)
    plane_b = DataPlane(b, RUN, on_b, emulator=emulation_b.link_emulator if emulation_b else None)
    await plane_a.start()
    await plane_b.start()
    return a, b, plane_a, plane_b, arrivals


async def _close(*things):
    for t in things:
        if isinstance(t, DataPlane):
            await t.close()
    for t in things:
        if not isinstance(t, DataPlane):
            await t.shutdown()


async def _send_and_wait(plane_a, peer, msgs, arrivals, timeout_s=30.0):
    t0 = time.monotonic()
    await asyncio.gather(*(plane_a.send(peer, m) for m in msgs))
    deadline = time.monotonic() + timeout_s
    while len(arrivals) < len(msgs) and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    return t0


def test_message_is_not_delivered_before_latency_plus_serialisation():
    async def main():
        a, b, pa, pb, arrivals = await _pair(emulate=True)
        try:
            msg = message(0)
            t0 = await _send_and_wait(pa, str(b.peer_id), [msg], arrivals)
            assert len(arrivals) == 1
            bound = LATENCY_MS / 1000 + len(encode(msg)) / BANDWIDTH_BPS
            assert arrivals[0][0] - t0 >= bound - EARLY_WAKE_TOLERANCE_S
        finally:
            await _close(pa, pb, a, b)

    asyncio.run(main())


def test_two_concurrent_sends_to_one_peer_share_the_link():
    async def main():
        a, b, pa, pb, arrivals = await _pair(emulate=True)
        try:
            msgs = [message(0), message(1)]
            t0 = await _send_and_wait(pa, str(b.peer_id), msgs, arrivals)
            assert [i for _, i in arrivals] == [0, 1]  # order kept
            serialise = len(encode(msgs[0])) / BANDWIDTH_BPS
            # the second waits for the first's bytes: two serialisations + one latency
            assert arrivals[1][0] - t0 >= LATENCY_MS / 1000 + 2 * serialise - EARLY_WAKE_TOLERANCE_S
            assert pa.emulator.plan(str(b.peer_id), 0) > time.monotonic()  # link model saw both
        finally:
            await _close(pa, pb, a, b)

    asyncio.run(main())


def test_a_stamped_frame_is_held_until_its_delivery_time_and_sent_at_once():
    """The sender does not sleep on a hop message (its real transport overlaps the emulated delay);
    the receiver holds it until the stamped time, and a frame already past it counts as late."""
    async def main():
        a, b, pa, pb, arrivals = await _pair(emulate=True)
        try:
            peer = str(b.peer_id)

            async def no_sender_wait(*args):
                raise AssertionError("a hop message must not wait at the sender")

            pa.emulator.transmit = no_sender_wait
            t0 = time.monotonic()
            await pa.send(peer, message(0))
            deadline = time.monotonic() + 30
            while not arrivals and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            assert arrivals and arrivals[0][0] - t0 >= LATENCY_MS / 1000 - EARLY_WAKE_TOLERANCE_S
            assert pb.late_frames == 0
            # a frame stamped in the past is delivered at once and counted as late
            import dataclasses as dc

            await _send_raw(pa, peer, dc.replace(message(1), deliver_at_unix=time.time() - 5.0))
            deadline = time.monotonic() + 30
            while len(arrivals) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            assert [i for _, i in arrivals] == [0, 1]
            assert pb.late_frames == 1 and pb.late_s >= 5.0
        finally:
            await _close(pa, pb, a, b)

    asyncio.run(main())


async def _send_raw(plane: DataPlane, peer: str, msg) -> None:
    """Write ``msg`` exactly as given (its stamp untouched) on the plane's stream to ``peer``."""
    hivemind = import_hivemind()
    _, _, writer = await plane.p2p.call_binary_stream_handler(hivemind.p2p.PeerID.from_base58(peer), plane.name)
    await hivemind.p2p.P2P.send_raw_data(encode(msg), writer)
    writer.close()


def test_stamps_are_ignored_by_a_node_that_does_not_emulate_and_capped_by_one_that_does(monkeypatch):
    """A production node never holds a frame for a peer's say-so; an emulating one at most MAX_EMULATED_HOLD_S."""
    import dataclasses as dc

    import node.dataplane.transport as dataplane

    async def main(receiver_emulates: bool):
        a, b, pa, pb, arrivals = await _pair(emulate=True, receiver_emulates=receiver_emulates)
        try:
            far = dc.replace(message(0), deliver_at_unix=time.time() + 3600.0)
            await _send_raw(pa, str(b.peer_id), far)
            deadline = time.monotonic() + 30
            while not arrivals and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            assert [i for _, i in arrivals] == [0]  # not held for an hour
        finally:
            await _close(pa, pb, a, b)

    asyncio.run(main(False))
    monkeypatch.setattr(dataplane, "MAX_EMULATED_HOLD_S", 0.5)
    asyncio.run(main(True))


def test_without_emulation_the_data_plane_has_no_emulator_and_still_delivers():
    async def main():
        hivemind = import_hivemind()
        a = await hivemind.p2p.P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        default = DataPlane(a, RUN, lambda m, s: None)
        assert default.emulator is None
        await a.shutdown()
        a, b, pa, pb, arrivals = await _pair(emulate=False)
        try:
            assert pa.emulator is None and pb.emulator is None
            await _send_and_wait(pa, str(b.peer_id), [message(0), message(1)], arrivals)
            assert [i for _, i in arrivals] == [0, 1]
        finally:
            await _close(pa, pb, a, b)

    asyncio.run(main())


def test_unknown_location_is_not_emulated_and_bad_location_is_rejected():
    emu = Emulation.for_node(profile=synthetic_profile(), location="A", peer_locations={"p": "B"})
    assert emu.link_emulator.plan("stranger", 10**9) <= time.monotonic()
    assert emu.padder is None
    with pytest.raises(ValueError):
        Emulation.for_node(profile=synthetic_profile(), location="Mars", peer_locations={})
