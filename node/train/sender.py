"""The one way a trainer sends to a peer: hops (activations, gradients), control messages
(``IterationDone``, ``HopFailure``) and norm reports all go through :class:`HopSender`.

A send never raises: a peer the send fails to is suspected (:class:`node.train.health.PeerHealth`),
and the caller decides what a failed hop means (:mod:`node.train.recovery`).
"""

from __future__ import annotations

import asyncio
from typing import Callable, Optional

from node.dataplane.transport import DataPlaneError

__all__ = ["HopSender"]

#: Seconds :meth:`HopSender.close` waits for sends still in flight (a stuck stream must not hold a shutdown).
SEND_DRAIN_TIMEOUT_S = 5.0


class HopSender:
    """Sends over the trainer's data plane (set once it is started), and keeps background sends."""

    def __init__(self, health, killed: Callable[[], bool]):
        """``health``: whom a failed send suspects; ``killed()``: a killed node sends nothing."""
        self.health = health
        self._killed = killed
        self.dataplane: Optional[object] = None  # node.dataplane.transport.DataPlane, once started
        self._tasks: set = set()

    async def send(self, peer: str, msg: object) -> bool:
        """Send ``msg``; a peer the send fails to is suspected (never raises)."""
        if self._killed():
            return False
        try:
            await self.dataplane.send(peer, msg)
            return True
        except DataPlaneError as e:
            self.health.suspect(peer, f"send failed: {e}")
            return False
        except Exception as e:  # noqa: BLE001 - a broken peer must never break this node
            self.health.suspect(peer, f"send failed: {e!r}")
            return False

    def spawn(self, coro) -> None:
        """Run a send (or a routed hop, :mod:`node.train.recovery`) in the background."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def send_control(self, peer: str, msg: object) -> None:
        self.spawn(self.send(peer, msg))

    async def close(self) -> None:
        """Let sends in flight finish (bounded)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=SEND_DRAIN_TIMEOUT_S)
