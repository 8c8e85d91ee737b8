"""bench/convergence.py: the two variants trained side by side give the same figures as in turn."""

import json
import pathlib
import subprocess
import sys

import pytest

from tests.eval.benches import load_bench

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "convergence.py"


def _run(tmp_path: pathlib.Path, jobs: int) -> dict:
    out, ckpt = tmp_path / f"out{jobs}", tmp_path / f"ckpt{jobs}"
    proc = subprocess.run([sys.executable, str(BENCH), "--iterations", "2", "--eval-every", "1", "--val-batches", "2",
                           "--microbatch-size", "2", "--jobs", str(jobs), "--out", str(out),
                           "--checkpoints", str(ckpt)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (ckpt / "full").is_dir() and (ckpt / "skip").is_dir()
    return json.loads((out / "convergence.json").read_text())


@pytest.mark.timeout(600)
def test_side_by_side_runs_match_sequential_runs(_cache_dir, tmp_path):
    one, two = _run(tmp_path, 1), _run(tmp_path, 2)
    for name in ("full", "skip"):
        assert one["runs"][name]["val_loss"] == two["runs"][name]["val_loss"]
        assert one["runs"][name]["train_loss"][1:] == two["runs"][name]["train_loss"][1:]
        assert len(one["runs"][name]["val_loss"]) == 3  # before training and after each iteration
    assert one["final_loss_gap_pct"] == two["final_loss_gap_pct"]
    # the variants really differ: skip paths visit 4 of 6 stages
    assert one["runs"]["full"]["val_loss"][-1] != one["runs"]["skip"]["val_loss"][-1]
    assert one["stage_compute_ratio_skip_vs_full"] == pytest.approx(4 / 6)


def test_bad_jobs_is_one_error_line(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH), "--jobs", "0", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0
    assert "--jobs must be at least 1" in proc.stderr and "Traceback" not in proc.stderr


def _bench_module():
    """bench/convergence.py as a module (bench/ is not a package)."""
    return load_bench("convergence")


def test_loss_at_iteration_interpolates_between_evaluations():
    m = _bench_module()
    its, losses = [0, 50, 100], [5.0, 3.0, 2.0]
    assert m.loss_at_iteration(its, losses, 0) == 5.0
    assert m.loss_at_iteration(its, losses, 25) == pytest.approx(4.0)
    assert m.loss_at_iteration(its, losses, 75) == pytest.approx(2.5)
    assert m.loss_at_iteration(its, losses, 100) == 2.0
    with pytest.raises(ValueError):
        m.loss_at_iteration(its, losses, 101)
    with pytest.raises(ValueError):
        m.loss_at_iteration(its, losses[:2], 10)


def test_equal_time_gap_compares_against_the_full_run_at_the_same_time():
    m = _bench_module()
    gaps = m.equal_time_gaps([0, 100, 200], [4.0, 2.0, 1.0], 200, 1.5, {"half": 0.5, "same": 1.0})
    assert gaps["half"]["full_iteration"] == 100 and gaps["half"]["full_val_loss"] == 2.0
    assert gaps["half"]["loss_gap_pct"] == pytest.approx(-25.0)  # skip is better at equal time
    assert gaps["same"]["loss_gap_pct"] == pytest.approx(50.0)   # and worse at equal tokens


def test_wan_time_ratios_reads_both_spans(tmp_path):
    m = _bench_module()
    wan = {"results": [
        {"schedule": "full pipeline", "mean_s": 40.0, "mean_full_iteration_s": 80.0},
        {"schedule": "random skip", "mean_s": 90.0, "mean_full_iteration_s": 120.0},
        {"schedule": "SkipPipe", "mean_s": 10.0, "mean_full_iteration_s": 40.0}]}
    (tmp_path / "wan.json").write_text(json.dumps(wan))
    assert m.wan_time_ratios(tmp_path / "wan.json") == {"microbatch_phase": 0.25, "whole_iteration": 0.5}
    assert m.wan_time_ratios(tmp_path / "missing.json") == {}
    (tmp_path / "bad.json").write_text("{}")
    assert m.wan_time_ratios(tmp_path / "bad.json") == {}


def test_summary_only_adds_the_equal_time_gap_without_training(tmp_path):
    result = {"runs": {"full": {"iterations": [0, 10, 20], "val_loss": [5.0, 3.0, 2.0], "seconds": 1.0},
                       "skip": {"iterations": [0, 10, 20], "val_loss": [5.0, 3.5, 2.5], "seconds": 1.0}},
              "final_loss_gap_pct": 25.0, "final_perplexity_gap_pct": 64.9, "stage_compute_ratio_skip_vs_full": 4 / 6}
    (tmp_path / "convergence.json").write_text(json.dumps(result))
    wan = {"results": [{"schedule": "full pipeline", "mean_s": 40.0, "mean_full_iteration_s": 80.0},
                       {"schedule": "SkipPipe", "mean_s": 20.0, "mean_full_iteration_s": 80.0}]}
    (tmp_path / "wan.json").write_text(json.dumps(wan))
    proc = subprocess.run([sys.executable, str(BENCH), "--summary-only", "--out", str(tmp_path),
                           "--wan-results", str(tmp_path / "wan.json")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rewritten = json.loads((tmp_path / "convergence.json").read_text())
    assert rewritten["equal_time"]["microbatch_phase"]["full_iteration"] == 10
    assert rewritten["equal_time"]["microbatch_phase"]["loss_gap_pct"] == pytest.approx(2.5 / 3.0 * 100 - 100)
    assert rewritten["equal_time"]["whole_iteration"]["loss_gap_pct"] == pytest.approx(25.0)
    assert "gap -16.67%" in proc.stdout and "(same tokens)" in proc.stdout


def test_summary_only_without_a_result_is_one_error_line(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH), "--summary-only", "--out", str(tmp_path / "none")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0
    assert "cannot read a convergence result" in proc.stderr and "Traceback" not in proc.stderr
