"""bench/convergence.py: the two variants trained side by side give the same figures as in turn."""

import json
import pathlib
import subprocess
import sys

import pytest

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
