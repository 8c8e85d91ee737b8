"""Units of the epoch-switch rule: where a new schedule epoch starts (pure, no network)."""

import types

from node.swarm.coordinator import Coordinator, RunConfig
from node.train.trainer import IterationStats, TrainerConfig, TrainerNode


def _trainer(current: int, seconds=()):
    t = TrainerNode(p2p=None, dht=None, peer_id="me", epoch=None, config=TrainerConfig())
    t.current_iteration = current
    t.history = [IterationStats(iteration=i, epoch=1, loss=1.0, microbatches=1, tokens=1, seconds=s, grad_norm=1.0,
                                clip_coef=1.0, active_nodes=2, local_visits=1, averaged=None)
                 for i, s in enumerate(seconds)]
    return t


def test_switch_is_two_boundaries_ahead_and_now_while_paused():
    t = _trainer(10)
    assert t.switch_iteration() == 12  # members are at most one iteration apart: 11 may have begun
    t.paused_reason = "stage(s) [3] have no live replica"
    assert t.switch_iteration() == 10  # nobody runs while paused


def test_join_lead_is_measured_in_training_time():
    t = _trainer(10, seconds=[0.5] * 5)
    assert t.switch_iteration(lead_s=20.0) == 12 + 40  # 20 s of 0.5 s iterations
    slow = _trainer(10, seconds=[10.0] * 5)
    assert slow.switch_iteration(lead_s=20.0) == 12 + 2


def _coordinator(progress, current_members):
    identity = types.SimpleNamespace(peer_id=types.SimpleNamespace(to_base58=lambda: "a"))
    c = Coordinator(run_id="r", identity=identity, view=None, run=RunConfig(2, 2, 1), memory=1, debounce_s=0.0,
                    takeover_s=1.0, budget_s=0.1, publish=None, on_adopt=lambda e: None, progress=progress,
                    join_lead_s=15.0)
    c.current = types.SimpleNamespace(members=tuple(current_members), start_iteration=0)
    return c


def test_coordinator_asks_for_the_join_lead_only_when_a_node_joins():
    asked = []

    def progress(lead_s):
        asked.append(lead_s)
        return 7

    c = _coordinator(progress, ["a", "b", "c"])
    assert c.start_iteration(("a", "b")) == 7 and asked[-1] == 0.0  # a node left: no lead
    assert c.start_iteration(("a", "b", "c", "d")) == 7 and asked[-1] == 15.0  # d joins
    c.current = types.SimpleNamespace(members=("a", "b"), start_iteration=9)
    assert c.start_iteration(("a",)) == 9  # never before an epoch already announced
    assert _coordinator(None, ["a"]).start_iteration(("a", "b")) == 0  # not training: from the start
