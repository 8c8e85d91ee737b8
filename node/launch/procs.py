"""Which processes are alive, read from ``/proc`` (Linux): the harnesses' proof that nothing leaked.

A daemon's p2pd and forked DHT child outlive it unless it stops cleanly, so tests and benchmarks
check after every swarm that no process of it is left: by process group (each daemon of
:class:`node.launch.process_swarm.ProcessSwarm` has its own) or by a path on its command line.
Zombies do not count: they hold no resources and their parent reaps them.
"""

from __future__ import annotations

import os
from typing import Callable, Iterator

__all__ = ["live_processes", "process_group_members", "processes_mentioning", "ancestors"]


def _stat_fields(pid: str) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, ppid, pgid, ...)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read().decode(errors="replace")
    return stat[stat.rindex(")") + 2:].split()


def live_processes(want: Callable[[int, list[str]], bool]) -> Iterator[int]:
    """Pids of non-zombie processes for which ``want(pid, stat_fields)`` holds."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = _stat_fields(entry)
            if fields[0] != "Z" and want(int(entry), fields):
                yield int(entry)
        except (OSError, ValueError, IndexError):
            continue


def process_group_members(pgid: int) -> list[int]:
    """Live pids in process group ``pgid``."""
    return list(live_processes(lambda pid, fields: int(fields[2]) == pgid))


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode(errors="replace")


def ancestors() -> set[int]:
    """This process and its parents (a ``timeout``/``nice`` wrapper may mention the same paths)."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            pid = int(_stat_fields(str(pid))[1])
        except (OSError, IndexError, ValueError):
            break
    return pids


def processes_mentioning(text: str, exclude: set[int] | None = None) -> list[int]:
    """Live pids whose command line mentions ``text`` (daemons get their folders, p2pd its identity
    path), except ``exclude`` (default: this process)."""
    skip = {os.getpid()} if exclude is None else exclude
    return list(live_processes(lambda pid, fields: pid not in skip and text in _cmdline(pid)))
