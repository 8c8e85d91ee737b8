"""Control-plane gossip: py-libp2p GossipSub hosted in the daemon's asyncio loop.

py-libp2p is a trio library; the daemon is asyncio (uvloop, because hivemind is). Trio's guest
mode runs the trio scheduler *inside* the asyncio loop on the same thread, so there is no second
thread competing for the GIL and hand-offs are plain function calls:

* asyncio -> trio: ``TrioToken.run_sync_soon(send_channel.send_nowait, command)``;
* trio -> asyncio: the trio side calls the asyncio-side callback directly (same thread).

Measured pitfalls this module works around (see ``/work/shared/notes/dependencies.md``):

* GossipSub's spam protection allows 10 msg/s per peer and topic and drops the rest; its
  eclipse protection wants peers from 3 distinct IPs (impossible on loopback). Both are off: our
  messages are signed by pubsub and validated by the daemon anyway.
* outbound queues and subscription channels hold 32 messages and drop the rest silently. We
  coalesce everything published within :data:`COALESCE_WINDOW_S` on one topic into one gossip
  message, raise the subscription channel size, and drain subscriptions in dedicated tasks.
* security is Noise, muxer yamux only (mplex is ~10 MB/s and p2pd does not speak it).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import msgpack
import multiaddr
import trio

__all__ = ["GossipMessage", "GossipService", "COALESCE_WINDOW_S"]

logger = logging.getLogger(__name__)

#: Protocol id of GossipSub v1.1 (what py-libp2p and go-libp2p both speak).
GOSSIPSUB_PROTOCOL_ID = "/meshsub/1.1.0"
#: Messages published on one topic within this window travel as one gossip message.
COALESCE_WINDOW_S = 0.05
#: Subscription channel capacity (py-libp2p's default of 32 drops bursts silently).
SUBSCRIPTION_CHANNEL_SIZE = 4096
#: GossipSub mesh degree (target, low, high) and its heartbeat in seconds (an int in py-libp2p).
MESH_DEGREE = (6, 4, 12)
GOSSIP_HEARTBEAT_S = 1
#: Seconds allowed for one outgoing connection attempt.
CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class GossipMessage:
    """One application payload received on a topic, with the gossip peer id that signed it."""

    topic: str
    data: bytes
    from_gossip_id: str


class GossipService:
    """A py-libp2p host + GossipSub router running as a trio guest in the current asyncio loop.

    ``on_message`` is called on the asyncio thread for every payload received on a subscribed
    topic, including our own publications (callers filter by ``from_gossip_id``).
    """

    def __init__(
        self,
        key_pair,
        listen_maddrs: Sequence[str],
        topics: Sequence[str],
        on_message: Callable[[GossipMessage], None],
        announce_maddrs: Sequence[str] = (),
    ):
        self._key_pair = key_pair
        self._listen_maddrs = [multiaddr.Multiaddr(m) for m in listen_maddrs]
        self._announce_maddrs = list(announce_maddrs)
        self._topics = list(topics)
        self._on_message = on_message
        self._loop: asyncio.AbstractEventLoop | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._commands: trio.MemorySendChannel | None = None
        self._ready: asyncio.Future | None = None
        self._done: asyncio.Future | None = None
        self._pending: dict[str, list[bytes]] = {}
        self._flush_scheduled: set[str] = set()
        self._host = None
        self._pubsub = None
        self.peer_id: str = ""
        self.maddrs: list[str] = []
        self.messages_in = 0
        self.messages_out = 0

    # ----------------------------------------------------------------- asyncio-side API
    async def start(self) -> None:
        """Start the trio guest run and wait until the host listens and topics are subscribed."""
        import libp2p.pubsub.pubsub as pubsub_module

        pubsub_module.SUBSCRIPTION_CHANNEL_SIZE = SUBSCRIPTION_CHANNEL_SIZE
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._done = self._loop.create_future()

        def done_callback(outcome) -> None:
            if not self._done.done():
                self._done.set_result(outcome)
            if not self._ready.done():
                try:
                    outcome.unwrap()
                    self._ready.set_exception(RuntimeError("gossip host stopped before it was ready"))
                except BaseException as e:  # noqa: BLE001 - forwarded to the awaiting caller
                    self._ready.set_exception(RuntimeError(f"gossip host failed to start: {e!r}"))

        trio.lowlevel.start_guest_run(
            self._trio_main,
            run_sync_soon_threadsafe=self._loop.call_soon_threadsafe,
            run_sync_soon_not_threadsafe=self._loop.call_soon,
            done_callback=done_callback,
            host_uses_signal_set_wakeup_fd=True,
        )
        await self._ready

    def publish(self, topic: str, data: bytes) -> None:
        """Queue ``data`` for ``topic``; flushed (coalesced) after :data:`COALESCE_WINDOW_S`."""
        if self._commands is None:
            return
        self._pending.setdefault(topic, []).append(bytes(data))
        if topic not in self._flush_scheduled:
            self._flush_scheduled.add(topic)
            self._loop.call_later(COALESCE_WINDOW_S, self._flush, topic)

    async def connect(self, peer_id: str, maddrs: Sequence[str]) -> bool:
        """Dial a gossip peer; returns whether the connection is up."""
        if self._commands is None or not maddrs:
            return False
        fut = self._loop.create_future()
        self._send_command(("connect", peer_id, list(maddrs), fut))
        return await fut

    def connected_peers(self) -> set[str]:
        if self._host is None:
            return set()
        return {p.to_base58() for p in self._host.get_network().connections.keys()}

    async def stop(self) -> None:
        """Flush pending messages, close the host and wait for the trio run to end."""
        if self._commands is None:
            return
        for topic in list(self._pending):
            self._flush(topic)
        self._send_command(("stop",))
        try:
            await asyncio.wait_for(asyncio.shield(self._done), timeout=5.0)
        except asyncio.TimeoutError:
            logger.warning("gossip host did not stop within 5 s")
        self._commands = None

    # ----------------------------------------------------------------- internals
    def _send_command(self, command: tuple) -> None:
        try:
            self._token.run_sync_soon(self._commands.send_nowait, command)
        except trio.RunFinishedError:
            fut = command[-1] if command[0] == "connect" else None
            if fut is not None and not fut.done():
                fut.set_result(False)

    def _flush(self, topic: str) -> None:
        self._flush_scheduled.discard(topic)
        batch = self._pending.pop(topic, [])
        if batch and self._commands is not None:
            self._send_command(("publish", topic, msgpack.packb(batch, use_bin_type=True)))

    async def _trio_main(self) -> None:
        from libp2p import new_host
        from libp2p.crypto.x25519 import create_new_key_pair as create_x25519
        from libp2p.custom_types import TProtocol
        from libp2p.peer.id import ID
        from libp2p.peer.peerinfo import PeerInfo
        from libp2p.pubsub.gossipsub import GossipSub
        from libp2p.pubsub.pubsub import Pubsub
        from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
        from libp2p.security.noise.transport import Transport as NoiseTransport
        from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
        from libp2p.stream_muxer.yamux.yamux import Yamux
        from libp2p.tools.anyio_service import background_trio_service

        self._token = trio.lowlevel.current_trio_token()
        send, receive = trio.open_memory_channel(float("inf"))
        host = new_host(
            key_pair=self._key_pair,
            sec_opt={
                TProtocol(NOISE_PROTOCOL_ID): NoiseTransport(self._key_pair, noise_privkey=create_x25519().private_key)
            },
            muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
            listen_addrs=self._listen_maddrs,
            announce_addrs=[multiaddr.Multiaddr(m) for m in self._announce_maddrs] or None,
        )
        degree, low, high = MESH_DEGREE
        router = GossipSub(
            protocols=[TProtocol(GOSSIPSUB_PROTOCOL_ID)],
            degree=degree,
            degree_low=low,
            degree_high=high,
            heartbeat_interval=GOSSIP_HEARTBEAT_S,
            heartbeat_initial_delay=0.1,
            spam_protection_enabled=False,
            eclipse_protection_enabled=False,
        )
        pubsub = Pubsub(host, router)
        async with host.run(listen_addrs=self._listen_maddrs), trio.open_nursery() as nursery:
            async with background_trio_service(pubsub), background_trio_service(router):
                await pubsub.wait_until_ready()
                self._host, self._pubsub = host, pubsub
                for topic in self._topics:
                    sub = await pubsub.subscribe(topic)
                    nursery.start_soon(self._drain, topic, sub)
                self.peer_id = host.get_id().to_base58()
                self.maddrs = [str(a) for a in host.get_addrs()]
                self._commands = send
                self._ready.set_result(None)
                async for command in receive:
                    kind = command[0]
                    if kind == "stop":
                        break
                    if kind == "publish":
                        nursery.start_soon(self._publish, pubsub, command[1], command[2])
                    elif kind == "connect":
                        _, peer_id, maddrs, fut = command
                        info = PeerInfo(ID.from_base58(peer_id), [multiaddr.Multiaddr(m) for m in maddrs])
                        nursery.start_soon(self._connect, host, info, fut)
                nursery.cancel_scope.cancel()

    async def _publish(self, pubsub, topic: str, data: bytes) -> None:
        try:
            await pubsub.publish(topic, data)
            self.messages_out += 1
        except Exception as e:  # noqa: BLE001 - a failed publish must not kill the host
            logger.debug("gossip publish on %s failed: %r", topic, e)

    async def _connect(self, host, info, fut: asyncio.Future) -> None:
        ok = False
        try:
            with trio.move_on_after(CONNECT_TIMEOUT_S):
                await host.connect(info)
                ok = True
        except Exception as e:  # noqa: BLE001 - unreachable peers are routine
            logger.debug("gossip connect to %s failed: %r", info.peer_id, e)
        if not fut.done():
            fut.set_result(ok)

    async def _drain(self, topic: str, subscription) -> None:
        """Empty the subscription as fast as it fills: py-libp2p drops on a full channel."""
        from libp2p.peer.id import ID

        while True:
            message = await subscription.get()
            try:
                sender = ID(message.from_id).to_base58()
                payloads = msgpack.unpackb(message.data, raw=False)
                if not isinstance(payloads, list):
                    continue
            except Exception:  # noqa: BLE001 - garbage from the network
                continue
            for payload in payloads:
                if isinstance(payload, bytes):
                    self.messages_in += 1
                    try:
                        self._on_message(GossipMessage(topic, payload, sender))
                    except Exception:  # noqa: BLE001 - a bad handler must not stop draining
                        logger.exception("gossip handler failed on topic %s", topic)
