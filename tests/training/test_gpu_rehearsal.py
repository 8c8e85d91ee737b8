"""The GPU run rehearsed on the CPU (scripts/gpu_rehearsal.sh): the carried wheel set resolves offline for
the GPU machine (cp312 manylinux x86_64, with the packages it has), and bench/gpu.sh --dry-run runs the
reference and the 9-node swarm in a fresh environment holding only what that machine has plus the carried
wheels, out of reach of the project's venv. It needs network for ``pip download`` (CI has it); without,
it is skipped with one line saying so."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _index_reachable(tmp_path) -> bool:
    probe = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                            "--python-version", "3.12", "--platform", "manylinux2014_x86_64", "--implementation", "cp",
                            "-d", str(tmp_path / "probe"), "base58==2.1.1"], capture_output=True, text=True, timeout=180)
    return probe.returncode == 0


def test_gpu_run_rehearsed_in_an_environment_like_the_gpu_machines(tmp_path):
    if not _index_reachable(tmp_path):
        pytest.skip("no package index reachable: pip download failed, so the wheel set cannot be fetched here")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_rehearsal.sh"), str(tmp_path / "rehearsal")],
                          cwd=ROOT, capture_output=True, text=True, timeout=840,
                          env=dict(os.environ, PYTHON=sys.executable))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "offline resolution for cp3.12 manylinux x86_64: ok" in out
    results = tmp_path / "rehearsal" / "out"
    for name in ("tiny-reference-fp32", "tiny-reference-bf16", "tiny-swarm-fp32", "tiny-swarm-bf16", "tiny-swarm-int8"):
        r = json.loads((results / f"{name}.json").read_text())
        assert "failed" not in r and "skipped" not in r and r["tokens_per_s"] > 0, r
    summary = json.loads((results / "summary.json").read_text())
    assert summary["failed"] == [] and len(summary["results"]) == 5
