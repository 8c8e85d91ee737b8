"""bench/nat.py: its flags, the summary of a history, the start-up comparison and the result it writes
(pure units on canned data; the bench itself makes namespaces and starts daemons and is not run here)."""

import json

import pytest

from tests.eval.benches import load_bench


def _bench_module():
    return load_bench("nat")


def test_quick_and_default_iterations():
    m = _bench_module()
    full, quick = m.parse_args([]), m.parse_args(["--quick"])
    assert (full.iterations, full.warmup, full.rate_mbit) == (60, 2, None)
    assert (quick.iterations, quick.warmup) == (3, 1)
    assert m.parse_args(["--quick", "--iterations", "5"]).iterations == 5  # an explicit count wins
    for bad in (["--iterations", "0"], ["--rate-mbit", "0"]):
        with pytest.raises(SystemExit):
            m.parse_args(bad)


def test_summary_counts_tokens_of_the_measured_iterations_only():
    m = _bench_module()
    history = [{"iteration": i, "seconds": s, "tokens": 512, "loss": 3.0, "dropped": d}
               for i, (s, d) in enumerate([(9.0, 0), (1.0, 0), (3.0, 1), (4.0, 0)])]
    s = m.summarize(history, first=1, count=2)  # the warm-up (0) and iteration 3 are left out
    assert s["iterations"] == [1, 2] and s["n"] == 2 and s["tokens"] == 1024
    assert s["tokens_per_s"] == pytest.approx(1024 / 4.0) and s["mean_s"] == pytest.approx(2.0)
    assert s["dropped"] == 1
    with pytest.raises(ValueError):
        m.summarize(history, first=10, count=3)


def test_online_ratio_is_the_slower_natted_node_over_the_public_joiners():
    m = _bench_module()
    online = {1: 10.0, 2: 12.0, 3: 14.0, 4: 15.0, 5: 30.0}
    s = m.online_summary(online, (4, 5))
    assert s["public_joiners_mean_s"] == pytest.approx(12.0) and s["natted_max_s"] == 30.0
    assert s["natted_vs_public"] == pytest.approx(2.5)
    assert m.online_summary({**online, 5: None}, (4, 5))["natted_vs_public"] is None  # one never came ONLINE


def test_result_has_the_ratio_at_the_top_and_is_written(tmp_path):
    m = _bench_module()
    cfg = {"tokens_per_s": 100.0, "bytes_relayed": 0, "online": {"natted_vs_public": 1.1}}
    result = m.build_result({"public": {**cfg, "tokens_per_s": 125.0}, "natted": cfg}, {"command": "x"})
    assert result["nat_vs_public_tokens_ratio"] == pytest.approx(0.8)
    assert result["nat_vs_public_online_ratio"] == pytest.approx(1.1)
    assert result["bytes_relayed"] == 0 and result["command"] == "x"
    path = m.write_result(result, tmp_path / "out")
    assert path.name == "nat.json" and json.loads(path.read_text())["nat_vs_public_tokens_ratio"] == pytest.approx(0.8)


def test_no_namespaces_is_one_error_line(monkeypatch, capsys, tmp_path):
    import node.testing.nat as nat

    m = _bench_module()
    monkeypatch.setattr(nat, "nat_unavailable", lambda: "creating network namespaces needs root")
    assert m.main(["--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: cannot create the NAT lab: creating network namespaces needs root"], err
    assert not (tmp_path / "nat.json").exists()


def test_microbatch_visits_count_each_node_once_per_path():
    m = _bench_module()
    by_index = {0: "d0", 1: "d1", 2: "a", 3: "b"}
    schedule = {"members": ["d1", "a", "d0", "b"], "schedule": {"paths": [
        {"data_node": 2, "route": [2, 1, 3, 2], "microbatches": 2},  # d0 -> a -> b -> back to d0
        {"data_node": 0, "route": [0, 3, 0], "microbatches": 1}]}}
    assert m.microbatch_visits(schedule, by_index) == {0: 2, 1: 1, 2: 2, 3: 3}
    assert m.microbatch_visits({}, by_index) == {0: 0, 1: 0, 2: 0, 3: 0}
