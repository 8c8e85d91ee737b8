"""The relay's pure rules: who relays under ``--relay`` (and the flag reaching the daemon's config), and which
peer-id frames a relay stream accepts."""

import argparse

import pytest

from node.cli.node_cmd import add_node_run_arguments, config_from_args
from node.cli.train_args import add_training_arguments
from node.dataplane.relay import MAX_PEER_FRAME_BYTES, RelayMode, decode_peer, encode_peer, serves_relay

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
