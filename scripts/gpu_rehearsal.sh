#!/usr/bin/env bash
# Rehearse, on a CPU machine with network, the GPU run of bench/gpu.sh: what the GPU machine (Python 3.12,
# torch and a few packages, no hivemind/libp2p, no network) will meet, short of the GPU itself.
#
#   1. scripts/gpu_wheels.sh for cp312 manylinux x86_64: the carried wheel set, and the offline proof that
#      it resolves there with the packages that machine already has;
#   2. the same set for this machine's Python when it is not 3.12 (a cp312 wheel cannot run here);
#   3. an environment built like the GPU machine's: a fresh venv (no pip, no system site-packages) holding
#      only what that machine has (torch, numpy, msgpack, uvloop, prometheus-client, safetensors, ...,
#      linked from PYTHON's environment), with the project's own venv out of reach (`env -i`);
#   4. `bash bench/gpu.sh --dry-run` there: it installs the carried wheels into an empty target directory
#      (`--no-index --no-deps --target`, or unzipped where there is no pip), then runs the single-process
#      reference and the 9-node swarm on the CPU with the tiny model.
#
# Usage: bash scripts/gpu_rehearsal.sh [WORKDIR]   (default: a fresh temporary directory, removed at the end)
# Environment: PYTHON (an interpreter with torch, hivemind and libp2p: default the checkout's .venv)
# tests/training/test_gpu_rehearsal.py runs it; bench/results/gpu/rehearsal.txt is its output as run.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
PY=${PYTHON:-$( [ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3 )}
if [ -n "${1:-}" ]; then WORK=$(mkdir -p "$1" && cd "$1" && pwd); else WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT; fi
LOCAL=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
# what the GPU machine has (notes/gpu.md), but protobuf and grpcio: the set carries its own
GPU_HAS="torch numpy scipy msgpack uvloop prometheus-client tokenizers safetensors transformers
         typing-extensions filelock fsspec jinja2 markupsafe networkx sympy mpmath setuptools pyyaml requests urllib3
         certifi charset-normalizer packaging huggingface-hub regex tqdm idna"

echo "== 1. the wheel set for the GPU machine (cp312 manylinux x86_64), resolved offline"
PYTHON=$PY PYVER=3.12 bash "$HERE/gpu_wheels.sh" "$WORK/wheels-cp312"
WHEELS=$WORK/wheels-cp312
if [ "$LOCAL" != 3.12 ]; then
    echo "== 2. the same set for this machine's Python $LOCAL (cp312 wheels cannot run here)"
    PYTHON=$PY PYVER=$LOCAL bash "$HERE/gpu_wheels.sh" "$WORK/wheels-cp${LOCAL/./}"
    WHEELS=$WORK/wheels-cp${LOCAL/./}
fi

echo "== 3. a fresh Python $LOCAL environment holding only what the GPU machine has"
"$PY" - "$WORK/gpu-env" "$GPU_HAS" <<'PYEOF'
import importlib.metadata as m, pathlib, subprocess, sys, sysconfig
env, names = pathlib.Path(sys.argv[1]), sys.argv[2].split()
subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(env)], check=True)
site = pathlib.Path(subprocess.run([str(env / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   check=True, capture_output=True, text=True).stdout.strip())
ours = pathlib.Path(sysconfig.get_paths()["purelib"])
linked = []
for name in names:
    try:
        dist = m.distribution(name)
    except m.PackageNotFoundError:
        continue
    tops = {pathlib.Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
    for top in sorted(tops - {"__pycache__"}):
        src = pathlib.Path(dist.locate_file(top))
        if src.exists() and not (site / top).exists():
            (site / top).symlink_to(src)
    linked.append(f"{dist.metadata['Name']}=={dist.version}")
print(f"{env}: {len(linked)} packages linked from {ours}:", " ".join(linked))
PYEOF

echo "== 4. bench/gpu.sh --dry-run in it (PYTHONPATH, the project's venv and its PATH out of reach)"
env -i HOME="$HOME" PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 PYTHON="$WORK/gpu-env/bin/python" \
    WHEELS="$WHEELS" SITE="$WORK/site" OUT="$WORK/out" bash "$ROOT/bench/gpu.sh" --dry-run
echo "rehearsal passed: the reference and the swarm ran with the carried wheels only"
