"""The relay's pure rules: who relays under ``--relay`` (and the flag reaching the daemon's config), and which
peer-id frames a relay stream accepts."""

import argparse

import pytest

from node.cli.node_cmd import add_node_run_arguments, config_from_args
from node.cli.train_args import add_training_arguments
from types import SimpleNamespace

from node.dataplane import relay as relay_module
from node.dataplane.relay import (MAX_PEER_FRAME_BYTES, RelayClient, RelayMode, decode_peer, encode_peer,
                                  serves_relay)

PEER = "QmPWCauA7pEjDZMvtty3hGWRyjgVcLdhSxMs9yKgWsU3SE"


def test_who_relays():
    assert serves_relay(RelayMode.AUTO, "direct") and serves_relay(RelayMode.AUTO, "unknown")
    assert not serves_relay(RelayMode.AUTO, "outbound_only")  # nobody could reach a NATed relay
    assert serves_relay(RelayMode.ON, "outbound_only") and not serves_relay(RelayMode.OFF, "direct")


def test_peer_frames_are_checked_before_use():
    assert decode_peer(encode_peer(PEER)) == PEER
    assert decode_peer(b"") == ""  # a hello
    for bad in (b"Qm0OIl" * 5, PEER.encode() + b"\n", b"../../etc", "Qmé".encode(), b"1" * (MAX_PEER_FRAME_BYTES + 1),
                b"\xff" * 40, b"short", b"Qm" + b"a" * 29):
        assert decode_peer(bad) is None, bad
    assert decode_peer(b"12D3KooW" + b"A" * 44) is not None  # an Ed25519 key's id (52 characters)


def test_relay_flag_reaches_the_daemon_config():
    def config(*argv):
        p = argparse.ArgumentParser()
        add_node_run_arguments(p)
        add_training_arguments(p)
        return config_from_args(p.parse_args(list(argv)))

    assert config().relay is RelayMode.AUTO
    assert config("--relay", "off").relay is RelayMode.OFF and config("--relay", "on").relay is RelayMode.ON
    with pytest.raises(SystemExit):
        config("--relay", "maybe")


def test_a_relay_is_passed_over_only_once_it_kept_failing(monkeypatch):
    """Every NATed node must pick the same relays: one that refuses streams while it starts (for seconds) stays
    chosen; one that failed every try for RELAY_DEAD_AFTER_S is passed over, then tried again."""
    now = [100.0]
    monkeypatch.setattr(relay_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    first, second, third = "Qm" + "a" * 44, "Qm" + "b" * 44, "Qm" + "c" * 44
    client = RelayClient(None, "run", relays=lambda: [first, second, third], needs_relay=lambda peer: True,
                         behind_nat=lambda: True, allow=None, max_frame_bytes=1 << 16)
    assert client.chosen() == [first, second] and client.route("x") == first
    client._failed(first, ConnectionError("handler not registered yet"))
    now[0] += relay_module.RELAY_DEAD_AFTER_S - 1
    client._failed(first, ConnectionError("handler not registered yet"))
    assert client.chosen() == [first, second]  # failing for a few seconds: still everyone's first relay
    now[0] += 1
    client._failed(first, ConnectionError("no route to host"))
    assert client.chosen() == [second, third] and client.route("x") == second
    now[0] += relay_module.RELAY_RETRY_S
    assert client.chosen() == [first, second]  # tried again
    client._failed(first, ConnectionError("no route to host"))
    assert client.chosen() == [second, third]  # still dead: passed over at once
