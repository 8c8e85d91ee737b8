#!/usr/bin/env bash
# Download, here (with network), the Python 3.12 wheels that a GPU machine without network needs to run
# the swarm (hivemind, py-libp2p and their dependencies), so they can travel with the working tree.
#
# Why: the GPU machines lent to this project have Python 3.12 with torch (CUDA), numpy, scipy, msgpack, uvloop,
# protobuf, grpcio, prometheus-client, tokenizers, safetensors and transformers, but no hivemind or libp2p, no
# corpora and no package index (/work/shared/notes/gpu.md). The device tool carries the working tree plus the
# ignored paths named in `carry`, at most 64 MiB in all; these wheels are about 45 MB.
#
# Usage:  bash scripts/gpu_wheels.sh [DIR]        (default DIR: .gpu-wheels, git-ignored)
#   then: run(command="bash bench/gpu.sh", carry=[".gpu-wheels"], timeout_s=600)
#         bench/gpu.sh installs them with `pip install --no-index --no-deps --target .gpu-site .gpu-wheels/*.whl`,
#         puts .gpu-site first on PYTHONPATH and makes hivemind's bundled p2pd executable.
#
# What is downloaded: the run-time dependency closure of hivemind and libp2p in this checkout's venv (PYTHON,
# default /work/main/.venv/bin/python), at the venv's versions, minus what the GPU machine has (torch and its
# dependencies, the packages above and what transformers pulls in); fastecdsa is 4.0.0 (2.3.2 has no cp312
# wheel). Binary wheels come from `pip download --only-binary=:all: --python-version 3.12 --platform
# manylinux2014_x86_64 ...`; packages published only as sdists (prefetch_generator, python-baseconv, varint)
# are built into pure-Python wheels with `pip wheel --no-deps`.
# Checked here (2026-12-04, Python 3.12.1, 60 wheels, 34 MiB): they install with pip --no-index --no-deps
# --target; with stand-ins for the GPU machine's own packages (protobuf, grpcio, numpy, msgpack,
# typing_extensions, requests and its dependencies) libp2p's imports got as far as prometheus_client, which that
# machine has. hivemind needs torch, which this machine lacks for 3.12, so its import was not checked here.
set -euo pipefail
DIR=${1:-.gpu-wheels}
PY=${PYTHON:-$( [ -x /work/main/.venv/bin/python ] && echo /work/main/.venv/bin/python || echo python3 )}
PLATFORMS=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
           --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64 --platform any)
# on the GPU machine already (notes/gpu.md; torch's and transformers' dependencies)
GPU_HAS="torch numpy scipy msgpack uvloop protobuf grpcio prometheus-client tokenizers safetensors transformers
         typing-extensions filelock fsspec jinja2 markupsafe networkx sympy mpmath setuptools pyyaml requests urllib3
         certifi charset-normalizer packaging huggingface-hub regex tqdm types-protobuf types-requests mypy-protobuf
         mypy-extensions"
declare -A PINNED=([fastecdsa]=4.0.0)

PACKAGES=$("$PY" - "$GPU_HAS" <<'PYEOF'
import importlib.metadata as m, re, sys
from packaging.requirements import Requirement
skip = set(sys.argv[1].split())
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
seen, stack, out = set(), ["hivemind", "libp2p"], []
while stack:
    name = stack.pop()
    if norm(name) in seen or norm(name) in skip:
        continue
    seen.add(norm(name))
    dist = m.distribution(name)
    out.append(f"{dist.metadata['Name']}=={dist.version}")
    for r in dist.requires or []:
        req = Requirement(r)
        if req.marker is None or req.marker.evaluate({"extra": "", "python_version": "3.12"}):
            stack.append(req.name)
print("\n".join(sorted(out, key=str.lower)))
PYEOF
)
mkdir -p "$DIR"
for spec in $PACKAGES; do
    name=${spec%%==*}
    [ -n "${PINNED[$name]:-}" ] && spec="$name==${PINNED[$name]}"
    if ! "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --abi cp312 --abi abi3 --abi none "${PLATFORMS[@]}" -d "$DIR" "$spec" 2>/dev/null; then
        echo "$spec: no cp312 wheel; building one from the sdist"
        "$PY" -m pip wheel --quiet --no-deps --wheel-dir "$DIR" "$spec"
    fi
done
total=$(du -sb "$DIR" | cut -f1)
echo "$(ls "$DIR"/*.whl | wc -l) wheels, $((total / 1024 / 1024)) MiB in $DIR"
if (( total > 60 * 1024 * 1024 )); then
    echo "error: $DIR is over 60 MiB; the device tool carries at most 64 MiB with the working tree" >&2
    exit 1
fi
