"""Stage state (weights + optimizer) from a live replica: for joiners and for diverged replicas.

Why a stream of our own and not hivemind's ``load_state_from_peers``: that API lives inside a
DecentralizedAverager, and ours are per (stage, epoch) and exist only while a stage has several
replicas; a node joining a single-replica stage, or one re-syncing after a failed all-reduce,
must still be able to fetch. So every trainer serves its stage's state on one binary stream
handler, ``skippipe/<run>/state/1``.

Request: one msgpack frame ``{"stage": s, "min_iteration": i}``. The server waits (bounded) until
it has committed iteration ``i`` and answers with a msgpack header ``{"ok", "stage", "iteration",
"checksum", "error"}`` followed by one frame holding ``torch.save({"model", "optimizer"})``: the
state right after committing ``iteration``. The snapshot is taken on the trainer's compute thread,
so it never interleaves with an optimizer step.
"""

from __future__ import annotations

import asyncio
import io
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional, Sequence, Tuple

import msgpack
import torch

from node.compat import import_hivemind

__all__ = ["StateSnapshot", "StateServer", "fetch_state", "StateTransferError", "state_handler_name"]

logger = logging.getLogger(__name__)

#: Largest request frame we read (a request is a few dozen bytes).
MAX_REQUEST_BYTES = 4096


def state_handler_name(run_id: str) -> str:
    return f"skippipe/{run_id}/state/1"


class StateTransferError(RuntimeError):
    """No live replica could hand over its state."""


@dataclass
class StateSnapshot:
    stage: int
    iteration: int  # last committed iteration the state belongs to (-1 = initial weights)
    checksum: float
    payload: bytes  # torch.save of {"model": ..., "optimizer": ...}

    def state_dict(self) -> dict:
        return torch.load(io.BytesIO(self.payload), map_location="cpu", weights_only=False)


#: ``snapshot(stage, min_iteration) -> StateSnapshot``; raises ValueError for a stage not held here
SnapshotFn = Callable[[int, int], Awaitable[StateSnapshot]]


class StateServer:
    """Serves ``snapshot`` on the state stream handler of one node's hivemind ``P2P``."""

    def __init__(self, p2p, run_id: str, snapshot: SnapshotFn, wait_timeout_s: float = 120.0,
                 allow: Optional[Callable[[str], bool]] = None):
        self.p2p, self.name, self._snapshot = p2p, state_handler_name(run_id), snapshot
        self.wait_timeout_s, self._allow = wait_timeout_s, allow
        self.served = 0
        self._started = False

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.name, self._handle)
        self._started = True

    async def _handle(self, stream_info, reader, writer) -> None:
        hivemind = import_hivemind()
        sender = str(stream_info.peer_id)
        try:
            if self._allow is not None and not self._allow(sender):
                logger.warning("state request from %s refused: peer not allowed", sender[-8:])
                return
            raw = await asyncio.wait_for(hivemind.p2p.P2P.receive_raw_data(reader), 30.0)
            if len(raw) > MAX_REQUEST_BYTES:
                return
            req = msgpack.unpackb(raw, raw=False)
            stage, min_it = int(req["stage"]), int(req["min_iteration"])
            try:
                snap = await asyncio.wait_for(self._snapshot(stage, min_it), self.wait_timeout_s)
            except (ValueError, asyncio.TimeoutError) as e:
                header = {"ok": False, "error": str(e) or type(e).__name__}
                await hivemind.p2p.P2P.send_raw_data(msgpack.packb(header), writer)
                return
            header = {"ok": True, "stage": snap.stage, "iteration": snap.iteration, "checksum": snap.checksum}
            await hivemind.p2p.P2P.send_raw_data(msgpack.packb(header), writer)
            await hivemind.p2p.P2P.send_raw_data(snap.payload, writer)
            self.served += 1
            logger.info("served stage %d state at iteration %d to %s (%d bytes)", snap.stage, snap.iteration,
                        sender[-8:], len(snap.payload))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a bad request must not take the server down
            logger.warning("state request from %s failed: %r", sender[-8:], e)
        finally:
            writer.close()

    async def close(self) -> None:
        if self._started:
            try:
                await self.p2p.remove_binary_stream_handler(self.name)
            except Exception:  # noqa: BLE001
                pass
            self._started = False


async def fetch_state(p2p, run_id: str, peers: Sequence[str], stage: int, min_iteration: int,
                      timeout_s: float = 180.0) -> Tuple[str, StateSnapshot]:
    """Ask ``peers`` in order for ``stage``'s state at committed iteration >= ``min_iteration``."""
    hivemind = import_hivemind()
    errors = []
    for peer in peers:
        try:
            _, reader, writer = await asyncio.wait_for(
                p2p.call_binary_stream_handler(hivemind.p2p.PeerID.from_base58(peer), state_handler_name(run_id)), 30.0)
            try:
                await hivemind.p2p.P2P.send_raw_data(msgpack.packb({"stage": stage, "min_iteration": min_iteration}),
                                                     writer)
                header = msgpack.unpackb(await asyncio.wait_for(hivemind.p2p.P2P.receive_raw_data(reader), timeout_s),
                                         raw=False)
                if not header.get("ok"):
                    errors.append(f"{peer[-8:]}: {header.get('error')}")
                    continue
                payload = await asyncio.wait_for(hivemind.p2p.P2P.receive_raw_data(reader), timeout_s)
                return peer, StateSnapshot(int(header["stage"]), int(header["iteration"]), float(header["checksum"]),
                                           payload)
            finally:
                writer.close()
        except Exception as e:  # noqa: BLE001 - try the next replica
            errors.append(f"{peer[-8:]}: {e!r}")
    raise StateTransferError(f"no replica of stage {stage} handed over its state: " + ("; ".join(errors) or "none alive"))
