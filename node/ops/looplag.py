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

A stall long enough to cost a heartbeat is also reported where it happens: a watcher thread notices
when the probe has not woken for :data:`STALL_REPORT_S` while the loop's thread spent at least
:data:`STALL_REPORT_CPU_S` of that time on the CPU, and logs, once per stall, the Python stack that
thread is running then. Seconds of work on the loop let a node's advert lapse and its peers' requests
time out, and the stack names the call to move off the loop. A thread that was only waiting (for a
busy machine to schedule it, for the GIL, or in a blocking call) is not reported: on a loaded host the
first two are routine and the stack would name whatever code it happened to stop in.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from typing import Callable, Optional

__all__ = ["LoopLagProbe", "LOOP_LAG_INTERVAL_S", "STALL_REPORT_CPU_S", "STALL_REPORT_S", "loop_thread_busy_in"]

logger = logging.getLogger(__name__)

#: How often the probe wakes: short enough that a blocking stretch of a few tens of milliseconds
#: shows up at about its true length, long enough that the probe itself costs nothing measurable
#: (20 wake-ups a second).
LOOP_LAG_INTERVAL_S = 0.05
#: A probe this late has its loop's stack logged: well above anything a healthy loop does in one go
#: (tens of milliseconds), below the shortest advert lifetime in use (3 heartbeats of 2 s in tests).
STALL_REPORT_S = 2.0
#: CPU seconds the loop's thread must have spent within a stall for it to be reported: ten times what a
#: healthy loop spends between two wake-ups, and an absolute amount because on a loaded host a thread
#: doing exactly that work gets only its share of a core (measured: 19% with 12 daemons on 2 cores).
STALL_REPORT_CPU_S = 0.5
#: Stack frames the stall report shows, innermost last.
STALL_REPORT_FRAMES = 8
#: Innermost frames that mean "the loop is idle, waiting in its poll": a late wake-up there is the
#: machine's load, not work on the loop.
_IDLE_FRAMES = {"select", "poll", "_run_once", "run_forever", "run_until_complete", "run"}


def loop_thread_busy_in(thread_id: int) -> Optional[str]:
    """The innermost frames the thread ``thread_id`` runs, formatted; None when it is idle in its loop's
    poll (or gone)."""
    frame = sys._current_frames().get(thread_id)
    if frame is None or frame.f_code.co_name in _IDLE_FRAMES:
        return None
    frames = traceback.extract_stack(frame)
    # the innermost frames can all be inside a library (an import chain, say): show the innermost of
    # the application's own too, which name the call to move off the loop
    own = [f for f in frames if "-packages" not in f.filename and not f.filename.startswith("<")]
    shown = own[-(STALL_REPORT_FRAMES // 2):]
    inner = [f for f in frames[-(STALL_REPORT_FRAMES // 2):] if f not in shown]
    lines = traceback.format_list(shown) + (["  ...\n"] if inner else []) + traceback.format_list(inner)
    return "".join(lines).rstrip()


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
        #: stalls reported with a stack (see :data:`STALL_REPORT_S`)
        self.stalls_reported = 0
        self.stall_report_s = STALL_REPORT_S
        self._task: Optional[asyncio.Task] = None
        self._woke_at = time.monotonic()
        self._woke_cpu = 0.0
        self._cpu_clock: Optional[int] = None

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
        done, self._woke_at = threading.Event(), time.monotonic()
        self._cpu_clock = time.pthread_getcpuclockid(threading.get_ident())  # thread_time's clock, read from outside
        self._woke_cpu = time.thread_time()
        threading.Thread(target=self._watch, args=(threading.get_ident(), done), name="loop-stall-watch",
                         daemon=True).start()
        try:
            await self._measure()
        finally:
            done.set()

    async def _measure(self) -> None:
        while True:
            t0, cpu0 = time.monotonic(), time.thread_time()
            await asyncio.sleep(self.interval_s)
            self._woke_at, self._woke_cpu = time.monotonic(), time.thread_time()
            lag = max(0.0, self._woke_at - t0 - self.interval_s)
            self.busy_max_s = max(self.busy_max_s, self._woke_cpu - cpu0)
            self.last_s = lag
            self.max_s = max(self.max_s, lag)
            self.samples += 1
            if self.on_sample is not None:
                self.on_sample(lag, self.max_s)

    def _watch(self, loop_thread: int, done: threading.Event) -> None:
        """Watcher thread: log the loop thread's stack once per stall longer than ``stall_report_s``."""
        reported_at = None
        while not done.wait(min(0.25, self.stall_report_s / 4)):
            woke_at, woke_cpu = self._woke_at, self._woke_cpu
            late = time.monotonic() - woke_at
            if late < self.stall_report_s or reported_at == woke_at:
                continue
            try:
                busy = time.clock_gettime(self._cpu_clock) - woke_cpu
            except OSError:  # the loop's thread is gone
                return
            if busy < STALL_REPORT_CPU_S:
                continue
            where = loop_thread_busy_in(loop_thread)
            if where is None:
                continue
            reported_at = woke_at
            self.stalls_reported += 1
            logger.warning("event loop blocked for %.1f s so far, %.1f s of it on the CPU (heartbeats, RPCs and "
                           "data-plane frames wait meanwhile), in:\n%s", late, busy, where)
