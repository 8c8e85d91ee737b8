"""NormReport: the direct per-iteration barrier message (round trip, validation, fuzzed bytes)."""

from __future__ import annotations

import math
import random

import pytest

from protocol import MalformedMessage, NormReport, ProtocolError, decode, encode
from protocol.messages import NORM_REPORT_MAX_EPOCHS, NORM_REPORT_MAX_GROUP


def _report(**kw) -> NormReport:
    base = dict(run_id="run", epoch=1, iteration=7, peer_id="p1", stage=2, sq=0.5, checksum=3.25, loss_sum=12.0,
                n_mb=4, tokens=2048, dropped=0, avg_group=("p1", "p2"), epochs=(b"\x01\x02",))
    base.update(kw)
    return NormReport(**base)


def test_roundtrip():
    msg = _report()
    assert decode(encode(msg)) == msg
    assert decode(encode(msg), expect=(NormReport,)) == msg


def test_non_finite_numbers_travel():
    """A poisoned gradient (inf/NaN) must reach every member so that all skip the step."""
    msg = _report(sq=math.inf, checksum=math.nan, loss_sum=math.nan)
    back = decode(encode(msg))
    assert back.sq == math.inf and math.isnan(back.checksum) and math.isnan(back.loss_sum)
    assert math.isnan(decode(encode(_report(sq=math.nan))).sq)


@pytest.mark.parametrize("field, value", [("sq", -1e-9), ("sq", -math.inf), ("n_mb", -1), ("tokens", -1),
                                          ("dropped", -1), ("epoch", -1), ("iteration", -1), ("stage", -1)])
def test_insane_values_are_refused(field, value):
    with pytest.raises(MalformedMessage):
        encode(_report(**{field: value}))


def test_bounded_lists():
    with pytest.raises(MalformedMessage):
        encode(_report(avg_group=tuple(f"p{i}" for i in range(NORM_REPORT_MAX_GROUP + 1))))
    with pytest.raises(MalformedMessage):
        encode(_report(epochs=(b"",) * (NORM_REPORT_MAX_EPOCHS + 1)))


def test_fuzzed_bytes_never_escape_as_other_errors():
    rng = random.Random(20261204)
    valid = encode(_report())
    for _ in range(3000):
        data = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.2:
            data = data[: rng.randrange(len(data))]
        try:
            msg = decode(bytes(data), expect=(NormReport,))
        except ProtocolError:
            continue
        assert isinstance(msg, NormReport)
        assert msg.n_mb >= 0 and msg.tokens >= 0 and not msg.sq < 0


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_norm_report_with_an_unusable_loss_scale_is_refused(bad):
    from protocol import NormReport, decode, encode
    from protocol.errors import MalformedMessage

    report = NormReport(run_id="r", epoch=0, iteration=1, peer_id="p", stage=0, sq=1.0, checksum=0.0,
                        loss_sum=0.0, n_mb=1, tokens=8, dropped=0, loss_scale=bad)
    with pytest.raises(MalformedMessage):
        decode(encode(report))
