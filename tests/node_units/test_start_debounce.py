"""The start debounce waits for nodes still arriving, and only for them.

A pure unit over :class:`node.train.agreement.RunAgreement` with a stand-in host (its current epoch and view):
an epoch that already holds every live peer the host sees is pinned at once; one that lacks a peer the view
shows waits the debounce out, as before.
"""

import asyncio
from types import SimpleNamespace

import pytest

from node.train.agreement import RunAgreement


def _host(members, seen):
    epoch = SimpleNamespace(epoch=1, members=tuple(members), start_iteration=0)
    view = SimpleNamespace(alive=lambda: [SimpleNamespace(peer_id=p) for p in seen])
    return SimpleNamespace(peer_id="a", current_epoch=epoch, view=view)


def _agreement(host, debounce_s=60.0):
    return RunAgreement(host, "r", {}, min_members=2, start_debounce_s=debounce_s, agreement_timeout_s=10.0,
                        poll_s=0.01)


async def test_an_epoch_holding_everyone_seen_is_pinned_without_the_debounce():
    host = _host(["a", "b"], ["a", "b"])
    assert await asyncio.wait_for(_agreement(host).choose_epoch(), 5.0) is host.current_epoch


async def test_an_epoch_lacking_a_peer_in_view_waits_the_debounce():
    host = _host(["a", "b"], ["a", "b", "c"])  # c is arriving: a newer epoch will add it
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(_agreement(host).choose_epoch(), 0.5)
    assert await asyncio.wait_for(_agreement(host, debounce_s=0.1).choose_epoch(), 5.0) is host.current_epoch


async def test_a_host_without_a_view_keeps_the_debounce():
    host = _host(["a", "b"], [])
    del host.view
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(_agreement(host).choose_epoch(), 0.5)
