"""Shared helpers for the multi-process node tests: polling RPC and running the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Callable

from node.net.rpc import RpcCallError, call_http

__all__ = ["poll", "rpc", "run_cli", "error_lines", "DEADLINE_S"]

#: Generous bound for anything to converge on a loaded 2-core CI box (never a timing assertion).
DEADLINE_S = 90.0


#: A daemon started with a low ``--rpc-rate`` answers our own bursts of polling with HTTP 429; a
#: well-behaved client waits for the bucket to refill and asks again (bounded).
RATE_LIMITED_RETRIES = 10
RATE_LIMITED_WAIT_S = 1.0


def rpc(url: str, method: str, timeout: float = 10.0):
    for attempt in range(RATE_LIMITED_RETRIES + 1):
        try:
            return call_http(url, method, timeout=timeout)
        except RpcCallError as e:  # the daemon answers 429 with {"error": "rate limited: ..."}
            if not str(e).startswith("rate limited") or attempt == RATE_LIMITED_RETRIES:
                raise
            time.sleep(RATE_LIMITED_WAIT_S)


def poll(check: Callable[[], object], deadline_s: float = DEADLINE_S, interval_s: float = 0.5, what: str = "condition"):
    """Call ``check`` until it returns something truthy; RPC errors count as "not yet"."""
    end = time.monotonic() + deadline_s
    last_error = None
    while time.monotonic() < end:
        try:
            result = check()
            if result:
                return result
        except (RpcCallError, KeyError, TypeError) as e:
            last_error = e
        time.sleep(interval_s)
    raise AssertionError(f"{what} not reached within {deadline_s:.0f} s (last error: {last_error})")


def run_cli(*args: str, timeout: float = 120.0, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m node ARGS`` and capture its output."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "node", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        stdin=subprocess.DEVNULL,
    )


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (proc.stderr + proc.stdout).splitlines() if line.startswith("error:")]
