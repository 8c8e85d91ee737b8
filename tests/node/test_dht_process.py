"""The DHT child process survives a request whose sender ended before the child fetched its reply handle.

Real ``hivemind.DHT`` processes on 127.0.0.1. The injected request unpickles to an ``EOFError``, as a real one
does when the resource sharer of its (ended) sender process has nothing left to hand over.
"""

import time

import pytest

import node.compat  # noqa: F401  (protobuf shim before hivemind)
import hivemind
from hivemind.utils import get_dht_time

from node.net.dht_process import SwarmDHT

pytestmark = pytest.mark.timeout(120)


def _handle_gone():
    raise EOFError("the sender's resource sharer closed the connection")


class _ReplyHandleOfAnEndedSender:
    def __reduce__(self):
        return _handle_gone, ()


def _send_orphaned_request(dht) -> None:
    dht._outer_pipe.send(("_get", [], {"key": _ReplyHandleOfAnEndedSender(), "latest": True}))


def _gone_within(dht, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not dht.is_alive():
            return True
        time.sleep(0.1)
    return False


def test_an_orphaned_request_leaves_the_dht_serving():
    dht = SwarmDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        _send_orphaned_request(dht)
        assert dht.store("key", "value", expiration_time=get_dht_time() + 60)
        assert dht.get("key", latest=True).value == "value"
        assert dht.is_alive()
    finally:
        dht.shutdown()


def test_hivemind_alone_dies_of_it():
    """Why the shim exists (if this starts failing, hivemind handles it itself and the shim can go)."""
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        _send_orphaned_request(dht)
        assert _gone_within(dht, 30.0)
    finally:
        if dht.is_alive():
            dht.shutdown()
