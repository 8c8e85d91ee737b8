"""A hostile data-plane peer for tests: builds bad frames and writes them onto real hivemind streams.

It talks to a node's data-plane handler directly (``P2P.call_binary_stream_handler`` + raw
8-byte-length frames), so it can send what :class:`node.dataplane.transport.DataPlane` never would: random
bytes, broken msgpack, a length header that promises gigabytes, and well-formed messages that are
wrong for the run.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

import msgpack
import torch

import node.compat  # noqa: F401  (before hivemind)
from node.compat import import_hivemind
from node.dataplane.transport import handler_name
from protocol import ActivationMessage, GradientMessage, IterationDone, MicrobatchId, TensorFrame, encode

__all__ = [
    "HostilePeer",
    "frame",
    "activation",
    "gradient",
    "iteration_done",
    "random_bytes",
    "malformed_msgpack",
    "connect",
    "LOCAL",
]

logger = logging.getLogger(__name__)

#: Listen on loopback only, ephemeral port.
LOCAL = ["/ip4/127.0.0.1/tcp/0"]


def frame(shape: Sequence[int], fill: float = 0.0, dtype: torch.dtype = torch.float32) -> TensorFrame:
    """A tensor frame of ``shape`` filled with ``fill`` (NaN and inf included)."""
    return TensorFrame.from_tensor(torch.full(tuple(shape), fill, dtype=dtype))


def _mb(run: str, data_node: str, epoch: int, iteration: int, index: int, attempt: int) -> MicrobatchId:
    return MicrobatchId(run, epoch, iteration, data_node, index, attempt)


def activation(run: str, route: Tuple[str, ...], hop: int, tensor: TensorFrame, *, epoch: int = 0,
               iteration: int = 0, index: int = 0, attempt: int = 0) -> ActivationMessage:
    """An activation for ``route[hop]``; the data node is ``route[0]``."""
    return ActivationMessage(_mb(run, route[0], epoch, iteration, index, attempt), hop, tuple(route), tensor)


def gradient(run: str, route: Tuple[str, ...], hop: int, tensor: TensorFrame, *, epoch: int = 0,
             iteration: int = 0, index: int = 0, attempt: int = 0) -> GradientMessage:
    return GradientMessage(_mb(run, route[0], epoch, iteration, index, attempt), hop, tuple(route), tensor)


def iteration_done(run: str, data_node: str, iteration: int, epoch: int = 0) -> IterationDone:
    return IterationDone(run, epoch, iteration, data_node, {}, 0)


def random_bytes(rng: random.Random, max_len: int = 4096) -> bytes:
    return bytes(rng.getrandbits(8) for _ in range(rng.randint(1, max_len)))


def malformed_msgpack(rng: random.Random, valid: bytes) -> bytes:
    """Msgpack that decodes but is no envelope, or a valid envelope cut short, or with a wrong type tag."""
    choice = rng.randrange(3)
    if choice == 0:
        return msgpack.packb({"v": 1, "t": "activation", "b": [1, 2, 3]})
    if choice == 1:
        return valid[: max(1, rng.randrange(len(valid)))]
    return msgpack.packb({"v": 1, "t": "no_such_message", "b": {}})


async def connect(p2p, others: Sequence) -> None:
    """Dial every P2P in ``others`` from ``p2p`` (the way node.launch.inproc_swarm.InProcessSwarm wires its nodes)."""
    for other in others:
        await p2p._client.connect(other.peer_id, other._visible_maddrs)


@dataclass
class HostilePeer:
    """One hivemind P2P that keeps a raw stream to each target's data-plane handler."""

    p2p: object
    run_id: str
    _writers: Dict[str, object] = field(default_factory=dict)
    sent: int = 0
    failed: int = 0

    @classmethod
    async def create(cls, run_id: str, initial_peers: Sequence[str] = ()) -> "HostilePeer":
        hivemind = import_hivemind()
        p2p = await hivemind.p2p.P2P.create(host_maddrs=LOCAL, initial_peers=list(initial_peers))
        return cls(p2p, run_id)

    @property
    def peer_id(self) -> str:
        return str(self.p2p.peer_id)

    async def _writer(self, peer: str):
        hivemind = import_hivemind()
        writer = self._writers.get(peer)
        if writer is None:
            _, _, writer = await self.p2p.call_binary_stream_handler(
                hivemind.p2p.PeerID.from_base58(peer), handler_name(self.run_id))
            self._writers[peer] = writer
        return writer

    def _drop(self, peer: str) -> None:
        writer = self._writers.pop(peer, None)
        if writer is not None:
            writer.close()

    async def send(self, peer: str, data: bytes, attempts: int = 2) -> bool:
        """Write one frame; on a broken stream, reopen (``attempts`` tries in all). False when it could
        not be written (a receiver that refuses a frame mid-write resets the stream)."""
        hivemind = import_hivemind()
        for _ in range(attempts):
            try:
                await hivemind.p2p.P2P.send_raw_data(data, await self._writer(peer))
                self.sent += 1
                return True
            except Exception as e:  # noqa: BLE001 - the receiver may close our stream on purpose
                logger.debug("hostile send to %s failed: %r", peer[-8:], e)
                self._drop(peer)
        self.failed += 1
        return False

    async def send_message(self, peer: str, msg: object) -> bool:
        return await self.send(peer, encode(msg))

    async def send_length_header(self, peer: str, length: int) -> bool:
        """Promise a ``length``-byte frame and send nothing else; the stream is then abandoned."""
        hivemind = import_hivemind()
        try:
            writer = await self._writer(peer)
            writer.write(length.to_bytes(hivemind.p2p.P2P.HEADER_LEN, hivemind.p2p.P2P.BYTEORDER))
            await writer.drain()
            self.sent += 1
            return True
        except Exception:  # noqa: BLE001
            self.failed += 1
            return False
        finally:
            self._writers.pop(peer, None)  # keep it open (the receiver closes it) but never reuse it

    async def close(self) -> None:
        for peer in list(self._writers):
            self._drop(peer)
        try:
            await asyncio.wait_for(self.p2p.shutdown(), 30)
        except Exception:  # noqa: BLE001
            pass

