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
    # int8 activations and gradients: one byte per element plus a block scale per 64 elements; fp32
    # would be 4, bf16 2 (this is what tells the wire formats apart; bytes_per_token adds the control frames)
    assert 0.9 < r["hop_bytes_per_element"] <= 1.1, r["hop_bytes_per_element"]
    assert r["bytes_per_token"] > 0
    assert set(r["phases_s"]) == {"seconds", "microbatch_s", "averaging_s", "norm_exchange_s", "step_s"}


def test_unusable_device_is_one_error_line(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_bench.py"), "--device", "cuda:7",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode != 0 and proc.stderr.strip().startswith("error:") and "Traceback" not in proc.stderr


#: Run in a child interpreter before anything else: every import of hivemind or libp2p raises
#: ImportError, as on a GPU machine that has torch but not the carried wheels.
WITHOUT_P2P = """
import importlib.abc, runpy, sys
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('hivemind', 'libp2p'):
            raise ImportError(f'No module named {name!r} (absent in this test)')
sys.meta_path.insert(0, _Absent())
"""


def _without_p2p(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_P2P + code, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_reference_imports_without_hivemind_or_libp2p():
    proc = _without_p2p("import node.train.reference, node.train.precision\n"
                        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('hivemind', 'libp2p'))\n"
                        "assert not bad, bad\nprint('imported')")
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.timeout(600)
def test_bench_measures_the_reference_without_p2p_and_fails_on_the_swarm(tmp_path):
    """hivemind absent: the reference configurations are measured and written, the swarm ones fail, and the
    exit status and the last lines say which failed and why."""
    proc = _without_p2p("sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')",
                        str(ROOT / "bench" / "gpu_bench.py"), "--dry-run", "--wires", "fp32", "--out", str(tmp_path),
                        timeout=540)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    for prec in ("fp32", "bf16"):
        r = json.loads((tmp_path / f"tiny-reference-{prec}.json").read_text())
        assert r["tokens_per_s"] > 0 and "failed" not in r
    failed = json.loads((tmp_path / "tiny-swarm-fp32.json").read_text())
    assert "ImportError" in failed["failed"]
    last = proc.stderr.strip().splitlines()[-2:]
    assert last[0].startswith("error: 1 of 3 configurations failed") and last[1].strip().startswith("tiny-swarm-fp32:")


@pytest.mark.parametrize("flag", [["--models", "nosuch"], ["--wires", "int9"], ["--ref-precisions", "fp8"]])
def test_unknown_names_are_one_error_line(tmp_path, flag):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_bench.py"), "--dry-run", *flag,
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode != 0 and proc.stderr.strip().startswith("error:") and "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written
