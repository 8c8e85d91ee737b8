"""No process outlives its owner: a daemon's p2pd and DHT child die with the daemon, and daemons die with the
harness that started them, also when the owner is SIGKILLed (nothing of its own clean-up runs).

Real processes throughout, watched through /proc; the only wait is a generous upper bound.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
#: Generous upper bound for processes to go (the daemons' clean leave plus the watchdog's grace is ~30 s).
GONE_DEADLINE_S = 180.0


def _stat(pid: int) -> tuple[str, int, str] | None:
    """(comm, ppid, state) of a live (non-zombie) process, else None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes().decode(errors="replace")
    except OSError:
        return None
    comm = raw[raw.index("(") + 1 : raw.rindex(")")]
    rest = raw[raw.rindex(")") + 2 :].split()
    if rest[0] in ("Z", "X"):
        return None
    return comm, int(rest[1]), rest[0]


def _descendants(root: int) -> dict[int, str]:
    """Live descendants of ``root``: pid -> comm."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            parents[int(entry)] = (st[1], st[0])
    out, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        for child, (ppid, comm) in parents.items():
            if ppid == pid and child not in out:
                out[child] = comm
                frontier.append(child)
    return out


def _wait_gone(pids, deadline_s: float = GONE_DEADLINE_S) -> list[int]:
    end = time.monotonic() + deadline_s
    alive = [p for p in pids if _stat(p) is not None]
    while alive and time.monotonic() < end:
        time.sleep(0.5)
        alive = [p for p in alive if _stat(p) is not None]
    return alive


def _kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_sigkilled_daemon_and_sigkilled_harness_leave_no_process(tmp_path):
    harness = subprocess.Popen([sys.executable, "-m", "tests.node.orphan_harness", str(tmp_path), "3"], cwd=ROOT,
                               stdout=open(tmp_path / "harness.log", "w"), stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    everything: dict[int, str] = {}
    try:
        end = time.monotonic() + 300
        while not (tmp_path / "pids.json").exists():
            assert harness.poll() is None, (tmp_path / "harness.log").read_text()[-3000:]
            assert time.monotonic() < end, "swarm did not start"
            time.sleep(0.5)
        daemons = json.loads((tmp_path / "pids.json").read_text())
        everything = _descendants(harness.pid)
        assert set(daemons) <= set(everything)
        for daemon in daemons:  # the test means something only if every daemon has its p2pd and DHT child
            children = _descendants(daemon)
            assert "p2pd" in children.values(), children
            assert any(c != "p2pd" for c in children.values()), children

        # 1. SIGKILL one daemon (the process only, not its group): its p2pd and DHT child must follow
        victim = daemons[-1]
        orphans = _descendants(victim)
        os.kill(victim, signal.SIGKILL)
        left = _wait_gone(list(orphans) + [victim])
        assert not left, f"children of the SIGKILLed daemon survived: {[(p, everything.get(p)) for p in left]}"

        # 2. SIGKILL the harness: every daemon and all their children must go
        everything = _descendants(harness.pid)
        assert len([p for p in daemons if p in everything]) == 2
        harness.kill()
        harness.wait()
        left = _wait_gone(everything)
        assert not left, f"processes outlived the SIGKILLed harness: {[(p, everything[p]) for p in left]}"
    finally:
        if harness.poll() is None:
            harness.kill()
            harness.wait()
        _kill_all([p for p in everything if _stat(p) is not None])


def test_daemon_with_a_dead_stdout_reader_still_stops_cleanly(tmp_path):
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "node", "node", "run", "--stages", "0", "--rpc-port", "-1",
                             "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity", str(tmp_path / "id.key"),
                             "--heartbeat", "1", "--ready-file", str(ready), "--log-level", "DEBUG"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)  # fmt: skip
    children: dict[int, str] = {}
    try:
        end = time.monotonic() + 180
        while not ready.exists():
            assert proc.poll() is None, proc.stderr.read().decode(errors="replace")[-3000:]
            assert time.monotonic() < end, "daemon did not start"
            time.sleep(0.3)
        children = _descendants(proc.pid)
        assert "p2pd" in children.values()
        proc.stdout.close()  # the reader dies: every later print / log line hits a broken pipe
        proc.stderr.close()
        time.sleep(2.0)  # let it log into the dead pipe a few times (DEBUG heartbeat lines)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=GONE_DEADLINE_S)
        assert proc.returncode == 0, proc.returncode  # a clean stop: not a BrokenPipeError (1) or exit 120
        assert not _wait_gone(children), "children outlived the daemon"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _kill_all([p for p in children if _stat(p) is not None])
