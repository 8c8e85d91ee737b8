"""bench/time_to_loss.py: time to a loss on interpolated curves, and the json of a tiny live run."""

import json
import pathlib
import subprocess
import sys

import pytest

from tests.eval.benches import load_bench

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "time_to_loss.py"


def _bench_module():
    return load_bench("time_to_loss")


def test_time_to_reach_interpolates_and_says_never():
    m = _bench_module()
    times, losses = [0.0, 10.0, 20.0], [5.0, 3.0, 2.0]
    assert m.time_to_reach(times, losses, 5.0) == 0.0
    assert m.time_to_reach(times, losses, 4.0) == pytest.approx(5.0)
    assert m.time_to_reach(times, losses, 2.5) == pytest.approx(15.0)
    assert m.time_to_reach(times, losses, 2.0) == pytest.approx(20.0)
    assert m.time_to_reach(times, losses, 1.9) is None


def test_summary_ratio_is_skippipe_over_full():
    m = _bench_module()
    runs = {"full": {"time_s": [0.0, 10.0], "val_loss": [5.0, 3.0]},
            "skippipe": {"time_s": [0.0, 4.0, 8.0], "val_loss": [5.0, 4.0, 2.0]}}
    s = m.summarize(runs)
    assert s["target_val_loss"] == 3.0
    assert s["time_to_target_s"] == {"full": 10.0, "skippipe": pytest.approx(6.0)}
    assert s["skippipe_vs_full"] == pytest.approx(0.6)
    assert s["final_loss_gap_pct"] == pytest.approx((2.0 / 3.0 - 1.0) * 100.0)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tiny_live_run_writes_the_json(_cache_dir, tmp_path):
    """6 nodes, one stage each, one iteration per schedule: the live path end to end (no timing checked)."""
    proc = subprocess.run([sys.executable, str(BENCH), "--nodes", "6", "--stage-sizes", "1,1,1,1,1,1",
                           "--time-scale", "0.002", "--budget-s", "1000", "--max-iterations", "1",
                           "--val-batches", "1", "--samples", "2", "--alloc-budget-s", "5", "--budget-search-s", "5",
                           "--no-plot", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=540, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "time_to_loss.json").read_text())
    assert set(r["runs"]) == {"full", "skippipe"}
    for run in r["runs"].values():
        assert run["iterations_done"] == 1
        n = len(run["val_loss"])
        assert n == 2  # before training and after the one iteration
        assert len(run["time_s"]) == len(run["microbatch_time_s"]) == len(run["iterations"]) == n
        assert run["time_s"][0] == 0.0 and run["time_s"][1] > 0.0
    assert r["target_val_loss"] == r["runs"]["full"]["val_loss"][-1]
    assert r["time_to_target_s"]["full"] is not None
    assert set(r["time_to_target_s"]) == {"full", "skippipe"}
    assert "skippipe_vs_full" in r and "final_loss_gap_pct" in r and "skippipe_vs_full_microbatch_phase" in r
    assert {"cpus", "load_avg_before", "load_avg_after"} <= set(r["machine"])
