"""bench/stragglers.py: its flags, the slow replica's place, the control's switches and the summary of a history
(pure units on canned data; the bench itself starts daemons and is not run here)."""

import argparse

import pytest

from tests.eval.benches import load_bench


def _bench_module():
    return load_bench("stragglers")


def test_quick_and_default_iterations():
    m = _bench_module()
    full, quick = m.parse_args([]), m.parse_args(["--quick"])
    assert (full.iterations, full.warmup) == (30, 6)
    assert (quick.iterations, quick.warmup) == (3, 1)
    assert m.parse_args(["--quick", "--iterations", "5"]).iterations == 5  # an explicit count wins
    with pytest.raises(SystemExit):
        m.parse_args(["--slowdown", "0.5"])


def test_summary_of_a_canned_history():
    m = _bench_module()
    history = [{"iteration": i, "seconds": s, "loss": 3.0, "dropped": d, "retried": 0, "epoch": e, "microbatches": 8}
               for i, (s, d, e) in enumerate([(9.0, 2, 1), (1.0, 0, 1), (2.0, 1, 1), (3.0, 0, 2), (4.0, 0, 2),
                                              (5.0, 3, 2)])]
    s = m.summarize(history, first=1, count=4)  # iteration 0 (warm-up) and 5 (past the window) left out
    assert s["iterations"] == [1, 4] and s["n"] == 4
    assert s["mean_s"] == pytest.approx(2.5) and s["median_s"] == pytest.approx(2.5) and s["max_s"] == 4.0
    assert s["p95_s"] == pytest.approx(3.85)  # 95% of the way from rank 0 to 3: 3 + 0.85 x (4 - 3)
    assert s["dropped"] == 1 and s["epochs_trained"] == [1, 2] and s["microbatches"] == 32
    assert m.percentile([7.0], 95) == 7.0 and m.percentile([1.0, 2.0], 50) == pytest.approx(1.5)
    with pytest.raises(ValueError):
        m.summarize(history, first=10, count=3)


def test_hedges_count_only_where_reported():
    m = _bench_module()
    assert m.hedges_sent([{"recovery": {"dropped": 0}}, None]) is None  # daemons without hedging
    assert m.hedges_sent([{"recovery": {"hedges": {"sent": 2}}}, {"recovery": {"hedges": {"sent": 3}}}]) == 5


def test_the_slow_replica_is_a_second_replica_of_its_stage():
    m = _bench_module()
    sizes = [2, 2, 2, 1, 1, 1]  # skippipe up: nodes 0-1 data, 2-3 stage 1, 4-5 stage 2
    assert m.slow_node_index(sizes, 1) == 3 and m.slow_node_index(sizes, 2) == 5
    for stage in (0, 3, 6):  # the data nodes, a stage with one replica, no such stage
        with pytest.raises(m.BenchError):
            m.slow_node_index(sizes, stage)


def test_off_switches_take_the_first_spelling_the_parser_declares():
    m = _bench_module()
    p = argparse.ArgumentParser()
    p.add_argument("--deadlines", choices=["observed", "model"])
    p.add_argument("--no-hedging", action="store_true")
    p.add_argument("--replan", choices=["on"])  # declared, but "off" is no choice of it
    found = m.off_switches(p)
    assert found["observed deadlines"] == ("--deadlines", "model")
    assert found["hedging"] == ("--no-hedging",)
    assert found["re-planning"] is None
    real = m.off_switches(m._node_run_parser())  # this node run: every feature can be turned off
    assert real == {"observed deadlines": ("--deadlines", "model"), "hedging": ("--hedging", "off"),
                    "re-planning": ("--replan", "off")}


def test_replica_shares_per_epoch_and_planned():
    m = _bench_module()
    stages = [0, 1, 1, 2]  # a data node, two replicas of stage 1, one of stage 2
    history = lambda visits: [{"epoch": e, "local_visits": v} for e, v in visits]  # noqa: E731
    states = {0: {"peer_id": "d", "history": history([(1, 4)])},
              1: {"peer_id": "a", "history": history([(1, 2), (1, 2), (2, 3), (2, 3)])},
              2: {"peer_id": "b", "history": history([(1, 2), (1, 2), (2, 1), (2, 1)])},
              3: {"peer_id": "c", "history": history([(1, 4)])}}
    schedule = {"epoch": 2, "members": ["d", "a", "b", "c"],
                "schedule": {"paths": [{"data_node": 0, "route": [0, 1, 3], "microbatches": 3},
                                       {"data_node": 0, "route": [0, 2, 3], "microbatches": 1}]}}
    shares = m.replica_shares(states, stages, schedule)
    assert shares == [
        {"node": 1, "stage": 1, "microbatches_per_epoch": {"1": 4, "2": 6}, "last_epoch_planned_per_iteration": 3},
        {"node": 2, "stage": 1, "microbatches_per_epoch": {"1": 4, "2": 2}, "last_epoch_planned_per_iteration": 1}]
    schedule["schedule"]["paths"] = [{"data_node": 0, "route": [0, 1, 3], "microbatches": 4}]  # b gets none
    assert [x["last_epoch_planned_per_iteration"] for x in m.replica_shares(states, stages, schedule)] == [4, 0]
    assert [x["last_epoch_planned_per_iteration"] for x in m.replica_shares(states, stages, None)] == [None, None]
    table = m.format_shares({"slow_replica": {"slow_node": 2, "replica_microbatches": shares}})
    assert "node2 (slow)" in table and "epoch 2: 2" in table
