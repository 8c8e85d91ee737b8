"""A replica whose groupmates went on without it gives its averaging round up instead of waiting.

Seen on `skippipe up` (2026-12-03): under load one data node's view briefly lost the other (a late
advert refresh), so it skipped the stage-0 round and went on, while the other waited hivemind's
whole 60 s matchmaking timeout for a group that could not form. Now a replica polls the
iteration's norm records while it matchmakes and abandons the round once every live groupmate has
published a record that does not name it.
"""

import asyncio
import contextlib
import logging

import pytest
import torch

from node.train.averaging import (ALLREDUCE_MIN_BANDWIDTH_BPS, MIN_ALLREDUCE_TIMEOUT_S, AveragingConfig, StageAverager,
                                  allreduce_timeout_for, groupmates_went_on)
from node.launch.inproc_swarm import InProcessSwarm
from node.launch.schedules import build_schedule
from node.compat import import_hivemind
from node.train.model import model_config
from node.train.runtime import OptimConfig
from node.train.trainer import TrainerConfig
from node.train.data import DataConfig

pytestmark = pytest.mark.timeout(240)

#: short windows (the test's own clock), and a round limit far above the tests' timeout: a round
#: that is not abandoned makes the test fail by timing out
QUICK = AveragingConfig(min_matchmaking_time_s=1.0, request_timeout_s=0.5, round_window_s=2.0,
                        matchmaking_timeout_s=900.0)
#: the trainer's defaults, but a round that is not abandoned outlives the test
NEVER = AveragingConfig(matchmaking_timeout_s=900.0)


# ---------------------------------------------------------------- the rule (pure)
def _alive(*dead):
    return lambda p: p not in dead


@pytest.mark.parametrize("records, dead, went_on", [
    ({}, (), False),                                                        # B has not published: maybe averaging with us
    ({"B": {"epoch": 1, "avg_group": []}}, (), True),                       # B skipped the round
    ({"B": {"epoch": 1, "avg_group": ["A", "B"]}}, (), True),               # a round with us whose result never came
    ({"B": {"epoch": 1}}, (), False),                                       # a record we cannot read never lets us go
    ({"B": {"epoch": 2, "avg_group": ["A", "B"]}}, (), True),               # another epoch: another group
    ({}, ("B",), True),                                                     # B is gone
])
def test_group_of_two(records, dead, went_on):
    assert groupmates_went_on("A", ["A", "B"], records, 1, _alive(*dead)) is went_on


def test_the_allreduce_limit_fits_the_stage():
    """A small stage gets the floor, a large one the time its traffic takes on a slow uplink, and a
    configured limit wins: a fixed minute made a skipped round cost every node a minute."""
    assert allreduce_timeout_for(1_000_000, AveragingConfig()) == MIN_ALLREDUCE_TIMEOUT_S
    big = 500 * 1_000_000
    assert allreduce_timeout_for(big, AveragingConfig()) > 100 * MIN_ALLREDUCE_TIMEOUT_S
    assert allreduce_timeout_for(big, AveragingConfig()) >= 2 * big / ALLREDUCE_MIN_BANDWIDTH_BPS
    assert allreduce_timeout_for(big, AveragingConfig(allreduce_timeout_s=7.0)) == 7.0


def test_group_of_three_needs_every_groupmate_gone_on():
    both = {"B": {"epoch": 1, "avg_group": ["B", "C"]}, "C": {"epoch": 1, "avg_group": ["B", "C"]}}
    assert groupmates_went_on("A", ["A", "B", "C"], both, 1, _alive())            # B and C averaged without A
    assert not groupmates_went_on("A", ["A", "B", "C"], {"B": both["B"]}, 1, _alive())  # C may still come
    assert groupmates_went_on("A", ["A", "B", "C"], {"B": both["B"]}, 1, _alive("C"))


# ---------------------------------------------------------------- real averagers on a real DHT
@contextlib.asynccontextmanager
async def two_replicas(prefix: str):
    """Two DHT peers on loopback and a started averager of one group of two on each:
    (first DHT, second DHT, its averager A, B)."""
    hivemind = import_hivemind()
    loop = asyncio.get_running_loop()
    first = await loop.run_in_executor(None, lambda: hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    maddrs = [str(m) for m in first.get_visible_maddrs()]
    second = await loop.run_in_executor(None, lambda: hivemind.DHT(
        start=True, initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    like = [torch.zeros(3)]
    a = StageAverager(first, like, prefix=prefix, group_size=2, cfg=QUICK)
    b = StageAverager(second, like, prefix=prefix, group_size=2, cfg=QUICK)
    try:
        await a.start()
        await b.start()
        yield first, second, a, b
    finally:
        for x in (a, b):
            await loop.run_in_executor(None, x.shutdown)
        for d in (second, first):
            await loop.run_in_executor(None, d.shutdown)


async def test_windows_meet_a_late_groupmate_and_an_abandoned_round_keeps_the_local_gradient(caplog):
    async with two_replicas("abandon_stage0_epoch0") as (first, second, a, b):
        # B starts two windows after A: A's first window ends without a group, a later one meets B
        checks = []

        async def not_yet() -> bool:
            checks.append(1)
            return False

        async def late(tensors):
            await asyncio.sleep(2 * QUICK.round_window_s)
            return await b.average(tensors, weight=1.0)

        ta, tb = [torch.full((3,), 1.0)], [torch.full((3,), 4.0)]
        ok = await asyncio.gather(a.average(ta, weight=2.0, abandon_when=not_yet), late(tb))
        assert ok == [True, True] and checks, "A must have needed more than one window"
        assert torch.allclose(ta[0], torch.full((3,), 2.0)) and torch.allclose(tb[0], ta[0])
        assert set(a.last_group) == set(b.last_group) == {str(first.peer_id), str(second.peer_id)}

        # B "went on": A is alone; the first check fails (a DHT read under load), the second
        # says so
        async def gone_on() -> bool:
            checks.append(1)
            if len(checks) == before + 1:
                raise TimeoutError("DHT read timed out")
            return len(checks) >= before + 2

        before = len(checks)
        mine = [torch.full((3,), 7.0)]
        with caplog.at_level(logging.WARNING, logger="node.train.averaging"):
            assert await a.average(mine, weight=1.0, abandon_when=gone_on) is False
        assert len(checks) == before + 2 and "abandoned" in caplog.text
        assert torch.equal(mine[0], torch.full((3,), 7.0)) and a.last_group == ()

        # nothing of the abandoned round is left behind: the next round of both completes
        ta, tb = [torch.full((3,), 3.0)], [torch.full((3,), 5.0)]
        ok = await asyncio.gather(a.average(ta, weight=1.0), b.average(tb, weight=1.0))
        assert ok == [True, True] and torch.allclose(ta[0], torch.full((3,), 4.0))


async def test_prepared_rounds_average_and_a_withdrawn_one_falls_back():
    """Matchmaking started at the iteration's start (prepare) is released by average with the
    gradients of then; a groupmate that withdraws its prepared round (it skipped averaging) makes the
    other fall back to the windowed rounds and give up when told the groupmate went on."""
    async with two_replicas("prepared_stage0_epoch0") as (first, second, a, b):
        for _ in range(2):  # two iterations in a row; a slow host gets 20 s to form the group
            a.prepare(expected_s=20.0)
            b.prepare(expected_s=20.0)
            await asyncio.sleep(2.0)  # the microbatches
            ta, tb = [torch.full((3,), 1.0)], [torch.full((3,), 4.0)]
            ok = await asyncio.gather(a.average(ta, weight=2.0), b.average(tb, weight=1.0))
            assert ok == [True, True]
            assert torch.allclose(ta[0], torch.full((3,), 2.0)) and torch.allclose(tb[0], ta[0])
        assert (a.prepared_ok, b.prepared_ok) == (2, 2) and (a.prepared_failed, b.prepared_failed) == (0, 0)

        a.prepare(expected_s=3.0)
        b.prepare(expected_s=3.0)
        await asyncio.sleep(1.0)
        b.cancel_prepared()  # B skips this round

        async def went_on() -> bool:
            return True

        mine = [torch.full((3,), 7.0)]
        assert await a.average(mine, weight=1.0, abandon_when=went_on) is False
        assert a.prepared_failed == 1 and torch.equal(mine[0], torch.full((3,), 7.0))

        # and the next prepared round of both works again
        a.prepare(expected_s=20.0)
        b.prepare(expected_s=20.0)
        ta, tb = [torch.full((3,), 3.0)], [torch.full((3,), 5.0)]
        ok = await asyncio.gather(a.average(ta, weight=1.0), b.average(tb, weight=1.0))
        assert ok == [True, True] and torch.allclose(ta[0], torch.full((3,), 4.0))


# ---------------------------------------------------------------- a swarm whose view flaps
async def test_view_flap_costs_a_resync_not_the_matchmaking_timeout(splits):
    """Data node 0 loses data node 1 from its view during iteration 1 (injected), so it skips the
    stage-0 round; data node 1 must give its round up, and both replicas agree again after the
    re-sync of the next iteration."""
    schedule = build_schedule(6, data_nodes=2, replicas=[1] * 5, path_length=6, microbatches=2, memory=2)
    cfg = TrainerConfig(run_id="flap", model=model_config("tiny"), optim=OptimConfig(lr=3e-3),
                        data=DataConfig(microbatch_size=4), averaging=NEVER)
    async with InProcessSwarm(schedule, cfg, splits) as swarm:
        node0, node1 = swarm.nodes[0], swarm.nodes[1]
        hidden = node1.peer_id
        node0.health.oracle = lambda p: swarm.is_alive(p) and not (p == hidden and node0.current_iteration == 1)
        await swarm.train(4)
        h0 = {s.iteration: s.averaged for s in node0.history}
        h1 = {s.iteration: s.averaged for s in node1.history}
        gap = max(float((p.detach() - q.detach()).abs().max()) for p, q in
                  zip(node0.runtime.module.parameters(), node1.runtime.module.parameters()))
    assert h0 == {0: True, 1: None, 2: True, 3: True}, h0
    assert h1 == {0: True, 1: False, 2: True, 3: True}, h1
    assert gap <= 1e-5, gap
