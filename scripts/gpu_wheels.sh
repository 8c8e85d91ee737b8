#!/usr/bin/env bash
# Download, here (with network), the wheels that a GPU machine without network needs to run the swarm
# (hivemind, py-libp2p and their dependencies), so they can travel with the working tree; then prove,
# offline, that they resolve for that machine.
#
# Why: the GPU machines lent to this project have Python 3.12 with torch (CUDA), numpy, scipy, msgpack,
# uvloop, protobuf, grpcio, prometheus-client, tokenizers, safetensors and transformers, but no hivemind or
# libp2p, no corpora and no package index. Their protobuf and grpcio versions were never read, and
# libp2p's generated code needs protobuf >= 5.29.3, so both are carried too (installed first on
# PYTHONPATH, they shadow the machine's own). The device tool carries the working tree plus the ignored
# paths named in `carry`, at most 64 MiB in all; these wheels are about 40 MB.
#
# Usage:  bash scripts/gpu_wheels.sh [DIR]        (default DIR: .gpu-wheels in the checkout, git-ignored)
#   then: run(command="bash bench/gpu.sh", carry=[".gpu-wheels"], timeout_s=600)
#         bench/gpu.sh installs them with `pip install --no-index --no-deps --target .gpu-site .gpu-wheels/*.whl`,
#         puts .gpu-site first on PYTHONPATH and makes hivemind's bundled p2pd executable.
# Environment: PYTHON  an interpreter with hivemind and libp2p installed (their dependency closure is read
#                      from its metadata; default: the checkout's .venv, else python3)
#              PYVER   the target machine's Python (default 3.12; tests/training/test_gpu_rehearsal.py also
#                      fetches the set for this machine's Python to run bench/gpu.sh with it)
#
# What is downloaded: the run-time dependency closure of hivemind and libp2p at PYTHON's versions, minus
# what the GPU machine has (GPU_HAS below: torch and its dependencies, the packages above, what
# transformers pulls in), plus protobuf and grpcio; fastecdsa is 4.0.0 (2.3.2 has no cp312 wheel). Binary
# wheels come from `pip download --only-binary=:all: --python-version $PYVER --platform manylinux... `;
# packages published only as sdists (prefetch_generator, python-baseconv, varint) are built into
# pure-Python wheels with `pip wheel --no-deps`.
#
# The offline proof: `pip install --dry-run --no-index --only-binary=:all: --python-version $PYVER
# --platform manylinux2014_x86_64 ... --target X hivemind libp2p protobuf grpcio` resolving from DIR plus
# stand-in wheels (name and version only) for GPU_HAS at PYTHON's versions (torch at 2.11.0, the GPU
# machine's): every requirement of the set is met by the set or by what the machine has.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
DIR=$(mkdir -p "${1:-$ROOT/.gpu-wheels}" && cd "${1:-$ROOT/.gpu-wheels}" && pwd)
PY=${PYTHON:-$( [ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3 )}
PYVER=${PYVER:-3.12}
ABI=cp${PYVER/./}
PLATFORMS=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
           --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64 --platform any)
TARGET=(--only-binary=:all: --python-version "$PYVER" --implementation cp --abi "$ABI" --abi abi3 --abi none
        "${PLATFORMS[@]}")
# on the GPU machine already (notes/gpu.md; torch's and transformers' dependencies)
GPU_HAS="torch numpy scipy msgpack uvloop prometheus-client tokenizers safetensors transformers
         typing-extensions filelock fsspec jinja2 markupsafe networkx sympy mpmath setuptools pyyaml requests urllib3
         certifi charset-normalizer packaging huggingface-hub regex tqdm idna"
# the GPU machine's own torch (notes/gpu.md); the other stand-ins take PYTHON's versions
TORCH_ON_GPU=2.11.0
# carried although the GPU machine has them: versions there unknown, libp2p needs protobuf >= 5.29.3
CARRIED_ANYWAY="protobuf grpcio"
declare -A PINNED=([fastecdsa]=4.0.0)
# libp2p 0.8.1 requires fastecdsa==2.3.2, which has no cp312 wheel: 4.0.0 is carried instead (and imported by
# the rehearsal), so the offline proof counts the pinned version as met by a stand-in
OVERRIDDEN="fastecdsa==2.3.2"
# published only as sdists (pure Python): built into wheels here
SDIST_ONLY="prefetch_generator python-baseconv varint"

if ! "$PY" -c 'import importlib.metadata as m; m.version("hivemind"); m.version("libp2p")' 2>/dev/null; then
    echo "error: $PY has no hivemind or libp2p installed; set PYTHON to an interpreter that has both" >&2
    exit 1
fi
PACKAGES=$("$PY" - "$GPU_HAS" "$CARRIED_ANYWAY" "$PYVER" <<'PYEOF'
import importlib.metadata as m, re, sys
from packaging.requirements import Requirement
skip, extra, pyver = set(sys.argv[1].split()), sys.argv[2].split(), sys.argv[3]
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
seen, stack, out = set(), ["hivemind", "libp2p", *extra], []
while stack:
    name = stack.pop()
    if norm(name) in seen or norm(name) in skip:
        continue
    seen.add(norm(name))
    dist = m.distribution(name)
    out.append(f"{dist.metadata['Name']}=={dist.version}")
    for r in dist.requires or []:
        req = Requirement(r)
        env = {"extra": "", "python_version": pyver, "python_full_version": pyver + ".0",
               "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
               "implementation_name": "cpython", "platform_python_implementation": "CPython"}
        if req.marker is None or req.marker.evaluate(env):
            stack.append(req.name)
print("\n".join(sorted(out, key=str.lower)))
PYEOF
)
echo "$(echo "$PACKAGES" | wc -l) packages for cp$PYVER into $DIR"
BINARY=() SDIST=()
for spec in $PACKAGES; do
    name=${spec%%==*}
    [ -n "${PINNED[$name]:-}" ] && spec="$name==${PINNED[$name]}"
    if [[ " $SDIST_ONLY " == *" $name "* ]]; then SDIST+=("$spec"); else BINARY+=("$spec"); fi
done
echo "building pure-Python wheels from the sdists of ${SDIST[*]}"
"$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir "$DIR" "${SDIST[@]}"
# one resolution for all binary wheels; package by package (naming the culprit) only if that fails
if ! "$PY" -m pip download --quiet --disable-pip-version-check --no-deps "${TARGET[@]}" -d "$DIR" "${BINARY[@]}"; then
    for spec in "${BINARY[@]}"; do
        "$PY" -m pip download --quiet --disable-pip-version-check --no-deps "${TARGET[@]}" -d "$DIR" "$spec" \
            || { echo "error: $spec has no $ABI wheel for manylinux x86_64" >&2; exit 1; }
    done
fi
total=$(du -sb "$DIR" | cut -f1)
echo "$(ls "$DIR"/*.whl | wc -l) wheels, $((total / 1024 / 1024)) MiB in $DIR"
if (( total > 60 * 1024 * 1024 )); then
    echo "error: $DIR is over 60 MiB; the device tool carries at most 64 MiB with the working tree" >&2
    exit 1
fi

# ---- the offline proof: resolve the set for the target machine from DIR and the stand-ins alone
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" - "$WORK/present" "$GPU_HAS" "$TORCH_ON_GPU" "$OVERRIDDEN" <<'PYEOF'
import importlib.metadata as m, pathlib, re, sys, zipfile
out, names, torch_version, overridden = pathlib.Path(sys.argv[1]), sys.argv[2].split(), sys.argv[3], sys.argv[4]
out.mkdir(parents=True)
present = []
for name in [*names, *overridden.split()]:
    try:
        name, version = name.split("==") if "==" in name else (name, torch_version if name == "torch" else m.version(name))
    except m.PackageNotFoundError:
        continue  # nothing asks for it here; if something in the set did, the resolution below says so
    dist = re.sub(r"[-_.]+", "_", name).lower()
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(out / f"{dist}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: gpu_wheels.sh\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    present.append(f"{name}=={version}")
print("counted as present on the GPU machine (stand-ins):", " ".join(present))
PYEOF
TOP=$("$PY" -c 'import importlib.metadata as m; print(*(f"{n}=={m.version(n)}" for n in ("hivemind", "libp2p")))')
TOP="$TOP protobuf>=5.29.3 grpcio"
# shellcheck disable=SC2086
"$PY" -m pip install --isolated --disable-pip-version-check --dry-run --ignore-installed --no-index --find-links "$DIR" \
    --find-links "$WORK/present" "${TARGET[@]}" --target "$WORK/target" $TOP \
    | grep -E "^Would install" | fold -s -w 120
echo "offline resolution for cp$PYVER manylinux x86_64: ok ($TOP)"
