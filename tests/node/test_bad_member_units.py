"""Units of the bad-member checks: magnitude screening of hop tensors, robust norms, the averaging bound."""

from __future__ import annotations

import math

import torch

from node.dataplane.guard import MicrobatchGuard
from node.dataplane.magnitude import MIN_SAMPLES, MagnitudeScreen, measure
from node.net.records import NormRecord
from node.train.health import FAULTS_BEFORE_BAN, PeerHealth
from node.train.screening import AVERAGED_NORM_FACTOR, AveragingScreen, robust_squared_norm
from protocol import ActivationMessage, GradientMessage, MicrobatchId, TensorFrame

RUN, ME, UP, DOWN, DATA = "run", "me", "up", "down", "data"
SHAPE = (2, 4, 8)


def _guard() -> MicrobatchGuard:
    return MicrobatchGuard(RUN, SHAPE, position=lambda: (0, 0), self_id=ME, members=lambda: {UP, DOWN, DATA})


def _act(index: int, tensor: torch.Tensor) -> ActivationMessage:
    return ActivationMessage(MicrobatchId(RUN, 0, 0, DATA, index, 0), 2, (DATA, UP, ME, DOWN, DATA),
                             TensorFrame.from_tensor(tensor))


def _grad(index: int, tensor: torch.Tensor) -> GradientMessage:
    return GradientMessage(MicrobatchId(RUN, 0, 0, DATA, index, 0), 2, (DATA, UP, ME, DOWN, DATA),
                           TensorFrame.from_tensor(tensor))


def test_the_guard_refuses_hops_far_outside_the_recent_magnitudes():
    g = _guard()
    torch.manual_seed(0)
    honest = [torch.randn(SHAPE) for _ in range(MIN_SAMPLES + 4)]
    assert all(g.check(_act(i, t), UP) is None for i, t in enumerate(honest))
    assert all(g.check(_grad(i, t * 1e-3), DOWN) is None for i, t in enumerate(honest))
    n = len(honest)
    assert g.check(_act(n, torch.full(SHAPE, 1e30)), UP) == "out_of_range"  # finite, absurd
    assert g.check(_act(n + 1, honest[0] * 1e3), UP) == "out_of_range"  # 1000x the recent RMS
    assert g.check(_grad(n, honest[1] * -1e-3 * 1e6), DOWN) == "out_of_range"  # gradients x -1e6
    assert g.check(_act(n + 2, honest[2] * 5), UP) is None  # a spike of a few times is honest
    assert g.check(_grad(n + 1, honest[3] * 1e-3 * 20), DOWN) is None
    # gradients and activations keep their own statistics
    assert g.magnitudes.median("activation") > 100 * g.magnitudes.median("gradient")


def test_the_absolute_cap_applies_before_any_statistics():
    g = _guard()
    assert g.check(_act(0, torch.full(SHAPE, 1e11)), UP) == "out_of_range"
    assert g.check(_act(1, torch.full(SHAPE, 3.0)), UP) is None


def test_a_refused_frame_does_not_enter_the_statistics():
    screen = MagnitudeScreen()
    for _ in range(MIN_SAMPLES):
        assert screen.judge("activation", measure(torch.ones(10).numpy())) is None
    for _ in range(50):  # a flood of outliers never moves the median
        assert screen.judge("activation", measure(torch.full((10,), 1e3).numpy())) is not None
    assert screen.median("activation") == 1.0


def _rec(stage: int, sq: float) -> NormRecord:
    return NormRecord(stage=stage, sq=sq, checksum=1.0, epoch=0)


def test_robust_norm_leaves_out_a_nan_or_absurd_replica_and_is_order_free():
    honest = {"d": _rec(0, 4.0), "a": _rec(1, 9.0), "s2": _rec(2, 1.0)}
    for lie in (math.nan, math.inf, 1e30):
        records = {**honest, "b": _rec(1, lie)}
        verdict = robust_squared_norm(records)
        assert verdict.total_sq == 14.0 and set(verdict.excluded) == {"b"}, (lie, verdict)
        assert robust_squared_norm(dict(reversed(list(records.items())))) == verdict
    # lying low cannot unclip more than its own stage: the lower median of the stage
    assert robust_squared_norm({**honest, "b": _rec(1, 0.0)}).total_sq == 5.0
    # honest replicas that agree: the same number as before
    assert robust_squared_norm({**honest, "b": _rec(1, 9.0)}).total_sq == 14.0


def test_robust_norm_keeps_the_skip_of_a_stage_whose_every_report_is_non_finite():
    verdict = robust_squared_norm({"d": _rec(0, 4.0), "a": _rec(1, math.inf), "b": _rec(1, math.nan)})
    assert math.isnan(verdict.total_sq) and not verdict.excluded


def test_averaging_bound_follows_the_local_norm_and_history():
    screen = AveragingScreen()
    assert screen.bound(0.0) is None
    assert screen.bound(4.0) == AVERAGED_NORM_FACTOR * 2.0
    screen.accepted(100.0)
    assert screen.bound(0.0) == AVERAGED_NORM_FACTOR * 10.0  # no own gradient: the recent rounds


def test_faults_ban_after_a_few():
    health = PeerHealth(ME, alive=None, self_alive=lambda: True, ban_s=30.0, ban_max_s=300.0)
    for _ in range(FAULTS_BEFORE_BAN - 1):
        assert not health.fault(UP, "odd") and health.usable(UP)
    assert not health.trusted(UP)
    assert health.fault(UP, "odd") and not health.usable(UP) and health.suspects() == {UP}
    assert health.fault(DOWN, "poisoned a round", ban_now=True) and not health.usable(DOWN)


def _rejections(wire: str = "fp32"):
    """A FrameRejections over stand-in parts of a trainer; returns it and the parts the test reads."""
    from types import SimpleNamespace

    from node.train.screening import FrameRejections

    parts = SimpleNamespace(dropped=[], sent=[])
    parts.health = PeerHealth(ME, alive=None, self_alive=lambda: True, ban_s=30.0, ban_max_s=300.0)
    on_rejected = FrameRejections(
        cfg=SimpleNamespace(run_id=RUN, wire=wire), peer_id=ME, epochs=SimpleNamespace(members=(DATA, UP, ME, DOWN)),
        life=SimpleNamespace(closed=False), health=parts.health,
        resources=SimpleNamespace(runtime=SimpleNamespace(drop=parts.dropped.append)),
        sender=SimpleNamespace(send_control=lambda peer, msg: parts.sent.append((peer, msg))), recovery=None)
    return on_rejected, parts


def test_a_members_poisoned_hop_is_its_fault_and_fails_the_microbatch_at_once():
    on_rejected, node = _rejections()
    on_rejected(_act(0, torch.zeros(SHAPE)), UP, "out_of_range", "RMS 1e6")
    on_rejected(_grad(1, torch.zeros(SHAPE)), DOWN, "non_finite", "NaN")
    (to0, fail0), (to1, fail1) = node.sent
    assert (to0, fail0.peer_id, fail0.hop) == (DATA, UP, 1)  # the sender's hop, told to the data node
    assert (to1, fail1.peer_id, fail1.hop) == (DATA, DOWN, 3)
    assert len(node.dropped) == 1  # the gradient's autograd state is freed at once
    assert node.health.faults_total == {UP: 1, DOWN: 1}
    # not a fault: a late frame, an outsider's poison, an fp16 overflow
    on_rejected(_act(2, torch.zeros(SHAPE)), UP, "stale_iteration", "")
    on_rejected(_act(3, torch.zeros(SHAPE)), "outsider", "non_finite", "")
    on_fp16, fp16 = _rejections(wire="fp16")
    on_fp16(_act(4, torch.zeros(SHAPE)), UP, "non_finite", "")
    assert len(node.sent) == 2 and not fp16.sent and not fp16.health.faults_total


def test_corrupt_rules_fire_in_order_and_a_bad_spec_is_one_user_error():
    import pytest

    from node.errors import UserError
    from node.train.faults import FaultInjector, parse_fault

    faults = FaultInjector([parse_fault("corrupt@iteration=5,target=norm,fill=nan,times=2"),
                            parse_fault("corrupt@iteration=5,target=norm,fill=1e30"),
                            parse_fault("corrupt@iteration=3,target=gradients,scale=-1e6")])
    got = [faults.tamper(it, "norm", 1.0) for it in range(4, 9)]
    assert got[0] == 1.0 and math.isnan(got[1]) and math.isnan(got[2]) and got[3] == 1e30 and got[4] == 1.0
    assert faults.tamper(3, "gradients", torch.ones(2)).tolist() == [-1e6, -1e6]
    assert faults.pending == 0 and faults.take(5, 1, "forward", 0) is None  # never a drop/delay/kill
    for spec in ("corrupt@iteration=1,target=weights,fill=1", "corrupt@iteration=1,target=norm",
                 "corrupt@iteration=1,target=norm,fill=1,scale=2", "corrupt@iteration=1,target=norm,fill=x"):
        with pytest.raises(UserError):
            parse_fault(spec)


def test_a_measured_magnitude_is_judged_without_reading_the_tensor_again():
    """Large frames are measured in the data plane's worker thread (node.dataplane.transport._decode):
    the loop's magnitude rule must use that measurement, not read the tensor itself."""
    g = _guard()
    honest = torch.ones(SHAPE)
    for i in range(MIN_SAMPLES):
        assert g.check(_act(i, honest), UP) is None
    absurd = _act(MIN_SAMPLES, torch.full(SHAPE, 1e6))
    measured = g.measure(absurd.tensor)
    assert g.inspect(absurd, UP, tensor_checked=True, measured=measured).reason == "out_of_range"
    # the measurement decides, whatever the frame holds: an honest measurement lets the frame in
    assert g.inspect(_act(MIN_SAMPLES + 1, torch.full(SHAPE, 1e6)), UP, tensor_checked=True,
                     measured=g.measure(_act(0, honest).tensor)) is None
