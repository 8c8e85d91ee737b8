"""The per-member DHT records of a run: round trips, validation of what other peers wrote, bounded expiry."""

import asyncio
import math
from types import SimpleNamespace

import pytest

from node.net.records import (NORM_RECORD_TTL_S, SCHEMA_VERSION, FinishedRecord, NormRecord, RecordError,
                              StartRecord, norm_key, read_finished_records, read_norm_records, read_start_records,
                              write_norm_record, write_start_record)


class FakeDHT:
    """Stores subkeyed values the way hivemind's DHT returns them (value + expiration_time per subkey)."""

    def __init__(self):
        self.data = {}

    async def store(self, key, value, expiration_time, subkey, return_future=True):
        self.data.setdefault(key, {})[subkey] = SimpleNamespace(value=value, expiration_time=expiration_time)
        return True

    async def get(self, key, latest=True, return_future=True):
        return SimpleNamespace(value=dict(self.data[key])) if key in self.data else None


def _norm(**kw):
    base = dict(stage=1, sq=4.0, checksum=12.5, epoch=2, loss_sum=3.0, n_mb=2, tokens=64, dropped=1,
                avg_group=("a", "b"), epochs=(b"x",))
    return NormRecord(**dict(base, **kw))


def test_records_round_trip_with_a_schema_version():
    r = _norm()
    d = r.to_dict()
    assert d["v"] == SCHEMA_VERSION and NormRecord.from_dict(d) == r
    s = StartRecord(epoch=3, config={"seed": 0}, start=5, time=1e9)
    assert StartRecord.from_dict(s.to_dict()) == s
    f = FinishedRecord(config={"seed": 0}, iteration=9, time=1e9)
    assert FinishedRecord.from_dict(f.to_dict()) == f
    assert norm_key("run", 7) == "run:gradnorm:7"


def test_a_poisoned_norm_stays_readable_but_other_numbers_must_be_sane():
    nan = NormRecord.from_dict(_norm(sq=math.nan, checksum=math.inf).to_dict())
    assert math.isnan(nan.sq) and math.isinf(nan.checksum)  # every member must see it to skip the step
    bad = [dict(_norm().to_dict(), v=SCHEMA_VERSION + 1), dict(_norm().to_dict(), stage=-1),
           dict(_norm().to_dict(), n_mb=True), dict(_norm().to_dict(), avg_group=["a"] * 5000),
           dict(_norm().to_dict(), epochs=[b"x" * (1 << 20)]), dict(_norm().to_dict(), sq="big"), "not a dict"]
    for d in bad:
        with pytest.raises(RecordError):
            NormRecord.from_dict(d)
    with pytest.raises(RecordError):
        StartRecord.from_dict(dict(StartRecord(1, {"a": 1}, 0, 1.0).to_dict(), time=math.inf))
    with pytest.raises(RecordError):
        FinishedRecord.from_dict(dict(FinishedRecord({"a": "x" * 100_000}, 1, 1.0).to_dict()))


def test_readers_skip_invalid_entries_and_far_expiries():
    async def main():
        dht = FakeDHT()
        assert await read_norm_records(dht, "r", 0) is None  # a miss is not "nobody published"
        await write_norm_record(dht, "r", 0, "good", _norm())
        await write_norm_record(dht, "r", 0, "capped", _norm(), ttl_s=10 * NORM_RECORD_TTL_S)
        entry = dht.data[norm_key("r", 0)]
        entry["garbage"] = SimpleNamespace(value={"v": SCHEMA_VERSION, "stage": "x"}, expiration_time=0.0)
        far = entry["good"].expiration_time + 100 * NORM_RECORD_TTL_S
        entry["forever"] = SimpleNamespace(value=_norm().to_dict(), expiration_time=far)
        assert set(await read_norm_records(dht, "r", 0)) == {"good", "capped"}
        await write_start_record(dht, "r", "a", StartRecord(1, {"seed": 0}, 0, 5.0))
        assert (await read_start_records(dht, "r"))["a"].start == 0
        assert await read_finished_records(dht, "r") is None

    asyncio.run(main())
