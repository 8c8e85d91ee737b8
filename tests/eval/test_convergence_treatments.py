"""bench/convergence.py's skip-run treatments (--train-branch-scale, --stage-lr, --anneal-start, --baseline)."""

import json
import pathlib
import subprocess
import sys

import pytest

from node.eval.path_training import branch_scales_for, stage_visit_shares

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "convergence.py"


def test_visit_shares_count_microbatches_per_stage():
    routes = {0: [(1, 2), (2, 3)], 1: [(1, 3), (1, 2)]}
    assert stage_visit_shares(routes, 4) == [1.0, 0.75, 0.75, 0.5]
    assert stage_visit_shares({0: [(1, 2, 3)]}, 4) == [1.0, 1.0, 1.0, 1.0]


def test_branch_scales_per_treatment():
    shares = [1.0, 0.5, 0.8, 0.0]
    assert branch_scales_for("none", shares) == ([1.0] * 4, [1.0] * 4)
    assert branch_scales_for("visit", shares) == ([1.0, 0.5, 0.8, 1.0], [1.0, 0.5, 0.8, 1.0])
    train, infer = branch_scales_for("inverse", shares)
    assert train == pytest.approx([1.0, 2.0, 1.25, 1.0]) and infer == [1.0] * 4


def _run(tmp_path, name, *extra):
    out = tmp_path / name
    proc = subprocess.run([sys.executable, str(BENCH), "--iterations", "2", "--eval-every", "1", "--val-batches", "2",
                           "--microbatch-size", "2", "--jobs", "1", "--out", str(out),
                           "--checkpoints", str(tmp_path / f"ckpt-{name}"), *extra],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "convergence.json").read_text())


@pytest.mark.timeout(900)
def test_treatments_change_the_skip_run_only_and_baseline_reuses_the_full_run(_cache_dir, tmp_path):
    plain = _run(tmp_path, "plain")
    base = str(tmp_path / "plain" / "convergence.json")
    treated = _run(tmp_path, "treated", "--train-branch-scale", "inverse", "--stage-lr", "inverse-visit",
                   "--anneal-start", "0", "--baseline", base)
    # the full run comes from the baseline file, untouched
    assert treated["runs"]["full"]["val_loss"] == plain["runs"]["full"]["val_loss"]
    t = treated["runs"]["skip"]["treatment"]
    assert t["train_branch_scale"]["mode"] == "inverse" and t["stage_lr"]["mode"] == "inverse-visit"
    assert t["anneal"]["full_iterations"] >= 1  # the share of full iterations reaches 1 at the end
    assert treated["runs"]["skip"]["val_loss"] != plain["runs"]["skip"]["val_loss"]
    assert "skip_depth_scaled" not in treated  # the post-hoc rule is for plain skip training only
    assert "skip_depth_scaled" in plain


def test_baseline_with_other_settings_is_refused(_cache_dir, tmp_path):
    p = tmp_path / "old.json"
    p.write_text(json.dumps({"config": {"model": "tiny", "iterations": 7}, "runs": {"full": {"name": "full"}}}))
    proc = subprocess.run([sys.executable, str(BENCH), "--iterations", "2", "--baseline", str(p), "--out",
                           str(tmp_path / "o")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "iterations" in proc.stderr and "Traceback" not in proc.stderr
