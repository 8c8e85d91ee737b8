"""Stage state from a replica nobody can dial, through a relay: piped untouched, and taken only when the
source's own signed sketch (in the DHT, which the relay cannot forge) matches what came through.

Real libp2p on loopback, one process: a holder serving the real :class:`StateServer` (its sketch answers also
store a signed claim in a shared DHT stand-in, as the trainer's do), a relay running the real
:class:`RelayServer`, and a receiver that reaches the holder only through it (``via``). A hostile relay
answers in the holder's name with other weights of the right shapes and a sketch that matches them.
"""

from __future__ import annotations

import asyncio
import contextlib

import msgpack
import pytest
import torch

import node.compat  # noqa: F401  (before hivemind)
from hivemind.p2p import P2P
from multiaddr import Multiaddr

from node.dataplane.relay import NO_ROUTE, RelayServer
from node.dataplane.state_codec import encode_state, weights_digest, weights_sketch
from node.dataplane.state_transfer import (StateServer, StateSnapshot, StateTransferError, decode_relayed_origin,
                                           encode_relayed_origin, fetch_state, fetch_verified_state,
                                           state_relay_handler_name)
from node.net.access import SwarmAccess
from node.net.framing import read_frame, write_frame
from node.net.identity import load_or_create_identity
from node.net.records import StateClaimRecord, sign_records, write_state_claim
from node.swarm.adverts import make_record_validators
from tests.node.test_signed_records import SharedDHT
from tests.node.test_state_verification import ITERATION, RUN, STAGE, _receiver_expects, _same_weights, _trained_state

pytestmark = pytest.mark.timeout(120)
LOCAL = ["/ip4/127.0.0.1/tcp/0"]


async def _connect(p2p: P2P, other: P2P) -> None:
    maddr = (await other.get_visible_maddrs())[0]
    await p2p._client.connect(other.peer_id, [Multiaddr(str(maddr).split("/p2p/")[0])])


def _run(tmp_path, relay_kind: str, use_dht: bool = True):
    """The receiver fetches the holder's state through a relay of ``relay_kind`` ("honest", "forging",
    "closed": its access rule refuses the holder, "candidate": the holder counts the receiver as no member and
    cannot vouch for it (no connection to it can exist), and the receiver asks twice, or "vouching": the same,
    but the relay vouches for the receiver). Returns (snapshot or the error, relay server or None)."""
    honest = _trained_state()
    zeros = {**honest, "model": {k: torch.zeros_like(v) for k, v in honest["model"].items()}}
    data: dict = {}
    ids = [load_or_create_identity(tmp_path / f"id{i}.key") for i in range(3)]  # holder, relay, receiver
    dhts = []
    for identity in ids:
        dht = SharedDHT(data)
        sign_records(dht, make_record_validators(identity.private_key)[0].local_public_key, SwarmAccess())
        dhts.append(dht)

    async def sketch(stage, min_iteration, nonce):
        mine = weights_sketch(honest["model"], nonce)
        await write_state_claim(dhts[0], RUN, "", nonce, StateClaimRecord(STAGE, ITERATION, tuple(mine)))
        return ITERATION, mine

    async def snapshot(stage, min_iteration, claim_nonce=None):
        if claim_nonce is not None:  # asked through a relay: the signed claim first, as the trainer's server does
            await sketch(stage, min_iteration, claim_nonce)
        return StateSnapshot(STAGE, ITERATION, 0.0, encode_state(honest, {"stage": STAGE, "iteration": ITERATION}),
                             weights_digest(honest["model"]))

    async def forge(_info, reader, writer):
        """A relay that answers in the holder's name: zero weights, and a sketch of them."""
        try:
            await read_frame(reader, 128, 10)
            req = msgpack.unpackb(await read_frame(reader, 4096, 10), raw=False)
            header = {"ok": True, "stage": STAGE, "iteration": ITERATION, "checksum": 0.0}
            if "sketch_nonce" in req:
                await write_frame(writer, msgpack.packb({**header, "sketch": weights_sketch(zeros["model"],
                                                                                            req["sketch_nonce"])}))
            else:
                await write_frame(writer, msgpack.packb({**header, "digest": weights_digest(zeros["model"])}))
                await write_frame(writer, encode_state(zeros, {"stage": STAGE, "iteration": ITERATION}))
        finally:
            writer.close()

    async def main():
        hosts, server = [], None
        try:
            for i in range(3):
                hosts.append(await P2P.create(host_maddrs=LOCAL, identity_path=str(tmp_path / f"id{i}.key")))
            holder, relay, receiver = hosts
            holder_id, receiver_id = holder.peer_id.to_base58(), receiver.peer_id.to_base58()
            candidate = relay_kind in ("candidate", "vouching")
            member = (lambda p: p != receiver_id) if candidate else None

            async def cannot_challenge(peer):
                raise ConnectionError("no connection to a NATed peer can exist")

            async def vouches(peer):
                return peer == receiver_id

            await StateServer(holder, RUN, snapshot, sketch=sketch, member=member,
                              vouch=cannot_challenge if candidate else None).start()
            if relay_kind == "forging":
                await relay.add_binary_stream_handler(state_relay_handler_name(RUN), forge)
            else:
                allow = (lambda p: p != holder_id) if relay_kind == "closed" else None
                server = RelayServer(relay, RUN, allow, 1 << 16, vouch=vouches if relay_kind == "vouching" else None)
                await server.start()
            await _connect(holder, relay)  # the holder dialled out to its relay, as a NATed node does
            await _connect(receiver, relay)
            relay_id = relay.peer_id.to_base58()
            try:
                snap, verdict = await fetch_verified_state(
                    receiver, RUN, [holder_id], STAGE, ITERATION, expected=_receiver_expects(),
                    dht=dhts[2] if use_dht else None, via=lambda peer: relay_id)
                if candidate:  # a second download at once: a candidate's rate, relay or not
                    await fetch_state(receiver, RUN, [holder_id], STAGE, ITERATION, max_state_bytes=1 << 24,
                                      via=lambda peer: relay_id)
                return (snap, honest), server
            except StateTransferError as e:
                return e, server
        finally:
            if server is not None:
                await server.close()
            for h in hosts:
                with contextlib.suppress(Exception):
                    await h.shutdown()

    return asyncio.run(main())


def test_a_state_crosses_an_honest_relay_and_is_confirmed_by_its_sources_signed_sketch(tmp_path):
    (snap, honest), server = _run(tmp_path, "honest")
    assert _same_weights(snap.state["model"], honest["model"])
    assert server.relayed_states == 1
    assert server.relayed_bytes > len(snap.payload)


def test_a_relay_that_substitutes_the_state_is_refused(tmp_path):
    error, _ = _run(tmp_path, "forging")
    assert isinstance(error, StateTransferError) and "not confirmed by its signed sketch" in str(error)


def test_a_relayed_state_without_a_dht_to_confirm_it_is_refused(tmp_path):
    error, server = _run(tmp_path, "honest", use_dht=False)
    assert isinstance(error, StateTransferError) and "not confirmed by its signed sketch" in str(error)


def test_a_relay_pipes_state_only_to_peers_its_access_rule_admits(tmp_path):
    error, server = _run(tmp_path, "closed")
    assert isinstance(error, StateTransferError)
    assert server.refused[NO_ROUTE] == 1 and server.relayed_states == 0


def test_a_candidate_stays_a_candidate_through_a_relay(tmp_path):
    error, server = _run(tmp_path, "candidate")
    # nobody vouched: a stranger's rate (the holder's own challenge cannot reach the receiver)
    assert isinstance(error, StateTransferError) and "one state download per 30 s" in str(error), error
    assert server.relayed_states == 2  # served once, refused the second time


def test_a_relay_vouches_for_a_candidate_its_target_cannot_challenge(tmp_path):
    error, server = _run(tmp_path, "vouching")
    assert isinstance(error, StateTransferError) and "one state download per 2 s" in str(error), error
    assert server.relayed_states == 2


@pytest.mark.parametrize("frame", [b"", b"\x00" * 300, msgpack.packb(["Qm" + "a" * 44, True]),
                                   msgpack.packb({"origin": "not/a/peer", "vouched": True}),
                                   msgpack.packb({"origin": "Qm" + "a" * 44, "vouched": 1})])
def test_an_origin_frame_that_is_not_one_is_refused(frame):
    with pytest.raises(Exception):
        decode_relayed_origin(frame)
    assert decode_relayed_origin(encode_relayed_origin("Qm" + "a" * 44, True)) == ("Qm" + "a" * 44, True)
