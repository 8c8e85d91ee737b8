#!/usr/bin/env bash
# Set up the environment and run the whole test suite (README command b; .ci/run calls exactly this).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit $?
# Headless Chromium for tests/node/test_dashboard.py (it skips, saying why, without one). Only as root with apt.
if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "[test setup] chromium (headless dashboard test)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium >/dev/null 2>&1 \
            || { apt-get update -qq >/dev/null 2>&1 \
                 && apt-get install -y --no-install-recommends chromium >/dev/null 2>&1; } \
            || echo "[test setup] chromium could not be installed: the dashboard test will be skipped"
    else
        echo "[test setup] no chromium and no root/apt-get: the dashboard test will be skipped"
    fi
fi
# iptables for the NAT testbed (node/testing/nat.py: router namespaces doing source NAT). Only as root with apt.
if ! command -v iptables >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "[test setup] iptables (NAT testbed)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends iptables >/dev/null 2>&1 \
            || { apt-get update -qq >/dev/null 2>&1 \
                 && apt-get install -y --no-install-recommends iptables >/dev/null 2>&1; } \
            || echo "[test setup] iptables could not be installed: the NAT tests will be skipped"
    else
        echo "[test setup] no iptables and no root/apt-get: the NAT tests will be skipped"
    fi
fi
# Two workers (pytest-xdist): the daemon tests spend most of their time waiting on the swarm's timers
# (heartbeats, debounces, join boundaries), not on the CPU. Tests of one xdist_group share a worker
# (the network-namespace labs: one at a time). SKIPPIPE_TEST_WORKERS=0 runs everything in this process.
.venv/bin/python -m pytest -q -ra --durations=25 -n "${SKIPPIPE_TEST_WORKERS:-2}" --dist loadgroup "$@"
rc=$?
if [ "$rc" -eq 5 ]; then   # pytest: no tests collected -- not a failure of the code under test
    echo "no tests were collected"
    rc=0
fi
exit "$rc"
