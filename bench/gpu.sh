#!/usr/bin/env bash
# One prepared GPU benchmark run, sized for a single 10-minute command on a lent GPU machine.
#
# Measures (bench/gpu_bench.py): single-process reference tokens/s in fp32 and bf16 for `small` and `500m`,
# and the 9-node swarm (skippipe up's schedule: 2 data nodes, replicas 2,2,1,1,1, paths of 4 of 6) for
# `small` and `500m` with the fp32, bf16 and int8 wire formats: tokens/s, data-plane bytes per token and
# per-iteration phase times. Writes bench/results/gpu/*.json and prints a table.
#
# The GPU machine has torch, numpy, msgpack, uvloop and prometheus-client but no hivemind/libp2p, corpora or
# network: the tokens are synthetic, and the swarm part needs the wheels of scripts/gpu_wheels.sh, carried
# along (`run(command="bash bench/gpu.sh", carry=[".gpu-wheels"], timeout_s=600)`). Without a wheel
# directory only the single-process reference is measured (it needs neither hivemind nor libp2p); with
# one whose hivemind still cannot be imported, the script stops with the import error.
# Exit status: 0 only if every requested configuration was measured; 1 if any failed (bench/gpu_bench.py
# names each and why, after writing what it did measure).
# Rehearsed on CPU in an environment built like the GPU machine's: scripts/gpu_rehearsal.sh
# (bench/results/gpu/rehearsal.txt).
#
# Usage: bash bench/gpu.sh [extra bench/gpu_bench.py flags]   e.g. --models small --budget-s 300
#        bash bench/gpu.sh --dry-run                            CPU, tiny model: what tests/training/test_gpu_bench.py runs
# Environment: PYTHON (default python3), WHEELS (default .gpu-wheels), SITE (default .gpu-site),
#              OUT (default bench/results/gpu), BUDGET_S (default 540: leaves a minute of the 10 for start-up).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.gpu-wheels}
SITE=${SITE:-.gpu-site}
[[ "$SITE" = /* ]] || SITE="$PWD/$SITE"
OUT=${OUT:-bench/results/gpu}
BUDGET_S=${BUDGET_S:-540}
if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1 && [ ! -d "$SITE/hivemind" ]; then
    echo "installing $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $SITE"
    if ! "$PY" -m pip install --quiet --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl; then
        echo "pip failed; unpacking the wheels instead"  # a wheel is a zip of what goes into site-packages
        for w in "$WHEELS"/*.whl; do "$PY" -m zipfile -e "$w" "$SITE"; done
    fi
    chmod +x "$SITE"/hivemind/hivemind_cli/p2pd 2>/dev/null || true
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# the machine's own protobuf/grpcio (the carried ones, first on PYTHONPATH, shadow them)
"$PY" -m pip show protobuf grpcio 2>/dev/null | grep -E '^(Name|Version):' | paste - - || true
"$PY" -c 'import google.protobuf as p; print("protobuf in use:", p.__version__, p.__file__)' 2>/dev/null || true
SWARM=()
if ! "$PY" -c 'import node.compat, hivemind' 2>/dev/null; then
    if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        echo "error: the wheels of $WHEELS are installed in $SITE, but hivemind cannot be imported:" >&2
        "$PY" -c 'import node.compat, hivemind' 2>&1 | tail -3 >&2
        exit 1
    fi
    echo "no wheels in $WHEELS: measuring the single-process reference only (bring them: scripts/gpu_wheels.sh)"
    SWARM=(--no-swarm)
fi
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda" if torch.cuda.is_available() else "no cuda",
    torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
exec "$PY" bench/gpu_bench.py --out "$OUT" --budget-s "$BUDGET_S" "${SWARM[@]}" "$@"
