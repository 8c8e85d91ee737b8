"""Two replicas behind NAT and a public one of the same stage average together, through the public one.

Real hivemind averagers on real DHTs (loopback), built by :func:`node.train.build.rebuild_averager` from each
replica's reachability: the public replica P as a normal peer, the NATed A and B (each unreachable to the
other) in client mode, so the all-reduce needs no connection into A or B (a client-mode averager serves
no all-reduce part at all). All three must come out with the same weighted mean; a stage of only NATed
replicas gets no averager (nobody to wait for) unless a reducer serves it: then both average in client mode
through the reducer's auxiliary averager, which contributes nothing to the mean.
"""

import asyncio
import contextlib
from types import SimpleNamespace
from typing import AsyncIterator

import pytest
import torch

from node.compat import import_hivemind
from node.train.averaging import AveragingConfig
from node.train.build import rebuild_averager

pytestmark = pytest.mark.timeout(240)

#: short windows; a round that finds no group fails after 60 s (returns False), far more than a loopback
#: group of three needs, so the test fails instead of hanging
QUICK = AveragingConfig(min_matchmaking_time_s=1.0, request_timeout_s=0.5, round_window_s=2.0,
                        matchmaking_timeout_s=60.0)


def _inputs(me: str, replicas):
    """What rebuild_averager reads: the run id and averaging config, this replica's epoch view, its gradients."""
    cfg = SimpleNamespace(run_id="natavg", averaging=QUICK)
    epochs = SimpleNamespace(peer_id=me, stage=1, epoch=SimpleNamespace(epoch=1), replicas=lambda stage: list(replicas))
    runtime = SimpleNamespace(grads=lambda: [torch.zeros(3)])
    return cfg, epochs, runtime


@contextlib.asynccontextmanager
async def dhts(n: int):
    hivemind = import_hivemind()
    loop = asyncio.get_running_loop()
    first = await loop.run_in_executor(None, lambda: hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    maddrs = [str(m) for m in first.get_visible_maddrs()]
    out = [first]
    try:
        for _ in range(n - 1):
            out.append(await loop.run_in_executor(None, lambda: hivemind.DHT(
                start=True, initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])))
        yield out
    finally:
        for d in reversed(out):
            await loop.run_in_executor(None, d.shutdown)


async def _stop(serving, averagers) -> None:
    """Cancel the reducer's task and shut every averager down (blocking calls, in an executor)."""
    if serving is not None:
        serving.cancel()
    for x in averagers:
        if x is not None:
            await asyncio.get_running_loop().run_in_executor(None, x.shutdown)


async def test_natted_replicas_average_through_the_public_one_in_client_mode():
    replicas = ["A", "B", "P"]
    reaches = {"A": {"P": True, "B": False}, "B": {"P": True, "A": False}, "P": {"A": True, "B": True}}
    loop = asyncio.get_running_loop()
    async with dhts(3) as (dp, da, db):
        built = {}
        try:
            for name, dht in (("P", dp), ("A", da), ("B", db)):
                cfg, epochs, runtime = _inputs(name, replicas)
                built[name] = await rebuild_averager(None, dht, runtime, cfg, epochs, reaches[name].get)
            p, a, b = built["P"], built["A"], built["B"]
            assert (p._avg.client_mode, a._avg.client_mode, b._avg.client_mode) == (False, True, True)
            # a stage whose only other replica is behind NAT like us: no averager, so no round to wait out
            cfg, epochs, runtime = _inputs("A", ["A", "B"])
            assert await rebuild_averager(None, da, runtime, cfg, epochs, reaches["A"].get) is None

            tp, ta, tb = [torch.full((3,), 1.0)], [torch.full((3,), 4.0)], [torch.full((3,), 7.0)]
            ok = await asyncio.gather(p.average(tp, weight=1.0), a.average(ta, weight=1.0), b.average(tb, weight=2.0))
            assert ok == [True, True, True]
            mean = (1.0 + 4.0 + 2 * 7.0) / 4
            for t in (tp, ta, tb):
                assert torch.allclose(t[0], torch.full((3,), mean)), (tp, ta, tb)
            assert len(set(a.last_group)) == len(set(b.last_group)) == 3  # one group of all three, through P
        finally:
            for x in built.values():
                if x is not None:
                    await loop.run_in_executor(None, x.shutdown)


async def test_natted_replicas_of_a_stage_nobody_can_dial_average_through_an_auxiliary_reducer():
    """Stage 1 held only by NATed A and B; R (dialable, another stage) reduces for them (node.train.reducer)."""
    from node.train.averaging import StageAverager, averager_prefix

    reaches = {"A": {"B": False, "R": True}, "B": {"A": False, "R": True}}
    loop = asyncio.get_running_loop()
    async with dhts(3) as (dr, da, db):
        built, reducer, serving = {}, None, None
        try:
            for name, dht in (("A", da), ("B", db)):
                cfg, epochs, runtime = _inputs(name, ["A", "B"])
                built[name] = await rebuild_averager(None, dht, runtime, cfg, epochs, reaches[name].get, reducer="R")
            a, b = built["A"], built["B"]
            assert (a._avg.client_mode, b._avg.client_mode) == (True, True) and a.group_size == 3
            assert not a.cfg.prepare_early  # the reducer would start its all-reduce before the gradients exist
            reducer = StageAverager(dr, [torch.zeros(3)], prefix=averager_prefix("natavg", 1, 1), group_size=3,
                                    cfg=QUICK, auxiliary=True, replicas=("A", "B"), reducer="R")
            await reducer.start()

            async def serve():
                while not await reducer.assist():
                    pass

            serving = asyncio.create_task(serve())
            ta, tb = [torch.full((3,), 4.0)], [torch.full((3,), 7.0)]
            ok = await asyncio.gather(a.average(ta, weight=1.0), b.average(tb, weight=2.0))
            assert ok == [True, True]
            mean = (4.0 + 2 * 7.0) / 3  # the reducer contributes nothing
            for t in (ta, tb):
                assert torch.allclose(t[0], torch.full((3,), mean)), (ta, tb)
            await asyncio.wait_for(serving, 30)
            assert len(set(a.last_group)) == len(set(reducer.last_group)) == 3
        finally:
            await _stop(serving, [*built.values(), reducer])


async def test_a_round_whose_results_did_not_all_come_back_fails_instead_of_keeping_local_parts(monkeypatch):
    """hivemind keeps a peer's own values for the parts whose reducer failed mid-round and calls the round a
    success; two replicas then step on different gradients. Here the reducer R sends A only the first of its
    averaged parts (B gets them all): A's round must fail, its gradient stay its own, and B hold the mean."""
    import node.train.averaging as averaging
    from node.train.averaging import StageAverager, averager_prefix

    import_hivemind()
    from hivemind.proto import averaging_pb2
    size = 400_000  # float32: 1.6 MB, several all-reduce parts
    reaches = {"A": {"B": False, "R": True}, "B": {"A": False, "R": True}}
    loop = asyncio.get_running_loop()
    async with dhts(3) as (dr, da, db):
        victim = da.peer_id.to_base58()

        class CutShort(averaging.whole_round_averager()):
            """A reducer whose answers to A stop after the first part (a stream that broke on the way)."""

            async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                         context) -> AsyncIterator[averaging_pb2.AveragingData]:
                sent = 0
                async for msg in super().rpc_aggregate_part(stream, context):
                    if context.remote_id.to_base58() == victim and sent >= 1:
                        continue
                    sent += 1
                    yield msg

        built, reducer, serving = {}, None, None
        try:
            for name, dht in (("A", da), ("B", db)):
                cfg, epochs, runtime = _inputs(name, ["A", "B"])
                runtime.grads = lambda: [torch.zeros(size)]
                built[name] = await rebuild_averager(None, dht, runtime, cfg, epochs, reaches[name].get, reducer="R")
            a, b = built["A"], built["B"]
            with monkeypatch.context() as patch:
                patch.setattr(averaging, "whole_round_averager", lambda: CutShort)
                reducer = StageAverager(dr, [torch.zeros(size)], prefix=averager_prefix("natavg", 1, 1), group_size=3,
                                        cfg=QUICK, auxiliary=True, replicas=("A", "B"), reducer="R")
            await reducer.start()

            async def serve():
                while True:
                    await reducer.assist()

            serving = asyncio.create_task(serve())
            ta, tb = [torch.full((size,), 4.0)], [torch.full((size,), 7.0)]

            async def gone_on():  # B's record would name the round: A gives up after its failed window
                return True

            ok = await asyncio.gather(a.average(ta, weight=1.0, abandon_when=gone_on), b.average(tb, weight=2.0))
            assert ok == [False, True], (ok, ta[0][:3], ta[0][-3:])
            assert torch.equal(ta[0], torch.full((size,), 4.0))  # not half averaged: its own gradient
            assert torch.allclose(tb[0], torch.full((size,), (4.0 + 2 * 7.0) / 3))
        finally:
            await _stop(serving, [*built.values(), reducer])
