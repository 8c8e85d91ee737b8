"""bench/gpu.sh and bench/gpu_bench.py run where there is no GPU: the dry run (CPU, tiny model) goes through
the same code as the GPU run, and its results have the fields the GPU run reports. bench/gpu.sh has never
run on a GPU from this test; it checks the script's CPU-testable parts only."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_gpu_script_dry_run_reference_part(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path), WHEELS=str(tmp_path / "no-wheels"))
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), "--dry-run", "--no-swarm"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for prec in ("fp32", "bf16"):
        r = json.loads((tmp_path / f"tiny-reference-{prec}.json").read_text())
        assert r["kind"] == "reference" and r["precision"] == prec and r["device"] == "cpu"
        assert r["tokens_per_s"] > 0 and r["tokens"] == 2 * 4 * 2 * 32
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["host"]["dry_run"] and len(summary["results"]) == 2
    assert "tiny  reference fp32" in proc.stdout


@pytest.mark.timeout(900)
def test_gpu_bench_dry_run_swarm_part(tmp_path):
    """The 9-node swarm part on the CPU with the int8 wire: figures present and plausible."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_bench.py"), "--dry-run", "--ref-precisions", "",
                           "--wires", "int8", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=840, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "tiny-swarm-int8.json").read_text())
    assert "skipped" not in r, r
    assert r["nodes"] == 9 and r["wire"] == "int8" and r["iterations"] == 2 and r["tokens"] > 0
    # int8 activations: ~1 byte per element of d_model, per hop, both directions, plus control frames
    d_model = 64
    assert 0 < r["bytes_per_token"] < 4 * d_model * 2 * 5
    assert set(r["phases_s"]) == {"seconds", "microbatch_s", "averaging_s", "norm_exchange_s", "step_s"}


def test_unusable_device_is_one_error_line(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_bench.py"), "--device", "cuda:7",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode != 0 and proc.stderr.strip().startswith("error:") and "Traceback" not in proc.stderr
