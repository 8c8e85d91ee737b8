"""Start hivemind's p2pd in a session of its own, tied to the daemon's life.

Why: p2pd is a Go program that exits on SIGINT/SIGTERM (ignoring the signal in the parent does not
survive into it). Started the default way it sits in the daemon's process group, so a Ctrl+C in
the terminal, ``kill -TERM -<pgid>`` or a service manager that signals the whole group kills p2pd
at the same instant as it asks the daemon to leave; the daemon then drains with no transport,
cannot finish in-flight microbatches, hand off, or announce OFFLINE. In a session of its own p2pd
gets no group signals; the daemon stops it itself at the end of its shutdown. So that it never
outlives a daemon that is SIGKILLed (a crash, the OOM killer), the kernel is asked to SIGKILL it
when its parent dies (``PR_SET_PDEATHSIG``).

hivemind starts p2pd with ``asyncio.subprocess.create_subprocess_exec`` and offers no hook, so
:func:`own_session` swaps that function for the duration of ``P2P.create`` only. Linux only; on
other systems it changes nothing.
"""

from __future__ import annotations

import asyncio.subprocess
import contextlib
import ctypes
import logging
import signal
import sys
from typing import Iterator

__all__ = ["own_session"]

logger = logging.getLogger(__name__)

#: prctl(2) option: signal to deliver to this process when its parent thread dies
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the forked child before exec: SIGKILL when the parent dies (async-signal-safe)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


@contextlib.contextmanager
def own_session() -> Iterator[None]:
    """Within the block, subprocesses started through asyncio get their own session and die with us.

    Only for use around ``P2P.create`` on the event loop's thread (the parent-death signal fires
    when the *thread* that forked exits, and the loop thread lives as long as the daemon).
    """
    if not sys.platform.startswith("linux"):
        yield
        return
    original = asyncio.subprocess.create_subprocess_exec

    async def create_subprocess_exec(*args, **kwargs):
        kwargs.setdefault("start_new_session", True)
        kwargs.setdefault("preexec_fn", _die_with_parent)
        return await original(*args, **kwargs)

    asyncio.subprocess.create_subprocess_exec = create_subprocess_exec
    try:
        yield
    finally:
        asyncio.subprocess.create_subprocess_exec = original
