"""How long the event loop is kept from running its callbacks: a periodic task measures how late it wakes.

Everything a daemon does on the network (data-plane frames, the DHT, RPCs, heartbeats) runs on one
asyncio loop, so any synchronous work on it (decoding a 32 MiB frame, a checksum over every
parameter) delays all of them at once: a peer's heartbeat goes unanswered, a neighbour's stream
stalls. The probe sleeps :data:`LOOP_LAG_INTERVAL_S` at a time and records by how much each wake-up
came late: that lateness is the longest stretch the loop just spent on something else without
yielding. The daemon exports the last and the largest lateness in ``/metrics``
(``skippipe_loop_lag_seconds``, ``skippipe_loop_lag_max_seconds``).

Lateness also counts the time the operating system gave the loop's thread to other processes, which
on a loaded machine can dwarf anything the loop did. So the probe also records the loop thread's own
CPU time between two wake-ups (``busy_max_s``): work that ran on the loop, whoever was scheduled
meanwhile. Tests bound that one.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Optional

__all__ = ["LoopLagProbe", "LOOP_LAG_INTERVAL_S"]

#: How often the probe wakes: short enough that a blocking stretch of a few tens of milliseconds
#: shows up at about its true length, long enough that the probe itself costs nothing measurable
#: (20 wake-ups a second).
LOOP_LAG_INTERVAL_S = 0.05


class LoopLagProbe:
    """A task on the running loop that measures how late it wakes; ``max_s`` is the worst seen so far.

    ``on_sample(lag_s, max_s)`` (optional) is called after each wake-up, on the loop (the daemon sets
    its metrics gauges with it); it must be cheap and must not raise.
    """

    def __init__(self, interval_s: float = LOOP_LAG_INTERVAL_S,
                 on_sample: Optional[Callable[[float, float], None]] = None) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.interval_s = interval_s
        self.on_sample = on_sample
        self.last_s = 0.0
        self.max_s = 0.0
        self.samples = 0
        #: the most CPU time the loop's thread spent between two consecutive wake-ups
        self.busy_max_s = 0.0
        self._task: Optional[asyncio.Task] = None

    def start(self) -> "LoopLagProbe":
        """Start measuring on the running loop (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.run(), name="loop-lag-probe")
        return self

    def reset(self) -> None:
        """Forget the worst lateness seen so far (e.g. after a start-up that is allowed to block)."""
        self.max_s = 0.0
        self.busy_max_s = 0.0

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def run(self) -> None:
        """Measure until cancelled (:meth:`start` runs it as a task; a daemon runs it among its own)."""
        while True:
            t0, cpu0 = time.monotonic(), time.thread_time()
            await asyncio.sleep(self.interval_s)
            lag = max(0.0, time.monotonic() - t0 - self.interval_s)
            self.busy_max_s = max(self.busy_max_s, time.thread_time() - cpu0)
            self.last_s = lag
            self.max_s = max(self.max_s, lag)
            self.samples += 1
            if self.on_sample is not None:
                self.on_sample(lag, self.max_s)
