"""Per-member training records on a daemon's (bound) DHT: owner-signed, sealed, members only.

Replays the forgeries of the hostile-swarm finding with an in-memory DHT: a plain-subkey record naming
a member (the old way to freeze the swarm), a record of a non-member owner, an unsealed or wrongly
sealed record in a keyed swarm, an oversized one and one set to live forever are all ignored and
counted; the members' own records read back keyed by the peer id of their owner key."""

import asyncio
import math
from types import SimpleNamespace

import msgpack
import pytest

from node.net.access import SwarmAccess
from node.net.identity import load_or_create_identity
from node.net.records import (MAX_RECORD_BYTES, NORM_RECORD_TTL_S, FinishedRecord, NormRecord, StartRecord,
                              finished_key, norm_key, read_finished_records, read_norm_records,
                              read_start_records, rejected_counts, sign_records, start_key,
                              write_finished_record, write_norm_record, write_start_record)
from node.swarm.adverts import make_record_validators

KEY = b"s" * 32


class SharedDHT:
    """Several handles on one in-memory DHT, returned the way hivemind returns subkeyed values."""

    def __init__(self, data):
        self.data = data

    async def store(self, key, value, expiration_time, subkey, return_future=True):
        self.data.setdefault(key, {})[subkey] = SimpleNamespace(value=value, expiration_time=expiration_time)
        return True

    async def get(self, key, latest=True, return_future=True):
        return SimpleNamespace(value=dict(self.data[key])) if key in self.data else None


@pytest.fixture(scope="module")
def ids(tmp_path_factory):
    d = tmp_path_factory.mktemp("ids")
    return [load_or_create_identity(d / f"id{i}.key") for i in range(3)]


def _owner(identity):
    return make_record_validators(identity.private_key)[0].local_public_key


def _norm(**kw):
    return NormRecord(**dict(dict(stage=0, sq=4.0, checksum=1.0, epoch=1, loss_sum=3.0, n_mb=1), **kw))


def test_forged_records_are_ignored_and_counted(ids):
    member, other_member, outsider = ids
    m_id, o_id, x_id = (i.peer_id.to_base58() for i in ids)

    async def main():
        data = {}
        a, b, x = SharedDHT(data), SharedDHT(data), SharedDHT(data)
        sign_records(a, _owner(member), SwarmAccess(KEY))
        sign_records(b, _owner(other_member), SwarmAccess(KEY))
        sign_records(x, _owner(outsider), SwarmAccess(b"w" * 32))  # a signing peer with the wrong key
        members = {m_id, o_id}
        await write_norm_record(a, "r", 727, m_id, _norm())
        await write_norm_record(b, "r", 727, o_id, _norm(stage=1))
        await write_norm_record(x, "r", 727, x_id, _norm(sq=3e30))
        entry = data[norm_key("r", 727)]
        # the old attack: an unsigned record in a plain subkey naming a member
        entry[m_id] = SimpleNamespace(value=_norm(sq=3e30, loss_sum=0.0).to_dict(), expiration_time=0.0)
        # an unsealed record in the outsider's own (signed) subkey
        entry[_owner(outsider)] = SimpleNamespace(
            value=msgpack.packb(_norm(sq=3e30).to_dict(), use_bin_type=True), expiration_time=0.0)
        got = await read_norm_records(a, "r", 727, members=members)
        assert set(got) == {m_id, o_id} and got[m_id].sq == 4.0 and got[o_id].stage == 1
        counts = rejected_counts(a)
        assert counts["not under an owner subkey"] == 1 and counts["no valid swarm-key proof"] == 1

        # a keyed outsider that is not a member: sealed right, signed, still ignored
        sign_records(x, _owner(outsider), SwarmAccess(KEY))
        await write_start_record(x, "r", x_id, StartRecord(424242, {"seed": 0}, 0, 1e12))
        await write_start_record(b, "r", o_id, StartRecord(1, {"seed": 0}, 0, 1.0))
        got = await read_start_records(a, "r", members=members)
        assert set(got) == {o_id} and got[o_id].epoch == 1
        assert rejected_counts(a)["owner is not a member of the run"] == 1

        await write_finished_record(x, "r", x_id, FinishedRecord({"seed": 0}, 9, 1.0))
        assert await read_finished_records(a, "r", members=members) == {}
        data[finished_key("r")][_owner(other_member)] = SimpleNamespace(
            value=b"\x00" * (MAX_RECORD_BYTES + 1), expiration_time=0.0)
        assert await read_finished_records(a, "r", members=members) == {}
        assert rejected_counts(a)[f"larger than {MAX_RECORD_BYTES} bytes"] == 1

        # a member's own record set to outlive its TTL is ignored too
        entry = data[start_key("r")][_owner(other_member)]
        entry.expiration_time += 100 * NORM_RECORD_TTL_S
        assert await read_start_records(a, "r", members=members) == {}

    asyncio.run(main())


def test_non_finite_numbers_where_they_have_no_meaning(ids):
    async def main():
        a = SharedDHT({})
        sign_records(a, _owner(ids[0]))  # no swarm key: signed, not sealed
        me = ids[0].peer_id.to_base58()
        await write_start_record(a, "r", me, StartRecord(1, {"seed": 0}, 0, math.inf))
        assert await read_start_records(a, "r", members={me}) == {}
        assert any(k.startswith("malformed") for k in rejected_counts(a))
        await write_norm_record(a, "r", 1, me, _norm(sq=math.nan))  # a poisoned gradient stays visible
        assert math.isnan((await read_norm_records(a, "r", 1, members={me}))[me].sq)

    asyncio.run(main())


def test_binding_needs_an_owner_subkey():
    with pytest.raises(ValueError):
        sign_records(SharedDHT({}), b"QmPlainPeerId")


def test_dht_storage_holds_mixed_type_subkeys_with_equal_expiry():
    """An outsider may store a ``str`` subkey next to an owner's ``bytes`` one, both expiring at the
    same instant; hivemind's expiration heap must still order them, or the key can no longer be
    stored to (nor a search merging it finish) on that node."""
    from node.compat import make_dht_storage_total_order
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.utils import get_dht_time

    make_dht_storage_total_order()
    value = DictionaryDHTValue()
    expiry = get_dht_time() + 600
    assert value.store("QmForged", b"x", expiry)
    assert value.store(b"[owner:ssh-rsa AAAA]", b"y", expiry)
    assert value.store(7, b"z", expiry)
    assert value.store(b"[owner:ssh-rsa BBBB]", b"w", expiry + 1)
    assert {k for k, _ in value.items()} == {"QmForged", b"[owner:ssh-rsa AAAA]", 7, b"[owner:ssh-rsa BBBB]"}
