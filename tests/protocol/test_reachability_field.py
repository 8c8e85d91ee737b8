"""The advert's reachability and readiness: read from older senders that lack them, bounded and checked from newer ones."""

import dataclasses

import msgpack
import pytest

from protocol.errors import MalformedMessage
from protocol.messages import Reachability, StageAdvert, decode, encode
from tests.protocol.test_errors import ADVERT


def _without(field: str, message) -> bytes:
    envelope = msgpack.unpackb(encode(message), raw=False)
    del envelope["b"][field]
    return msgpack.packb(envelope, use_bin_type=True)


def test_an_advert_from_an_older_sender_reads_as_unknown():
    older = _without("reachability", dataclasses.replace(ADVERT, reachability="relayed"))
    assert decode(older, expect=StageAdvert).reachability == Reachability.UNKNOWN.value


def test_reachability_round_trips_and_rejects_other_values():
    for value in Reachability:
        assert decode(encode(dataclasses.replace(ADVERT, reachability=value.value))).reachability == value.value
    envelope = msgpack.unpackb(encode(ADVERT), raw=False)
    envelope["b"]["reachability"] = "x" * 10_000
    with pytest.raises(MalformedMessage) as raised:
        decode(msgpack.packb(envelope, use_bin_type=True), expect=StageAdvert)
    assert len(str(raised.value)) < 400


def test_readiness_round_trips_and_an_older_sender_is_ready():
    assert decode(encode(dataclasses.replace(ADVERT, ready=False)), expect=StageAdvert).ready is False
    assert decode(_without("ready", dataclasses.replace(ADVERT, ready=False)), expect=StageAdvert).ready is True
    envelope = msgpack.unpackb(encode(ADVERT), raw=False)
    envelope["b"]["ready"] = "yes"
    with pytest.raises(MalformedMessage):
        decode(msgpack.packb(envelope, use_bin_type=True), expect=StageAdvert)
