"""A receiver of stage state (a joiner, a re-syncing replica) runs no code from it and takes it only when
the stage's other replicas back it.

Real libp2p: every replica is its own hivemind ``P2P`` serving the real
:class:`~node.dataplane.state_transfer.StateServer`; the receiver calls the same
:func:`~node.dataplane.state_transfer.fetch_verified_state` the trainer's join and re-sync call, with
the tensors its own stage (a real ``tiny`` stage) expects. Hostile replicas serve a pickle whose
``__reduce__`` writes a marker file, all-zero weights, perturbed weights, or an oversized payload.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle

import pytest
import torch

import node.compat  # noqa: F401  (before hivemind)
from hivemind.p2p import P2P

from node.dataplane.state_codec import ExpectedState, encode_state, weights_digest, weights_sketch
from node.dataplane.state_transfer import (StateDisputed, StateServer, StateSnapshot, StateTransferError, fetch_state,
                                           fetch_verified_state)
from node.train.model import build_stage, model_config
from node.train.runtime import OptimConfig, StageRuntime

RUN = "verify"
STAGE = 1
ITERATION = 5
LOCAL = ["/ip4/127.0.0.1/tcp/0"]


def _trained_state(seed: int = 0) -> dict:
    """A stage-1 state after one optimizer step (weights and AdamW moments)."""
    rt = StageRuntime(build_stage(model_config("tiny", n_stages=3), STAGE, seed), OptimConfig())
    g = torch.Generator().manual_seed(seed + 1)
    for p in rt.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    rt.optimizer.step()
    return rt.state_dict()


def _receiver_expects() -> ExpectedState:
    return ExpectedState.of_module(build_stage(model_config("tiny", n_stages=3), STAGE, 7))


class _Marker:
    """Unpickling it creates the marker file: the code a hostile payload would run."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _replica(state: dict, served: dict | None = None, payload: bytes | None = None):
    """(snapshot, sketch) callbacks of a replica holding ``state``; it *serves* ``served`` (a hostile
    replica's other weights) or raw ``payload`` bytes instead, but sketches what it serves."""
    served = state if served is None else served

    async def snapshot(stage: int, min_iteration: int) -> StateSnapshot:
        if stage != STAGE:
            raise ValueError("not held here")
        blob = payload if payload is not None else encode_state(served, {"stage": STAGE, "iteration": ITERATION})
        return StateSnapshot(STAGE, ITERATION, 0.0, blob, weights_digest(served["model"]))

    async def sketch(stage: int, min_iteration: int, nonce: bytes):
        return ITERATION, weights_sketch(served["model"], nonce)

    return snapshot, sketch


@contextlib.asynccontextmanager
async def _swarm(replicas):
    """One P2P per replica serving its callbacks, and a receiver P2P connected to all; yields
    (receiver, [peer ids in the order given])."""
    hosts, servers = [], []
    try:
        for snapshot, sketch in replicas:
            p2p = await P2P.create(host_maddrs=LOCAL)
            hosts.append(p2p)
            server = StateServer(p2p, RUN, snapshot, sketch=sketch)
            await server.start()
            servers.append(server)
        maddrs = [str(m) for h in hosts for m in await h.get_visible_maddrs()]
        receiver = await P2P.create(host_maddrs=LOCAL, initial_peers=maddrs)
        hosts.append(receiver)
        yield receiver, [h.peer_id.to_base58() for h in hosts[:-1]]
    finally:
        for server in servers:
            await server.close()
        for h in hosts:
            with contextlib.suppress(Exception):
                await h.shutdown()


def _same_weights(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_pickle_served_as_state_runs_nothing_and_the_next_replica_is_used(tmp_path, caplog):
    marker = tmp_path / "pwned"
    honest = _trained_state()
    bomb = pickle.dumps({"model": {"w": _Marker(marker)}, "optimizer": {}})

    async def main():
        async with _swarm([_replica(honest, payload=bomb), _replica(honest)]) as (receiver, peers):
            with pytest.raises(StateTransferError, match="refused its state"):
                await fetch_state(receiver, RUN, peers[:1], STAGE, ITERATION, max_state_bytes=64 << 20,
                                  expected=_receiver_expects())
            return peers, *await fetch_verified_state(receiver, RUN, peers, STAGE, ITERATION,
                                                      expected=_receiver_expects())

    with caplog.at_level(logging.WARNING):
        peers, snap, verdict = asyncio.run(main())
    assert not marker.exists(), "the served pickle ran its code in the receiver"
    assert verdict.source == peers[1] and _same_weights(snap.state["model"], honest["model"])
    assert f"stage {STAGE} state from {peers[0][-8:]} refused" in caplog.text


@pytest.mark.parametrize("lie", ["zeros", "perturbed"])
def test_wrong_weights_are_refused_when_another_replica_disagrees(lie):
    honest = _trained_state()
    if lie == "zeros":
        wrong = {**honest, "model": {k: torch.zeros_like(v) for k, v in honest["model"].items()}}
    else:
        g = torch.Generator().manual_seed(3)
        wrong = {**honest, "model": {k: v + 0.05 * v.abs().mean() * torch.randn(v.shape, generator=g)
                                     for k, v in honest["model"].items()}}

    async def main():
        # the liar answers first; one honest replica disagrees: neither can win (one word against one)
        async with _swarm([_replica(wrong), _replica(honest)]) as (receiver, peers):
            # a dispute, told apart from "nobody answered": the joiner backs off instead of retrying at once
            with pytest.raises(StateDisputed, match="disputed"):
                await fetch_verified_state(receiver, RUN, peers, STAGE, ITERATION, expected=_receiver_expects())
        # two honest replicas: the liar is outvoted and the state comes from an honest one
        async with _swarm([_replica(wrong), _replica(honest), _replica(honest)]) as (receiver, peers):
            snap, verdict = await fetch_verified_state(receiver, RUN, peers, STAGE, ITERATION,
                                                       expected=_receiver_expects())
            return peers, snap, verdict

    peers, snap, verdict = asyncio.run(main())
    assert verdict.source in peers[1:] and verdict.disagree == [peers[0]] and len(verdict.agree) == 1
    assert _same_weights(snap.state["model"], honest["model"])


def test_a_liar_that_claims_the_honest_sketch_still_cannot_serve_other_weights():
    """The liar serves zeros but, asked to vouch, sketches the honest weights: its blob is still
    checked against the others', and its word backs only the honest blob."""
    honest = _trained_state()
    zeros = {**honest, "model": {k: torch.zeros_like(v) for k, v in honest["model"].items()}}
    serve_zeros, _ = _replica(zeros)
    _, sketch_honest = _replica(honest)

    async def main():
        async with _swarm([(serve_zeros, sketch_honest), _replica(honest)]) as (receiver, peers):
            return peers, *await fetch_verified_state(receiver, RUN, peers, STAGE, ITERATION,
                                                      expected=_receiver_expects())

    peers, snap, verdict = asyncio.run(main())
    assert verdict.source == peers[1] and _same_weights(snap.state["model"], honest["model"])


def test_a_lone_replica_is_trusted_with_a_warning_naming_it(caplog):
    honest = _trained_state()

    async def main():
        async with _swarm([_replica(honest)]) as (receiver, peers):
            return peers, *await fetch_verified_state(receiver, RUN, peers, STAGE, ITERATION,
                                                      expected=_receiver_expects())

    with caplog.at_level(logging.WARNING):
        peers, snap, verdict = asyncio.run(main())
    assert verdict.alone and verdict.source == peers[0]
    assert f"taken from {peers[0]} on its word alone" in caplog.text


def test_state_of_another_shape_or_beyond_the_stage_size_is_refused():
    honest = _trained_state()
    other_stage = StageRuntime(build_stage(model_config("tiny", n_stages=3), 0, 0), OptimConfig()).state_dict()
    oversized = encode_state(honest, {"stage": STAGE, "iteration": ITERATION}) + bytes(_receiver_expects().max_bytes())

    async def main():
        async with _swarm([_replica(honest, served=other_stage), _replica(honest, payload=oversized)]) as (
                receiver, peers):
            with pytest.raises(StateTransferError) as info:
                await fetch_state(receiver, RUN, peers, STAGE, ITERATION,
                                  max_state_bytes=_receiver_expects().max_bytes(), expected=_receiver_expects())
            return str(info.value)

    text = asyncio.run(main())
    assert "model tensors differ" in text and "FrameTooLarge" in text, text


def test_signed_claims_count_and_a_forged_claim_naming_an_honest_replica_does_not(tmp_path):
    """Replicas store their claims owner-signed in the DHT; the liar also stores, under a plain subkey,
    a claim in the honest replica's name that backs its own zero weights. The verifier reads the DHT:
    the forgery is ignored (it cannot sign for that key), so the liar's state is still refused."""
    from types import SimpleNamespace

    from node.net.access import SwarmAccess
    from node.net.identity import load_or_create_identity
    from node.net.records import StateClaimRecord, sign_records, state_claim_key, write_state_claim
    from node.swarm.adverts import make_record_validators

    honest = _trained_state()
    zeros = {**honest, "model": {k: torch.zeros_like(v) for k, v in honest["model"].items()}}
    paths = [tmp_path / f"id{i}.key" for i in range(3)]
    ids = [load_or_create_identity(p) for p in paths]
    data: dict = {}

    class SharedDHT:
        async def store(self, key, value, expiration_time, subkey, return_future=True):
            data.setdefault(key, {})[subkey] = SimpleNamespace(value=value, expiration_time=expiration_time)
            return True

        async def get(self, key, latest=True, return_future=True):
            return SimpleNamespace(value=dict(data[key])) if key in data else None

    dhts = []
    for identity in ids:
        dht = SharedDHT()
        sign_records(dht, make_record_validators(identity.private_key)[0].local_public_key, SwarmAccess())
        dhts.append(dht)
    liar_id, honest_id = (i.peer_id.to_base58() for i in ids[:2])

    def replica(i, served, forge=False):
        snapshot, _ = _replica(served)

        async def sketch(stage, min_iteration, nonce):
            mine = weights_sketch(served["model"], nonce)
            await write_state_claim(dhts[i], RUN, "", nonce, StateClaimRecord(STAGE, ITERATION, tuple(mine)))
            if forge:  # a plain-subkey record naming the honest replica, backing the zeros
                data[state_claim_key(RUN, STAGE, nonce)][honest_id] = SimpleNamespace(
                    value=StateClaimRecord(STAGE, ITERATION, tuple(mine)).to_dict(), expiration_time=0.0)
            return ITERATION, mine

        return snapshot, sketch

    async def main():
        hosts = []
        try:
            for i, served, forge in ((0, zeros, True), (1, honest, False)):
                p2p = await P2P.create(host_maddrs=LOCAL, identity_path=str(paths[i]))
                hosts.append(p2p)
                snapshot, sketch = replica(i, served, forge)
                await StateServer(p2p, RUN, snapshot, sketch=sketch).start()
            maddrs = [str(m) for h in hosts for m in await h.get_visible_maddrs()]
            receiver = await P2P.create(host_maddrs=LOCAL, initial_peers=maddrs, identity_path=str(paths[2]))
            hosts.append(receiver)
            peers = [liar_id, honest_id]
            with pytest.raises(StateTransferError, match="disputed"):
                await fetch_verified_state(receiver, RUN, peers, STAGE, ITERATION, expected=_receiver_expects(),
                                           dht=dhts[2])
        finally:
            for h in hosts:
                with contextlib.suppress(Exception):
                    await h.shutdown()

    asyncio.run(main())
    from node.net.records import rejected_counts

    assert rejected_counts(dhts[2]).get("not under an owner subkey", 0) >= 1


def test_a_non_member_is_served_at_a_bounded_rate_a_vouched_candidate_more_often(monkeypatch):
    """A requester that is no epoch member gets the state at most once per OUTSIDER_FETCH_EVERY_S (an export),
    or once per CANDIDATE_FETCH_EVERY_S once admission vouches for it (a candidate taking its proof state);
    members are served as always."""
    from node.dataplane import state_transfer as st

    monkeypatch.setattr(st, "OUTSIDER_FETCH_EVERY_S", 3600.0)
    monkeypatch.setattr(st, "CANDIDATE_FETCH_EVERY_S", 0.0)
    honest = _trained_state()
    snapshot, sketch = _replica(honest)
    vouched: set = set()

    async def vouch(peer: str) -> bool:
        return peer in vouched

    async def main():
        server_p2p = await P2P.create(host_maddrs=LOCAL)
        member = set()
        server = StateServer(server_p2p, RUN, snapshot, sketch=sketch, member=lambda p: p in member, vouch=vouch)
        await server.start()
        receiver = await P2P.create(host_maddrs=LOCAL, initial_peers=[str(m) for m in await server_p2p.get_visible_maddrs()])
        me, peers = receiver.peer_id.to_base58(), [server_p2p.peer_id.to_base58()]

        async def fetch():
            return (await fetch_state(receiver, RUN, peers, STAGE, ITERATION, max_state_bytes=64 << 20,
                                      expected=_receiver_expects()))[1]
        try:
            got = [await fetch()]  # an outsider: once
            with pytest.raises(StateTransferError, match="one state download per 3600 s"):
                await fetch()
            vouched.add(me)  # a candidate admission vouches for: at its own interval
            got += [await fetch(), await fetch()]
            member.add(me)
            vouched.clear()
            got += [await fetch(), await fetch()]  # a member is not limited
            return got
        finally:
            await server.close()
            for h in (receiver, server_p2p):
                with contextlib.suppress(Exception):
                    await h.shutdown()

    for snap in asyncio.run(main()):
        assert _same_weights(snap.state["model"], honest["model"])
