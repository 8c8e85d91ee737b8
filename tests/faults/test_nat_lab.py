"""The NAT testbed behaves like home routers: checked with plain TCP sockets, no daemons.

A home host reaches the public hosts and appears from its router's public address; nobody outside
(public host or the other home) can open a connection to it, neither at its own address nor at its
router's; the plain router keeps the inside source port for every destination, the strict one picks a
different public port per destination (so an address one peer observed is useless to another).
"""

import socket
import subprocess

import pytest

from node.testing.nat import Home, NatKind, NatLab, nat_unavailable
from node.testing.netns import lab_leftovers, run_in_netns

WHY_NOT = nat_unavailable()
LAB = "spnl"
#: seconds a connection attempt that should fail is given (a drop shows as a timeout)
DIAL_TIMEOUT_S = 1.5


def _listen(address: str) -> socket.socket:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((address, 0))
    server.listen(8)
    server.settimeout(5)
    return server


def _dial(target: tuple[str, int], source_port: int = 0) -> socket.socket:
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    client.bind(("0.0.0.0", source_port))
    client.settimeout(DIAL_TIMEOUT_S)
    client.connect(target)
    return client


def _seen_from(lab: NatLab, client_host: int, servers: list[socket.socket], source_port: int) -> list[tuple]:
    """Connect from ``client_host`` (same inside port each time) to every server; the peers they saw."""
    seen = []
    for server in servers:
        client = run_in_netns(lab.namespace(client_host), _dial, server.getsockname(), source_port)
        conn, peer = server.accept()
        seen.append(peer)
        conn.close()
        client.close()
    return seen


def _cannot_dial(lab: NatLab, from_host: int, target: tuple[str, int]) -> bool:
    try:
        run_in_netns(lab.namespace(from_host), _dial, target).close()
    except OSError:
        return True
    return False


@pytest.mark.skipif(WHY_NOT is not None, reason=f"NAT lab unavailable: {WHY_NOT}")
@pytest.mark.xdist_group("netns")  # one lab at a time: labs share the host's root namespace
def test_home_hosts_are_behind_source_nat():
    lab = NatLab(LAB, public=2, homes=(Home(1, NatKind.PLAIN), Home(1, NatKind.STRICT)), subnet=91, rate_mbit=50)
    plain, strict = 2, 3
    with lab:
        servers = [run_in_netns(lab.namespace(i), _listen, lab.address(i)) for i in (0, 1)]
        try:
            plain_seen = _seen_from(lab, plain, servers, 41001)
            strict_seen = _seen_from(lab, strict, servers, 41002)
            for h in (0, 1):  # a neighbour on the router's segment routes straight at the home subnet
                subprocess.run(["ip", "-n", lab.namespace(0), "route", "add", f"{lab.address(plain + h).rsplit('.', 1)[0]}.0/24",
                                "via", lab.router_address(h)], check=True)
            home_servers = {i: run_in_netns(lab.namespace(i), _listen, "0.0.0.0") for i in (plain, strict)}
            try:
                blocked = {
                    (src, dst, target): _cannot_dial(lab, src, target)
                    for dst, server in home_servers.items()
                    for target in [(lab.address(dst), server.getsockname()[1]),
                                   (lab.router_address(lab.home_of(dst)[0]), server.getsockname()[1])]
                    for src in (0, plain if dst == strict else strict)
                }
            finally:
                for server in home_servers.values():
                    server.close()
        finally:
            for server in servers:
                server.close()
    assert lab_leftovers(LAB) == [] and f"{LAB}-r0" not in lab_leftovers(LAB)

    assert [a for a, _ in plain_seen] == [lab.router_address(0)] * 2, plain_seen
    assert [a for a, _ in strict_seen] == [lab.router_address(1)] * 2, strict_seen
    assert [p for _, p in plain_seen] == [41001, 41001], f"plain NAT should keep the port: {plain_seen}"
    assert strict_seen[0][1] != strict_seen[1][1], f"strict NAT should map per destination: {strict_seen}"
    assert all(blocked.values()), {k: v for k, v in blocked.items() if not v}
