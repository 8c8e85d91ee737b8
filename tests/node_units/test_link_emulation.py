"""Link emulation: per-link serialisation and latency, on a fake clock (pure unit)."""

import asyncio

import pytest

from node.dataplane.emulation import ComputePadder, LinkEmulator, LinkSpec


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.slept = []

    def __call__(self):
        return self.now

    async def sleep(self, s):
        self.slept.append(s)
        self.now += s


def make(links):
    clock = FakeClock()
    return LinkEmulator(links.get, clock=clock, sleep=clock.sleep), clock


def test_single_message_is_latency_plus_serialisation():
    emu, clock = make({"b": LinkSpec(latency_s=0.1, bandwidth_Bps=1000.0)})
    delay = asyncio.run(emu.transmit("b", 500))
    assert delay == pytest.approx(0.1 + 0.5)


def test_concurrent_sends_share_the_link_bandwidth():
    emu, clock = make({"b": LinkSpec(latency_s=0.1, bandwidth_Bps=1000.0)})
    first = emu.plan("b", 1000)
    second = emu.plan("b", 1000)  # queued behind the first on the same link
    assert first == pytest.approx(1.1)
    assert second == pytest.approx(2.1)


def test_links_to_different_peers_are_independent():
    emu, clock = make({"b": LinkSpec(0.0, 100.0), "c": LinkSpec(0.0, 100.0)})
    assert emu.plan("b", 100) == pytest.approx(1.0)
    assert emu.plan("c", 100) == pytest.approx(1.0)


def test_link_frees_up_after_idle_time():
    emu, clock = make({"b": LinkSpec(0.0, 100.0)})
    emu.plan("b", 100)
    clock.now = 5.0
    assert emu.plan("b", 100) == pytest.approx(6.0)


def test_unknown_peer_is_not_delayed():
    emu, clock = make({})
    assert asyncio.run(emu.transmit("x", 10**9)) == 0.0
    assert clock.slept == []


def test_invalid_links_are_rejected():
    with pytest.raises(ValueError):
        LinkSpec(-1.0, 1.0)
    with pytest.raises(ValueError):
        LinkSpec(0.0, 0.0)


def test_compute_padder_pads_to_target_and_never_negative():
    clock = FakeClock()
    pad = ComputePadder(0.01, sleep=clock.sleep, clock=clock)
    assert pad.target_s("backward", samples=8, layers=4) == pytest.approx(0.01 * 8 * 4 * 1.5)
    slept = asyncio.run(pad.pad("forward", started_at=0.0, samples=2, layers=5))
    assert slept == pytest.approx(0.1)
    clock.now = 10.0
    assert asyncio.run(pad.pad("loss", started_at=0.0, samples=1, layers=1)) == 0.0


def test_delivery_stamp_is_the_plan_on_the_unix_clock_and_reserves_the_link():
    clock = FakeClock()
    emu = LinkEmulator({"b": LinkSpec(latency_s=0.1, bandwidth_Bps=1000.0)}.get, clock=clock, sleep=clock.sleep,
                       wall_clock=lambda: 1000.0 + clock.now)
    assert emu.deliver_at_unix("b", 500) == pytest.approx(1000.0 + 0.5 + 0.1)
    assert emu.deliver_at_unix("b", 500) == pytest.approx(1000.0 + 1.0 + 0.1)  # queued behind the first
    assert emu.deliver_at_unix("stranger", 500) is None
    assert clock.slept == []  # stamping never waits


def test_compute_padder_counts_overruns_instead_of_hiding_them():
    clock = FakeClock()
    pad = ComputePadder(0.01, sleep=clock.sleep, clock=clock)
    asyncio.run(pad.pad("forward", started_at=0.0, samples=2, layers=5))  # target 0.1, on time
    assert (pad.steps, pad.overruns, pad.overrun_s) == (1, 0, 0.0)
    clock.now = 10.0
    asyncio.run(pad.pad("forward", started_at=9.5, samples=2, layers=5))  # 0.5 s of work, target 0.1
    assert (pad.steps, pad.overruns) == (2, 1)
    assert pad.overrun_s == pytest.approx(0.4)
