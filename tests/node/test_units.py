"""Fast in-process tests of the daemon's pieces: validators, view, coordinator rules, RPC, lock."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

import node.compat  # noqa: F401
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer

from node.swarm.coordinator import Coordinator, RunConfig, assign_stages, epoch_membership
from node.swarm.adverts import FetchedAdvert, SkipPipeRecordValidator, make_record_validators
from node.errors import UserError
from node.net.identity import IdentityLock, load_or_create_identity, peer_id_from_rsa_public_key
from node.net.rpc import RpcServer, call_http
from node.swarm.view import SwarmView
from protocol.messages import MembershipEvent, StageAdvert, encode


@pytest.fixture(scope="module")
def identities(tmp_path_factory):
    d = tmp_path_factory.mktemp("ids")
    ids = [load_or_create_identity(d / f"id{i}.key") for i in range(3)]
    return sorted(ids, key=lambda i: i.peer_id.to_base58())


def advert(peer_id: str, stages=(0,), state="ONLINE", gossip_id="g", ts=None) -> StageAdvert:
    return StageAdvert(
        run_id="r", peer_id=peer_id, gossip_peer_id=gossip_id, maddrs=(), gossip_maddrs=(), stages=tuple(stages),
        state=state, compute_s_per_sample_per_layer=0.05, memory_slots=3, free_slots=3, protocol_version=1,
        rpc_port=None, location=None, timestamp=time.time() if ts is None else ts,
    )  # fmt: skip


def test_identity_is_stable_and_peer_id_derivable(identities, tmp_path):
    ident = identities[0]
    again = load_or_create_identity(ident.path)
    assert again.peer_id == ident.peer_id
    assert peer_id_from_rsa_public_key(ident.public_key_bytes) == ident.peer_id.to_base58()


def test_identity_lock_refuses_second_holder(tmp_path):
    path = tmp_path / "id.key"
    with IdentityLock(path):
        with pytest.raises(UserError, match="already used"):
            IdentityLock(path).acquire()
    IdentityLock(path).acquire()  # released on exit


def _record(owner_identity, signer_identity, adv: StageAdvert | dict) -> DHTRecord:
    owner_marker = make_record_validators(owner_identity.private_key)[0].local_public_key
    value = encode(adv) if isinstance(adv, StageAdvert) else adv
    record = DHTRecord(
        key=b"\x01" * 20,
        subkey=MSGPackSerializer.dumps(owner_marker),
        value=MSGPackSerializer.dumps(value),
        expiration_time=time.time() + 10,
    )
    signer = CompositeValidator(make_record_validators(signer_identity.private_key))
    return dataclasses.replace(record, value=signer.sign_value(record))


def test_validators_accept_own_advert_and_reject_forgeries(identities):
    a, b, _ = identities
    check = CompositeValidator(make_record_validators(a.private_key)).validate
    a_id, b_id = a.peer_id.to_base58(), b.peer_id.to_base58()
    assert check(_record(a, a, advert(a_id)))
    # b writes into a's subkey: b cannot sign for a's key.
    assert not check(_record(a, b, advert(a_id)))
    # b signs correctly in its own subkey but claims to be a.
    assert not check(_record(b, b, advert(a_id)))
    # non-skippipe values are left to other validators.
    assert check(_record(b, b, {"some": "value"}))
    assert SkipPipeRecordValidator().merge_with(SkipPipeRecordValidator())


def test_assign_stages_is_deterministic():
    class E:
        def __init__(self, pid, stages):
            self.peer_id, self.advert = pid, advert(pid, stages)

    peers = [E("c", (1, 2)), E("a", (0,)), E("b", (1,)), E("d", (1, 2))]
    assert assign_stages(peers, 3) == {"a": 0, "b": 1, "c": 2, "d": 1}
    assert assign_stages(list(reversed(peers)), 3) == assign_stages(peers, 3)


def test_view_expiry_and_gossip_trust():
    view = SwarmView(run_id="r", self_id="me")
    now = time.time()
    view.update_from_dht({"p1": FetchedAdvert(advert("p1", gossip_id="g1"), b"k", now + 3)}, now=now)
    assert [e.peer_id for e in view.online()] == ["p1"]
    # gossip about p1 from the wrong gossip id is ignored; from the right one it is applied
    leave = MembershipEvent(run_id="r", peer_id="p1", kind="leave", stages=(0,), timestamp=time.time())
    assert not view.on_membership(leave, "g-other")
    assert view.online()
    assert view.on_membership(leave, "g1")
    assert view.online() == []
    # advert expiry removes the peer entirely
    view.update_from_dht({}, now=now + 4)
    assert view.get("p1") is None


def _coordinator(ident, view, published, adopted, takeover_s=100.0):
    async def publish(epoch):
        published.append(epoch)

    return Coordinator(
        run_id="r", identity=ident, view=view, run=RunConfig(2, 2, 2), memory=3, debounce_s=0.0,
        takeover_s=takeover_s, budget_s=0.2, publish=publish, on_adopt=adopted.append,
    )  # fmt: skip


def _view_of(identities, self_index):
    ids = [i.peer_id.to_base58() for i in identities]
    view = SwarmView(run_id="r", self_id=ids[self_index])
    stages = [(0,), (0,), (1,)]
    view.update_from_dht(
        {p: FetchedAdvert(advert(p, stages[k]), identities[k].public_key_bytes, time.time() + 60) for k, p in enumerate(ids)}
    )
    view.changed_at -= 10  # membership has been stable for a while
    return view


async def test_coordinator_issues_signed_epoch_that_peers_adopt(identities):
    published, adopted = [], []
    primary = _coordinator(identities[0], _view_of(identities, 0), published, adopted)
    await primary.tick()
    assert len(published) == 1 and primary.current is published[0]
    epoch = published[0]
    assert epoch.coordinator == identities[0].peer_id.to_base58()
    assert epoch_membership(epoch) == frozenset((i.peer_id.to_base58(), s) for i, s in zip(identities, (0, 0, 1)))

    peer_adopted = []
    follower = _coordinator(identities[2], _view_of(identities, 2), [], peer_adopted)
    assert follower.consider(dataclasses.replace(epoch, members=tuple(reversed(epoch.members)))) == "bad signature"
    assert follower.consider(epoch) == "adopted"
    assert follower.current == epoch and peer_adopted == [epoch]
    assert follower.consider(epoch) == "stale"


async def test_backup_coordinator_waits_for_takeover(identities):
    published, adopted = [], []
    backup = _coordinator(identities[1], _view_of(identities, 1), published, adopted, takeover_s=100.0)
    await backup.tick()
    assert published == []  # rank 1 waits for the primary
    quick = _coordinator(identities[1], _view_of(identities, 1), published, adopted, takeover_s=0.0)
    await quick.tick()
    assert len(published) == 1 and published[0].coordinator == identities[1].peer_id.to_base58()


async def test_rpc_http_roundtrip():
    server = RpcServer()

    async def echo(params):
        return {"got": params}

    server.register("echo", echo)
    port = await server.start_http("127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{port}"
        assert await asyncio.to_thread(call_http, url, "echo", {"x": 1}) == {"got": {"x": 1}}
        with pytest.raises(Exception, match="unknown method"):
            await asyncio.to_thread(call_http, url, "nope")
    finally:
        await server.stop()
