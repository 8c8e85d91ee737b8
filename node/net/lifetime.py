"""Process lifetime: a daemon's children die with it, a harness's daemons die with the harness.

Three mechanisms, each for a different parent/child pair (Linux only; elsewhere they do nothing):

* **p2pd** is started with ``PR_SET_PDEATHSIG`` = SIGKILL in a session of its own
  (:mod:`node.net.p2pd`).
* **Forked Python children** (hivemind's DHT is a ``multiprocessing.Process`` forked from the
  daemon): :func:`install_fork_guard` registers an ``os.register_at_fork`` hook, so every child
  forked afterwards asks the kernel for SIGKILL when its parent (thread) dies, and exits at once if
  the parent is already gone. The DHT is forked from an executor thread that lives as long as
  the daemon's loop.
* **Daemons started by a harness** (``node/launch/process_swarm.py``, ``skippipe swarm local``,
  ``skippipe up``): the harness puts its pid in :data:`PARENT_PID_ENV`; the daemon runs
  :func:`start_parent_watchdog`, a thread that notices when that process is gone (SIGKILLed
  pytest included), sends the daemon SIGTERM (a clean leave) and SIGKILL after a grace period.
  Polling the pid, not ``PR_SET_PDEATHSIG``: the death signal fires when the *thread* that
  started the child exits, and a harness may start daemons from short-lived threads.

:func:`tolerate_broken_stdio` keeps a daemon whose stdout/stderr reader died (a closed pipe) from
failing, or failing to shut down, on its next log line or ``print``.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable, Optional

__all__ = ["PARENT_PID_ENV", "die_with_parent", "install_fork_guard", "start_parent_watchdog",
           "tolerate_broken_stdio", "parent_watchdog_from_env", "harness_env"]

logger = logging.getLogger(__name__)

#: Environment variable naming the pid a daemon must not outlive (set by harnesses).
PARENT_PID_ENV = "SKIPPIPE_PARENT_PID"
#: prctl(2) option: signal delivered to this process when its parent thread dies.
PR_SET_PDEATHSIG = 1
#: Seconds between two looks at the parent.
WATCHDOG_POLL_S = 0.5
#: Seconds a daemon gets to leave cleanly after its harness died, before it SIGKILLs itself.
WATCHDOG_GRACE_S = 20.0

_LINUX = sys.platform.startswith("linux")
_fork_guard_installed = False
_forking_pid: Optional[int] = None


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent (thread) dies. False where unsupported."""
    if not _LINUX:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _before_fork() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _after_fork_in_child() -> None:
    die_with_parent(signal.SIGKILL)
    if _forking_pid is not None and os.getppid() != _forking_pid:
        os._exit(1)  # the parent died between fork and prctl: the death signal will never come


def install_fork_guard() -> bool:
    """Every child this process forks from now on dies with it (SIGKILL). Idempotent; False off Linux."""
    global _fork_guard_installed
    if not _LINUX:
        return False
    if not _fork_guard_installed:
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _fork_guard_installed = True
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if _LINUX:  # a zombie is dead for our purpose (its parent has not reaped it yet)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
            return state not in (b"Z", b"X")
        except (OSError, IndexError):
            return False
    return True


def start_parent_watchdog(parent_pid: int, *, on_parent_death: Optional[Callable[[], None]] = None,
                          grace_s: float = WATCHDOG_GRACE_S, poll_s: float = WATCHDOG_POLL_S) -> threading.Thread:
    """A daemon thread that acts when ``parent_pid`` is gone (or we were re-parented away from it).

    Default action: SIGTERM to ourselves (the daemon's clean shutdown), then SIGKILL to ourselves
    after ``grace_s`` if we are still there; our own children follow through their death signals.
    """
    original_ppid = os.getppid()

    def gone() -> bool:
        return not _alive(parent_pid) or (original_ppid == parent_pid and os.getppid() != parent_pid)

    def watch() -> None:
        while not gone():
            time.sleep(poll_s)
        logger.warning("parent process %d is gone: stopping this daemon", parent_pid)
        if on_parent_death is not None:
            on_parent_death()
            return
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        logger.warning("still running %.0f s after the parent died: killing this process", grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="parent-watchdog", daemon=True)
    thread.start()
    return thread


def parent_watchdog_from_env(environ=os.environ) -> Optional[threading.Thread]:
    """Start :func:`start_parent_watchdog` for the pid in :data:`PARENT_PID_ENV`, if any."""
    text = environ.get(PARENT_PID_ENV, "").strip()
    if not text:
        return None
    try:
        pid = int(text)
    except ValueError:
        logger.warning("ignoring %s=%r: not a pid", PARENT_PID_ENV, text)
        return None
    if pid <= 1:
        return None
    return start_parent_watchdog(pid)


def harness_env(env: Optional[dict] = None) -> dict:
    """``env`` (default: ours) plus :data:`PARENT_PID_ENV` = this process: daemons started with it die with us."""
    out = dict(os.environ if env is None else env)
    out[PARENT_PID_ENV] = str(os.getpid())
    return out


class _TolerantStream:
    """A text stream wrapper that turns EPIPE / EIO / a closed stream into a silent no-op."""

    def __init__(self, stream):
        self._stream = stream
        self._broken = False

    def _guard(self, fn, *args, default=None):
        if self._broken:
            return default
        try:
            return fn(*args)
        except (BrokenPipeError, ValueError):  # ValueError: I/O on a closed file
            self._broken = True
        except OSError as e:
            if e.errno not in (errno.EPIPE, errno.EIO, errno.EBADF):
                raise
            self._broken = True
        return default

    def write(self, text):
        result = self._guard(self._stream.write, text, default=len(text))
        return len(text) if result is None else result

    def flush(self):
        self._guard(self._stream.flush)

    def __getattr__(self, name):  # fileno (faulthandler), isatty, encoding, buffer, ...
        return getattr(self._stream, name)


def tolerate_broken_stdio() -> None:
    """Make ``print`` and logging survive a dead reader of stdout/stderr (a closed pipe).

    Python ignores SIGPIPE, so a write to a pipe nobody reads raises BrokenPipeError: in ``print``
    during shutdown that would abort the clean stop, and at exit it turns into exit code 120. With
    the wrappers such writes are dropped; logging's own error reporting is switched off too (it
    would write a traceback to the same dead stderr).
    """
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _TolerantStream):
            setattr(sys, name, _TolerantStream(stream))
    logging.raiseExceptions = False
