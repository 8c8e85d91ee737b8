"""The event loop stays responsive while 64 MiB frames cross the data plane between two real peers.

Two hivemind peers on 127.0.0.1 in this process share one event loop, as a daemon's data plane, DHT
and RPCs do. The sender sends float32 activation frames of 64 MiB (twice the ``500m`` model's
microbatch of 8 x 1024 tokens) to a receiver with a guard (decode, shape and finiteness checks); a
:class:`node.ops.looplag.LoopLagProbe` on the same loop measures the most CPU time the loop's thread
spent between two of its wake-ups (its wall-clock lateness is printed too, but on a loaded machine
it mostly measures other processes). Joining, copying, decoding and checking such a frame each
take tens of milliseconds: on the loop in one stretch, the probe sees them add up; done in a worker
thread or a megabyte at a time, it sees only pieces.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

import node.compat  # noqa: F401  (before hivemind)
from node.compat import import_hivemind
from node.dataplane.guard import MicrobatchGuard
from node.dataplane.transport import DataPlane
from node.ops.looplag import LoopLagProbe
from protocol.tensor import TensorFrame
from tests.node.hostile_peer import LOCAL, activation

pytestmark = pytest.mark.timeout(300)

RUN = "loop-lag-test"
#: float32 activations of d_model 1024 for 16 x 1024 tokens: 64 MiB, so that one frame's passes on the loop
#: add up to well above the bound even on a fast machine (~100 ms measured on a loaded one, ~50 ms per 32 MiB)
FRAME_SHAPE = (16, 1024, 1024)
FRAMES = 4
#: The most CPU time the loop's thread may spend between two probe wake-ups while the frames cross.
#: Measured on a 2-core box at load 8-12: 13-16 ms with the work off the loop (the socket reads and
#: writes stay there, a megabyte at a time), 110-120 ms with a frame decoded and checked on the loop.
MAX_LOOP_BLOCK_S = 0.05
#: Probe period: short, so a block shows up at about its true length.
PROBE_INTERVAL_S = 0.005
WAIT_S = 120.0
#: index of the frame that opens the stream before measuring
WARM_UP = 1000


async def _exchange():
    hivemind = import_hivemind()
    rx_p2p = await hivemind.p2p.P2P.create(host_maddrs=LOCAL)
    initial = [str(m) for m in await rx_p2p.get_visible_maddrs()]
    tx_p2p = await hivemind.p2p.P2P.create(host_maddrs=LOCAL, initial_peers=initial)
    rx_id, tx_id = str(rx_p2p.peer_id), str(tx_p2p.peer_id)
    got = []
    guard = MicrobatchGuard(run_id=RUN, hidden_shape=FRAME_SHAPE, position=lambda: (0, 0), self_id=rx_id)
    receiver = DataPlane(rx_p2p, RUN, lambda m, s: got.append(m.mb.index), guard=guard, frame_rate_per_s=None)
    sender = DataPlane(tx_p2p, RUN, lambda m, s: None)
    probe = LoopLagProbe(interval_s=PROBE_INTERVAL_S)
    try:
        await receiver.start()
        tensor = torch.randn(FRAME_SHAPE)
        frames = await asyncio.to_thread(lambda: [TensorFrame.from_tensor(tensor + i) for i in range(FRAMES)])
        msgs = [activation(RUN, (tx_id, rx_id, tx_id), 1, f, index=i) for i, f in enumerate(frames)]
        del frames
        # the stream is opened (and the probe started) with a small frame first: connection set-up is not measured
        await sender.send(rx_id, activation(RUN, (tx_id, rx_id, tx_id), 1, TensorFrame.from_tensor(
            torch.zeros(FRAME_SHAPE)), index=WARM_UP))
        deadline = time.monotonic() + WAIT_S
        while WARM_UP not in got and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        probe.start()
        await asyncio.sleep(0.1)
        for msg in msgs:
            await sender.send(rx_id, msg)
        # a poisoned large frame: refused all the same, by the checks that now run in a worker thread
        bad = await asyncio.to_thread(lambda: TensorFrame.from_tensor(torch.full(FRAME_SHAPE, float("nan"))))
        await sender.send(rx_id, activation(RUN, (tx_id, rx_id, tx_id), 1, bad, index=FRAMES))
        del bad
        while (len(got) < FRAMES + 1 or not receiver.rejected) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
    finally:
        await probe.stop()
        await sender.close()
        await receiver.close()
        for p in (tx_p2p, rx_p2p):
            try:
                await asyncio.wait_for(p.shutdown(), 30)
            except Exception:  # noqa: BLE001
                pass
    return got, probe, receiver


def test_32_mib_frames_do_not_block_the_event_loop():
    got, probe, receiver = asyncio.run(_exchange())
    assert sorted(got) == [*range(FRAMES), WARM_UP], (got, dict(receiver.rejected))
    assert dict(receiver.rejected) == {"non_finite": 1}
    assert probe.samples > 0
    print(f"loop lag max {probe.max_s * 1000:.1f} ms, busy max {probe.busy_max_s * 1000:.1f} ms "
          f"over {probe.samples} samples")
    assert probe.busy_max_s <= MAX_LOOP_BLOCK_S, f"the event loop was busy for {probe.busy_max_s * 1000:.0f} ms"


def test_the_probe_sees_work_that_holds_the_loop():
    """Negative control: CPU work done on the loop shows up in ``busy_max_s`` at (at least) its length."""

    async def main():
        probe = LoopLagProbe(interval_s=PROBE_INTERVAL_S).start()
        await asyncio.sleep(0.05)
        end = time.thread_time() + 2 * MAX_LOOP_BLOCK_S
        while time.thread_time() < end:  # a computation that never yields
            pass
        await asyncio.sleep(0.05)
        await probe.stop()
        return probe

    probe = asyncio.run(main())
    # the probe's last wake-up comes a little before the work starts, so it reads a little less than the
    # work's length; what matters is that a block of twice the bound reads well above the bound
    assert probe.busy_max_s >= 1.5 * MAX_LOOP_BLOCK_S and probe.max_s >= 1.5 * MAX_LOOP_BLOCK_S


def _hold_the_loop_for(cpu_seconds: float) -> None:
    end = time.thread_time() + cpu_seconds
    while time.thread_time() < end:  # never yields
        pass


def test_a_stall_is_reported_once_with_the_call_that_held_the_loop_and_idle_time_is_not(caplog):
    """A loop held for longer than the report threshold gets one warning naming the blocking call; the same
    time spent idle (awaiting) gets none."""

    async def main():
        probe = LoopLagProbe(interval_s=PROBE_INTERVAL_S)
        probe.stall_report_s = 0.3
        probe.start()
        await asyncio.sleep(1.0)  # idle: no report
        idle_reports = probe.stalls_reported
        _hold_the_loop_for(1.2)  # one stall, reported once however long it lasts
        await asyncio.sleep(0.2)
        await probe.stop()
        return probe, idle_reports

    with caplog.at_level("WARNING", logger="node.ops.looplag"):
        probe, idle_reports = asyncio.run(main())
    assert idle_reports == 0
    assert probe.stalls_reported == 1, caplog.text
    assert "event loop blocked" in caplog.text and "_hold_the_loop_for" in caplog.text, caplog.text
