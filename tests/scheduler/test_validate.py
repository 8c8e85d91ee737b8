"""Every constraint of validate_schedule, each triggered by a minimal change of a valid schedule."""

import json

import pytest

from scheduler.errors import ScheduleError
from scheduler.routes import RouteLimits
from scheduler.schedule import PathEntry, Schedule
from scheduler.validate import deadlock_risk, stage_visits, validate_schedule

from .conftest import uniform_cost

# 4 stages: data nodes 0,1; stage 1: 2,3; stage 2: 4; stage 3: 5
STAGES = ((0, 1), (2, 3), (4,), (5,))


def make(paths, path_length=3, memory=3, stages=STAGES, limits=RouteLimits()):
    return Schedule(stages, path_length, memory, tuple(PathEntry(*p) for p in paths), uniform_cost(6), limits)


VALID = [(0, (0, 2, 4), 1), (0, (0, 4, 5), 1), (1, (1, 3, 5), 1)]


def test_valid_schedule_passes():
    s = make(VALID)
    validate_schedule(s, microbatches_per_data_node={0: 2, 1: 1})
    assert stage_visits(s) == [3, 2, 2, 2]


@pytest.mark.parametrize(
    "paths, constraint",
    [
        ([(0, (0, 2, 4, 5), 1)] + VALID[1:], "route-length"),
        ([(0, (1, 2, 4), 1)] + VALID[1:], "route-start"),
        ([(2, (2, 3, 4), 1)] + VALID[1:], "data-node"),
        ([(0, (0, 1, 4), 1)] + VALID[1:], "route-node"),
        ([(0, (0, 9, 4), 1)] + VALID[1:], "route-node"),  # id in no stage
        ([(0, (0, 2, 3), 1)] + VALID[1:], "repeated-stage"),
        ([(0, (0, 2, 4), 0)] + VALID[1:], "microbatches"),
        ([(0, (0, 2, 4), 3)] + VALID[1:], "stage-balance"),
        ([], "paths"),
    ],
)
def test_each_violation_is_named(paths, constraint):
    with pytest.raises(ScheduleError) as e:
        validate_schedule(make(paths))
    assert e.value.constraint == constraint
    assert str(e.value).startswith(constraint + ":")


def test_reordering_limits():
    # stage order 3 then 2 is a swap of distance 1; 2 then 1 after 3 would be distance 2
    s = make([(0, (0, 5, 4), 1), (0, (0, 2, 4), 1), (1, (1, 3, 5), 1)])
    validate_schedule(s)
    with pytest.raises(ScheduleError) as e:
        validate_schedule(s, limits=RouteLimits(max_swaps=0))
    assert e.value.constraint == "max-swaps"
    s4 = make([(0, (0, 5, 2, 4), 1)], path_length=4)
    with pytest.raises(ScheduleError) as e:
        validate_schedule(s4)
    assert e.value.constraint == "max-swap-distance"
    validate_schedule(s4, limits=RouteLimits(max_swap_distance=2))
    with pytest.raises(ScheduleError) as e:
        validate_schedule(make([(0, (0, 5), 3)], path_length=2), limits=RouteLimits(max_jump=2))
    assert e.value.constraint == "max-jump"


def test_schedule_level_checks():
    with pytest.raises(ScheduleError, match="^path-length"):
        validate_schedule(make(VALID, path_length=5))
    with pytest.raises(ScheduleError, match="^memory"):
        validate_schedule(make(VALID, memory=0))
    with pytest.raises(ScheduleError, match="^stages"):
        validate_schedule(make(VALID, stages=((0, 1), (2, 3), (4, 0), (5,))))
    with pytest.raises(ScheduleError, match="^stages"):
        validate_schedule(make(VALID, stages=((0, 1), (), (4,), (5,))))
    with pytest.raises(ScheduleError, match="^microbatch-count"):
        validate_schedule(make(VALID), microbatches_per_data_node=2)


def test_full_pipeline_path_length_equal_to_stages():
    validate_schedule(make([(0, (0, 2, 4, 5), 4), (1, (1, 3, 4, 5), 1)], path_length=4))


def test_memory_deadlock_detected_and_depends_on_memory():
    stages = ((0, 1), (2,), (3,))
    crossing = [(0, (0, 2, 3), 2), (1, (1, 3, 2), 2)]
    s = Schedule(stages, 3, 1, tuple(PathEntry(*p) for p in crossing), uniform_cost(4))
    with pytest.raises(ScheduleError) as e:
        validate_schedule(s)
    assert e.value.constraint == "memory-deadlock"
    # with 4 slots each node fits every microbatch that can reach it: no wait, no deadlock
    validate_schedule(Schedule(stages, 3, 4, s.paths, s.cost))
    # same direction for both: acyclic, fine with memory 1
    same = [(0, (0, 2, 3), 2), (1, (1, 2, 3), 2)]
    validate_schedule(Schedule(stages, 3, 1, tuple(PathEntry(*p) for p in same), uniform_cost(4)))
    assert deadlock_risk({0: [(0, 2, 3)], 1: [(1, 3, 2)]}, 1) is not None


def test_json_round_trip_and_format_errors():
    s = make(VALID)
    again = Schedule.from_json(json.dumps(s.to_json()))
    assert again == s
    doc = {"stages": [[0], [1]], "path_length": 2, "memory": 1,
           "paths": [{"data_node": 0, "route": [0, 1], "microbatches": 2}], "cost": {"compute_s": [1, 1], "link_s": [[0, 1], [1, 0]]}}
    hand = Schedule.from_json(doc)
    validate_schedule(hand)
    assert hand.limits == RouteLimits() and hand.cost.backward_ratio == 1.5
    for broken, what in (({**doc, "memory": "3"}, "memory"), ({k: v for k, v in doc.items() if k != "paths"}, "paths"),
                         ({**doc, "paths": [{"route": [0, 1]}]}, "malformed")):
        with pytest.raises(ScheduleError, match=what):
            Schedule.from_json(broken)
    with pytest.raises(ScheduleError, match="^format"):
        Schedule.from_json("[1, 2")
