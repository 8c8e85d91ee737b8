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

Limits (a hostile peer reaches this handler like any other): the request frame is read through
:func:`node.net.framing.read_frame` (its length is checked before any of the body is read, and
it must arrive within :data:`REQUEST_TIMEOUT_S`); with ``allow`` (``Daemon.is_peer_allowed``)
only members are served; at most :data:`MAX_CONCURRENT_SERVES` snapshots are sent at once (each
is a full copy of the stage's state). The client bounds the answer the same way.
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
from node.net.framing import FrameTooLarge, read_frame, write_frame

__all__ = ["StateSnapshot", "StateServer", "fetch_state", "StateTransferError", "state_handler_name"]

logger = logging.getLogger(__name__)

#: Largest request frame we read (a request is a few dozen bytes).
MAX_REQUEST_BYTES = 4096
#: Seconds a caller has to send its whole request.
REQUEST_TIMEOUT_S = 30.0
#: Largest answer header a client reads.
MAX_HEADER_BYTES = 64 * 1024
#: Largest state payload a client accepts (the 500m model's fp32 weights + AdamW state are ~6 GB).
MAX_STATE_BYTES = 16 << 30
#: Snapshots served at the same time; further requests wait for a slot (within the wait timeout).
MAX_CONCURRENT_SERVES = 2
#: One "refused" log line per this many refused requests.
REFUSED_LOG_EVERY = 100


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
        self.refused = 0  # requests refused: not allowed, oversized, late or malformed
        self._slots = asyncio.Semaphore(MAX_CONCURRENT_SERVES)
        self._started = False

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.name, self._handle)
        self._started = True

    async def _handle(self, stream_info, reader, writer) -> None:
        sender = str(stream_info.peer_id)
        try:
            if self._allow is not None and not self._allow(sender):
                self._refuse(sender, "peer not allowed")
                return
            raw = await read_frame(reader, MAX_REQUEST_BYTES, REQUEST_TIMEOUT_S)
            req = msgpack.unpackb(raw, raw=False)
            if not isinstance(req, dict):
                raise ValueError("request is not a map")
            stage, min_it = int(req["stage"]), int(req["min_iteration"])
            try:
                async with self._slots:
                    snap = await asyncio.wait_for(self._snapshot(stage, min_it), self.wait_timeout_s)
                    header = {"ok": True, "stage": snap.stage, "iteration": snap.iteration, "checksum": snap.checksum}
                    await write_frame(writer, msgpack.packb(header))
                    await write_frame(writer, snap.payload)
            except (ValueError, asyncio.TimeoutError) as e:
                await write_frame(writer, msgpack.packb({"ok": False, "error": str(e) or type(e).__name__}))
                return
            self.served += 1
            logger.info("served stage %d state at iteration %d to %s (%d bytes)", snap.stage, snap.iteration,
                        sender[-8:], len(snap.payload))
        except asyncio.CancelledError:
            raise
        except (FrameTooLarge, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
            self._refuse(sender, repr(e))
        except Exception as e:  # noqa: BLE001 - a bad request must not take the server down
            self._refuse(sender, f"malformed request: {e!r}")
        finally:
            writer.close()

    def _refuse(self, sender: str, why: str) -> None:
        self.refused += 1
        if self.refused % REFUSED_LOG_EVERY == 1:
            logger.warning("state request from %s refused: %s (%d refused so far)", sender[-8:], why[:200], self.refused)

    async def close(self) -> None:
        if self._started:
            try:
                await self.p2p.remove_binary_stream_handler(self.name)
            except Exception:  # noqa: BLE001
                pass
            self._started = False


async def fetch_state(p2p, run_id: str, peers: Sequence[str], stage: int, min_iteration: int,
                      timeout_s: float = 180.0, max_state_bytes: int = MAX_STATE_BYTES) -> Tuple[str, StateSnapshot]:
    """Ask ``peers`` in order for ``stage``'s state at committed iteration >= ``min_iteration``."""
    hivemind = import_hivemind()
    errors = []
    for peer in peers:
        try:
            _, reader, writer = await asyncio.wait_for(
                p2p.call_binary_stream_handler(hivemind.p2p.PeerID.from_base58(peer), state_handler_name(run_id)), 30.0)
            try:
                await write_frame(writer, msgpack.packb({"stage": stage, "min_iteration": min_iteration}))
                header = msgpack.unpackb(await read_frame(reader, MAX_HEADER_BYTES, timeout_s), raw=False)
                if not isinstance(header, dict):
                    raise ValueError("answer header is not a map")
                if not header.get("ok"):
                    errors.append(f"{peer[-8:]}: {str(header.get('error'))[:200]}")
                    continue
                payload = await read_frame(reader, max_state_bytes, timeout_s)
                return peer, StateSnapshot(int(header["stage"]), int(header["iteration"]), float(header["checksum"]),
                                           payload)
            finally:
                writer.close()
        except Exception as e:  # noqa: BLE001 - try the next replica
            errors.append(f"{peer[-8:]}: {e!r}")
    raise StateTransferError(f"no replica of stage {stage} handed over its state: " + ("; ".join(errors) or "none alive"))
