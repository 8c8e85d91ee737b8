"""Bad input to ``skippipe node run`` / ``swarm status``: one ``error:`` line, non-zero exit, no traceback."""

from __future__ import annotations

import socket

import pytest

from tests.node.helpers import error_lines, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

#: A syntactically valid peer id nobody listens as.
SOME_PEER_ID = "QmZXyQWcbjQbgw3y7XBM9TLvwjtyLEDE3ZitNhf3MvfhQt"


def _assert_one_error(proc, needle: str) -> None:
    assert proc.returncode != 0, proc.stdout + proc.stderr
    errors = error_lines(proc)
    assert len(errors) == 1, proc.stderr
    assert needle in errors[0], errors[0]
    assert "Traceback" not in proc.stderr + proc.stdout


def test_unreachable_initial_peer(tmp_path):
    with socket.socket() as s:  # a port that is certainly closed: bound but not listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        proc = run_cli("node", "run", "--initial-peers", f"/ip4/127.0.0.1/tcp/{port}/p2p/{SOME_PEER_ID}",
                       "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity", str(tmp_path / "id.key"))  # fmt: skip
    _assert_one_error(proc, "cannot reach")


def test_initial_peer_without_peer_id(tmp_path):
    proc = run_cli("node", "run", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--identity", str(tmp_path / "id.key"))
    _assert_one_error(proc, "/p2p/")


def test_host_port_in_use(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = run_cli("node", "run", "--stages", "0", "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}",
                       "--identity", str(tmp_path / "id.key"))  # fmt: skip
    _assert_one_error(proc, "not available")


def test_new_swarm_with_initial_peers(tmp_path):
    proc = run_cli("node", "run", "--new-swarm", "--initial-peers", f"/ip4/127.0.0.1/tcp/1/p2p/{SOME_PEER_ID}",
                   "--identity", str(tmp_path / "id.key"))  # fmt: skip
    _assert_one_error(proc, "mutually exclusive")


def test_status_of_nothing():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        proc = run_cli("swarm", "status", "--rpc", f"http://127.0.0.1:{port}")
    _assert_one_error(proc, "cannot reach")


def test_status_without_target():
    proc = run_cli("swarm", "status")
    _assert_one_error(proc, "--rpc")
