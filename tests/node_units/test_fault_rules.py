"""Fault-injection rules that name an attempt fire on that attempt of a microbatch only."""

import pytest

from node.errors import UserError
from node.train.faults import FaultInjector, parse_fault


def test_an_attempt_rule_stalls_the_first_attempt_and_spares_its_hedge():
    """The same ``attempt=0`` rule on every replica of a stage stalls a microbatch wherever the schedule sends
    it first; the hedge or recomputation (attempt 1) that goes to another replica runs undelayed."""
    spec = "delay@iteration=1,hop=1,direction=forward,microbatch=2,attempt=0,delay=8"
    first, other = FaultInjector([parse_fault(spec)]), FaultInjector([parse_fault(spec)])
    assert first.take(1, 1, "forward", 2, 1) is None  # a hedge here: not this rule's attempt
    rule = first.take(1, 1, "forward", 2, 0)
    assert rule is not None and rule.action == "delay" and rule.delay_s == 8.0
    assert first.pending == 0 and first.take(1, 1, "forward", 2, 0) is None  # fired once
    assert other.take(1, 1, "forward", 2, 1) is None and other.pending == 1  # the hedge on the other replica
    anyone = FaultInjector([parse_fault("drop@iteration=1,hop=1")])
    assert anyone.take(1, 1, "forward", 0, 3) is not None  # no attempt named: any attempt


@pytest.mark.parametrize("spec", ["delay@iteration=1,attempt=-1", "delay@iteration=1,attempt=x"])
def test_a_bad_attempt_is_one_user_error(spec):
    with pytest.raises(UserError):
        parse_fault(spec)
