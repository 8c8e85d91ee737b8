"""The data-plane guard's rules for NormReport (the direct per-iteration barrier)."""

from __future__ import annotations

import math

from node.dataplane.guard import MicrobatchGuard
from node.dataplane.transport import DATA_MESSAGES
from protocol import NormReport, decode, encode

RUN = "guard-test"
EPOCH, ITERATION = 3, 10


def _guard(members=None, position=(EPOCH, ITERATION)) -> MicrobatchGuard:
    return MicrobatchGuard(run_id=RUN, hidden_shape=(2, 4, 8), position=lambda: position, self_id="me",
                           members=members)


def _report(peer="p1", **kw) -> NormReport:
    base = dict(run_id=RUN, epoch=EPOCH, iteration=ITERATION, peer_id=peer, stage=1, sq=0.5, checksum=1.0,
                loss_sum=2.0, n_mb=2, tokens=0, dropped=0)
    base.update(kw)
    return NormReport(**base)


def test_a_members_report_passes_and_travels_on_the_data_plane():
    assert NormReport in DATA_MESSAGES
    assert decode(encode(_report()), expect=DATA_MESSAGES) == _report()
    assert _guard(members=lambda: {"p1", "p2"}).check(_report(), "p1") is None
    # the next iteration too (a member may finish before we opened ours), and any epoch
    assert _guard().check(_report(iteration=ITERATION + 1, epoch=EPOCH + 1), "p1") is None


def test_a_poisoned_norm_passes_so_that_every_member_skips_the_step():
    assert _guard().check(_report(sq=math.inf, checksum=math.nan, loss_sum=math.nan), "p1") is None


def test_outsiders_impostors_other_runs_and_old_iterations_are_refused():
    g = _guard(members=lambda: {"p1", "p2"})
    assert g.check(_report(peer="p9"), "p9") == "not_member"
    assert g.check(_report(peer="p2"), "p1") == "wrong_sender"
    assert g.check(_report(run_id="other"), "p1") == "wrong_run"
    assert g.check(_report(iteration=ITERATION - 1), "p1") == "stale_iteration"
    assert g.check(_report(iteration=ITERATION + 2), "p1") == "future_iteration"


def test_unknown_position_skips_the_window_only():
    g = _guard(members=lambda: {"p1"}, position=None)
    assert g.check(_report(iteration=0), "p1") is None
    assert g.check(_report(peer="p9"), "p9") == "not_member"
