"""bench/convergence.py --wire: the skip variant per wire format against the fp32 wire, equal tokens."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_wire_comparison_writes_equal_token_figures(_cache_dir, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "convergence.py"), "--wire", "int8,bf16",
                           "--iterations", "2", "--eval-every", "1", "--val-batches", "2", "--microbatch-size", "2",
                           "--jobs", "1", "--out", str(tmp_path / "out"), "--checkpoints", str(tmp_path / "ck")],
                          capture_output=True, text=True, timeout=540, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "out" / "convergence_wire.json").read_text())
    assert list(r["runs"]) == ["skip-fp32", "skip-int8", "skip-bf16"] and r["equal_tokens"]
    assert set(r["val_loss_change_pct_vs_fp32"]) == {"int8", "bf16"}
    # quantization changes the numbers a little, never to nothing and never by much in 2 steps
    fp32 = r["runs"]["skip-fp32"]["val_loss"]
    for w in ("int8", "bf16"):
        other = r["runs"][f"skip-{w}"]["val_loss"]
        assert other[0] == fp32[0]  # same initial model
        assert other[-1] != fp32[-1] and abs(r["val_loss_change_pct_vs_fp32"][w]) < 1.0
    assert "wire int8" in proc.stdout


def test_unknown_wire_is_one_error_line(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "convergence.py"), "--wire", "int4",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "--wire takes formats" in proc.stderr and "Traceback" not in proc.stderr
