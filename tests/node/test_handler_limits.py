"""Every libp2p stream handler bounds what one peer can make it hold: size, time, and (with access control) who.

A real process (:mod:`tests.node.handler_host`) serves the link probe (``skippipe/ping/1``), the stage
state transfer and the node RPC on its own p2pd; an outsider on another real P2P sends length headers
that claim 2 GiB (followed by 256 MiB of actual bytes), half frames and random garbage. The host's
RSS must stay within a generous bound (a handler that trusts the header buffers every byte sent: the
bound fails), half frames must be cut off (within a generous wait), and honest calls must still work.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import node.compat  # noqa: F401  (before hivemind)
from hivemind.p2p import P2P, PeerID

from node.dataplane.state_transfer import StateTransferError, fetch_state, state_handler_name
from node.net.framing import read_frame, write_frame
from node.net.ping import PING_PROTOCOL, probe_link
from node.net.rpc import RPC_PROTOCOL, RpcCallError, call_p2p

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]
RUN_ID = "fuzz"  # tests.node.handler_host.RUN_ID
#: What a claimed 2 GiB frame may cost the host (generous: a buffering handler grows by the 256 MiB sent).
RSS_BOUND_MB = 200
SENT_AFTER_HEADER = 256 << 20
CLAIMED = 2 << 30
#: Generous upper wait for a handler to drop a stalled stream (the handlers' limits are 10-30 s).
STALL_DEADLINE_S = 120.0


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@contextlib.contextmanager
def _host(tmp_path: Path, allowed: tuple[str, ...] = ()):
    ready = tmp_path / f"host-{len(allowed)}.json"
    log = open(tmp_path / f"host-{len(allowed)}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "tests.node.handler_host", str(ready), *allowed], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        end = time.monotonic() + 90
        while not ready.exists():
            assert proc.poll() is None, (tmp_path / f"host-{len(allowed)}.log").read_text()
            assert time.monotonic() < end, "handler host did not start"
            time.sleep(0.2)
        yield json.loads(ready.read_text())
    finally:
        proc.kill()
        proc.wait()
        log.close()


async def _outsider(maddr: str) -> P2P:
    return await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[maddr])


async def _claim_huge_frame(p2p: P2P, peer: PeerID, protocol: str) -> int:
    """Open a stream, announce a 2 GiB frame, push 256 MiB; returns the bytes the stream took."""
    _, reader, writer = await p2p.call_binary_stream_handler(peer, protocol)
    sent = 0
    try:
        writer.write(CLAIMED.to_bytes(8, "big"))
        chunk = bytes(1 << 20)
        while sent < SENT_AFTER_HEADER:
            writer.write(chunk)
            await asyncio.wait_for(writer.drain(), 30)
            sent += len(chunk)
    except (ConnectionError, asyncio.TimeoutError, OSError):
        pass
    finally:
        writer.close()
    return sent


async def _garbage(p2p: P2P, peer: PeerID, protocol: str, rounds: int = 20) -> None:
    rng = __import__("random").Random(7)
    for i in range(rounds):
        try:
            _, reader, writer = await p2p.call_binary_stream_handler(peer, protocol)
            if i % 2:
                writer.write(rng.randbytes(rng.randrange(1, 4096)))  # random header and body
            else:  # a plausible small frame of garbage
                body = rng.randbytes(rng.randrange(1, 512))
                writer.write(len(body).to_bytes(8, "big") + body)
            await writer.drain()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(reader.read(1 << 16), 5)
            writer.close()
        except (ConnectionError, OSError):
            pass


async def _stalled_stream_is_cut(p2p: P2P, peer: PeerID, protocol: str) -> bool:
    """Send half a frame and wait (generously) for the handler to close the stream."""
    _, reader, writer = await p2p.call_binary_stream_handler(peer, protocol)
    try:
        writer.write((100).to_bytes(8, "big") + b"x" * 10)
        await writer.drain()
        end = time.monotonic() + STALL_DEADLINE_S
        while time.monotonic() < end:
            try:
                data = await asyncio.wait_for(reader.read(1 << 16), 5)
            except asyncio.TimeoutError:
                continue
            if not data:
                return True  # EOF: the handler gave up on us
        return False
    except (ConnectionError, OSError):
        return True
    finally:
        writer.close()


async def _ping(p2p: P2P, peer: PeerID) -> bytes:
    _, reader, writer = await p2p.call_binary_stream_handler(peer, PING_PROTOCOL)
    try:
        await write_frame(writer, b"p")
        return await read_frame(reader, 64, 30)
    finally:
        writer.close()


def test_handlers_survive_huge_frames_garbage_and_stalls(tmp_path):
    with _host(tmp_path) as info:
        pid, peer = info["pid"], PeerID.from_base58(info["peer_id"])

        async def main():
            p2p = await _outsider(info["maddr"])
            try:
                protocols = [PING_PROTOCOL, state_handler_name(RUN_ID), RPC_PROTOCOL]
                before = _rss_mb(pid)
                for protocol in protocols:
                    await _claim_huge_frame(p2p, peer, protocol)
                    await asyncio.sleep(1.0)  # let the host process whatever it accepted
                    grown = _rss_mb(pid) - before
                    assert grown < RSS_BOUND_MB, f"{protocol}: host RSS grew by {grown:.0f} MB after a 2 GiB claim"
                for protocol in protocols:
                    await _garbage(p2p, peer, protocol)
                cut = await asyncio.gather(*(_stalled_stream_is_cut(p2p, peer, p) for p in protocols))
                assert all(cut), dict(zip(protocols, cut))
                # honest calls still work
                assert await _ping(p2p, peer) == b"p"
                rtt_ms, bandwidth = await probe_link(p2p, peer)
                assert rtt_ms > 0 and bandwidth > 0
                _, snap = await fetch_state(p2p, RUN_ID, [info["peer_id"]], 0, 3, timeout_s=60, max_state_bytes=2 << 20)
                assert snap.iteration == 3 and len(snap.payload) == 1 << 20
                assert await call_p2p(p2p, peer, "echo", {"x": 1}, timeout=30) == {"x": 1}
                assert _rss_mb(pid) - before < RSS_BOUND_MB
            finally:
                await p2p.shutdown()

        asyncio.run(main())


def test_members_only_when_access_control_is_on(tmp_path):
    async def make_member():
        return await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])

    async def main():
        member = await make_member()
        try:
            with _host(tmp_path, (member.peer_id.to_base58(),)) as info:
                peer = PeerID.from_base58(info["peer_id"])
                await member._client.connect(peer, [__import__("multiaddr").Multiaddr(info["maddr"].split("/p2p/")[0])])
                outsider = await _outsider(info["maddr"])
                try:
                    # the outsider: no echo, no state, only the public hello
                    with pytest.raises((asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError)):
                        await _ping(outsider, peer)
                    with pytest.raises(StateTransferError):
                        await fetch_state(outsider, RUN_ID, [info["peer_id"]], 0, 0, timeout_s=30,
                                          max_state_bytes=2 << 20)
                    with pytest.raises(RpcCallError, match="access denied"):
                        await call_p2p(outsider, peer, "echo", {"x": 1}, timeout=30)
                    assert await call_p2p(outsider, peer, "hello", {"x": 2}, timeout=30) == {"x": 2}
                    # the member: everything
                    assert await _ping(member, peer) == b"p"
                    _, snap = await fetch_state(member, RUN_ID, [info["peer_id"]], 0, 0, timeout_s=60,
                                                max_state_bytes=2 << 20)
                    assert len(snap.payload) == 1 << 20
                    assert await call_p2p(member, peer, "echo", {"x": 3}, timeout=30) == {"x": 3}
                finally:
                    await outsider.shutdown()
        finally:
            await member.shutdown()

    asyncio.run(main())
