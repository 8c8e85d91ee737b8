"""A hostile peer sends garbage to every node's data plane for 30 s while a small swarm trains.

In-process harness (:class:`node.launch.inproc_swarm.InProcessSwarm`: real hivemind P2P and DHT per node, real
torch): 3 stages, one node each, full-length paths. An extra hivemind peer, connected to every
node but not a member, writes to each node's data-plane handler, round after round, random bytes,
broken msgpack, a length header promising a terabyte, and activations that look valid but carry
NaN, a wrong shape, an old schedule epoch, or an id it already sent (a replay; refused as
``not_member`` like any fresh frame of an outsider). Half-way through,
the swarm switches to schedule epoch 1 (same allocation), so that epoch-0 frames become out of epoch.

The run must not notice: every node commits every iteration, in order; the loss stays finite
and ends lower than it started; and the nodes' data planes did refuse the garbage (each kind
is counted under its reason). No timing assertion: training simply goes on until the 30 s of
garbage are over (at least ``MIN_ITERATIONS``); a hang fails through the timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import random
import time

import pytest

from node.launch.inproc_swarm import InProcessSwarm
from node.launch.schedules import build_schedule
from node.train.data import DataConfig
from node.train.model import model_config
from node.train.runtime import OptimConfig
from node.train.trainer import TrainerConfig
from protocol import encode
from tests.node.hostile_peer import HostilePeer, activation, connect, frame, malformed_msgpack, random_bytes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

#: How long the hostile peer keeps sending garbage.
GARBAGE_S = 30.0
#: Seconds between two rounds of garbage (each round: every kind, to every node).
ROUND_PAUSE_S = 0.1
#: Iterations trained at least; the swarm switches to epoch 1 at iteration EPOCH_SWITCH_AT.
MIN_ITERATIONS = 6
EPOCH_SWITCH_AT = 3
#: Most iterations trained while waiting for the garbage to end (a very fast machine stops here).
MAX_ITERATIONS = 400
#: Reasons that must have been counted on the nodes. The hostile peer is no member, so a fresh
#: well-formed frame (the first copy of a replayed pair) is refused as ``not_member`` and never
#: remembered; replays of a member's frames are covered in tests/node/test_dataplane_guard.py.
EXPECTED_REASONS = {"undecodable", "oversized", "non_finite", "wrong_shape", "not_member", "out_of_epoch"}
SCHEDULE = build_schedule(3, data_nodes=1, replicas=[1, 1], path_length=3, microbatches=2, memory=2)


@pytest.fixture(scope="module")
def splits(_cache_dir):
    from node.train.data import load_splits

    return load_splits(DataConfig())


def _config(run_id: str) -> TrainerConfig:
    return TrainerConfig(run_id=run_id, model=model_config("tiny", n_stages=3), optim=OptimConfig(lr=3e-3),
                         data=DataConfig(microbatch_size=4))


async def _garbage(hostile: HostilePeer, nodes, hidden_shape, stop_at: float) -> int:
    """Rounds of every kind of garbage to every node until ``stop_at`` (monotonic); returns rounds sent."""
    rng = random.Random(8)
    run, me = hostile.run_id, hostile.peer_id
    rounds, index = 0, 10**6  # fake microbatch indices far from the real ones
    while time.monotonic() < stop_at:
        for n in nodes:
            target = n.peer_id
            epoch, it = n.epoch.epoch, n.current_iteration
            route = (me, target, me)

            def act(fill, shape=hidden_shape, epoch=epoch):
                nonlocal index
                index += 1
                return activation(run, route, 1, frame(shape, fill), epoch=epoch, iteration=it, index=index)

            replay = encode(act(0.1))
            frames = [
                random_bytes(rng),
                malformed_msgpack(rng, replay),
                encode(act(math.nan)),
                encode(act(math.inf)),
                encode(act(0.1, shape=(hidden_shape[0], hidden_shape[1] + 1, hidden_shape[2]))),
                replay,
                replay,  # the second copy is the replay
            ]
            if epoch > 0:
                frames.append(encode(act(0.1, epoch=epoch - 1)))
            for data in frames:
                await hostile.send(target, data)
            if rounds % 25 == 0:
                await hostile.send_length_header(target, 1 << 40)
        rounds += 1
        await asyncio.sleep(ROUND_PAUSE_S)
    return rounds


async def test_training_goes_on_while_a_peer_sends_garbage_for_30_seconds(splits, caplog):
    caplog.set_level(logging.WARNING, logger="node.dataplane.transport")
    cfg = _config("hostile-garbage")
    async with InProcessSwarm(SCHEDULE, cfg, splits) as swarm:
        nodes = swarm.nodes
        assert all(n.dataplane.guard is not None for n in nodes), "the trainer built no MicrobatchGuard"
        hostile = await HostilePeer.create(cfg.run_id)
        try:
            await connect(hostile.p2p, swarm.p2ps)
            hidden = (cfg.data.microbatch_size, cfg.data.seq_len, cfg.model.d_model)
            garbage = asyncio.create_task(_garbage(hostile, nodes, hidden, time.monotonic() + GARBAGE_S))
            try:
                await swarm.train(EPOCH_SWITCH_AT)
                # epoch 1 from the next boundary: the same schedule, a new number
                swarm.epoch = dataclasses.replace(swarm.epoch, epoch=1, start_iteration=EPOCH_SWITCH_AT)
                target = MIN_ITERATIONS
                await swarm.train(target)
                while not garbage.done() and target < MAX_ITERATIONS:
                    target += 1
                    await swarm.train(target)
                rounds = await garbage
            finally:
                garbage.cancel()
                await asyncio.gather(garbage, return_exceptions=True)
            histories = {n.node_name: [s.iteration for s in n.history] for n in nodes}
            losses = [s.loss for s in nodes[0].history]
            epochs = {n.node_name: n.epoch.epoch for n in nodes}
            rejected = {n.node_name: dict(n.dataplane.rejected) for n in nodes}
            sent = hostile.sent
            hostile_id = hostile.peer_id
        finally:
            await hostile.close()
    assert rounds > 0 and sent > 0
    assert all(h == list(range(target)) for h in histories.values()), histories
    assert set(epochs.values()) == {1}, epochs
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    for name, counts in rejected.items():
        assert sum(counts.values()) > 0, (name, counts)
        assert EXPECTED_REASONS <= set(counts), (name, counts)
    # the first refusal per (peer, reason) is always logged: no honest member's frame was ever refused
    refused = [r.getMessage() for r in caplog.records if "refused frame from" in r.getMessage()]
    assert refused and all(f"refused frame from {hostile_id[-8:]}:" in m for m in refused), refused[:5]
