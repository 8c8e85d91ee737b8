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


# --------------------------------------------------------------------------- files and numbers that used to crash or hang
GEO = "tests/scheduler/data/geo-distributed-12.json"


def test_garbage_identity_file(tmp_path):
    (tmp_path / "id.key").write_bytes(b"garbage\n" + bytes(range(256)))
    proc = run_cli("node", "run", "--stages", "0", "--rpc-port", "-1", "--identity", str(tmp_path / "id.key"))
    _assert_one_error(proc, str(tmp_path / "id.key"))


def test_binary_profile_to_plan(tmp_path):
    (tmp_path / "p.json").write_bytes(bytes(range(128, 256)) * 8)
    proc = run_cli("plan", "--profile", str(tmp_path / "p.json"), "--nodes", "4", "--stage-sizes", "2,2",
                   "--path-length", "2")  # fmt: skip
    _assert_one_error(proc, "not a JSON text file")


def test_binary_file_to_simulate(tmp_path):
    (tmp_path / "s.json").write_bytes(bytes(range(128, 256)) * 8)
    proc = run_cli("simulate", str(tmp_path / "s.json"))
    _assert_one_error(proc, "not a JSON text file")


def test_simulate_a_billion_microbatches_is_refused_up_front(tmp_path):
    import json

    doc = {"stages": [[0], [1], [2]], "path_length": 2, "memory": 1,
           "paths": [{"data_node": 0, "route": [0, 1], "microbatches": 500_000_000},
                     {"data_node": 0, "route": [0, 2], "microbatches": 500_000_000}],
           "cost": {"compute_s": [0.1, 0.1, 0.1], "link_s": [[0.0, 0.1, 0.1], [0.1, 0.0, 0.1], [0.1, 0.1, 0.0]]}}
    (tmp_path / "s.json").write_text(json.dumps(doc))
    proc = run_cli("simulate", str(tmp_path / "s.json"), timeout=60)  # it used to run for hours
    _assert_one_error(proc, "can be simulated")


@pytest.mark.parametrize("args, needle", [
    (("node", "run", "--gossip-port", "-5"), "--gossip-port must be a TCP port"),
    (("node", "run", "--gossip-port", "70000"), "--gossip-port must be a TCP port"),
    (("node", "run", "--num-stages", "1000000"), "--num-stages must be at most"),
    (("swarm", "status", "--rpc", "garbage"), "http://HOST:PORT"),
    (("plan", "--profile", GEO, "--nodes", "1000000", "--stage-sizes", "2,2", "--path-length", "2"), "--nodes"),
    (("plan", "--profile", GEO, "--nodes", "4", "--stage-sizes", "2,2", "--path-length", "2", "--microbatches",
      "1000000000"), "--microbatches"),
])
def test_bad_numbers_through_the_real_cli(tmp_path, args, needle):
    proc = run_cli(*args, "--identity", str(tmp_path / "id.key")) if args[0] == "node" else run_cli(*args)
    _assert_one_error(proc, needle)
    assert proc.returncode == 2
