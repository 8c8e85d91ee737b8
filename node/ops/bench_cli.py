"""What the benchmark scripts under ``bench/`` share at their outermost level.

A bench starts daemons, network namespaces and temporary folders, and must leave none behind however it
ends; its user wants one ``error:`` line for a failure it can name, not a traceback. So a bench raises
:class:`BenchError` for those, and :func:`run_bench` turns it into that line (exit 2), turns Ctrl-C and
SIGTERM (a CI job's timeout, ``kill``) into exit 130 after the bench's own ``finally`` blocks have run,
and restores the SIGTERM handler it found.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import signal
import sys
from typing import Callable, Sequence

__all__ = ["BenchError", "run_bench", "run_record"]


class BenchError(Exception):
    """A failure reported as one ``error:`` line (no traceback)."""


def run_bench(body: Callable[[], int], cleaned_up: str = "every daemon was stopped") -> int:
    """Run ``body`` and return its exit code, or 2 after a :class:`BenchError`, or 130 after an interruption;
    ``cleaned_up`` says in the interruption's line what the bench's ``finally`` blocks undid."""

    def on_term(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)  # so the bench's finally blocks stop its daemons
    try:
        return body()
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"error: interrupted ({cleaned_up})", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_record(args: argparse.Namespace, started: str, load_start: Sequence[float], note: str) -> dict:
    """The part of a bench's result file that says how it was run: the command, when, on what machine (load at
    start and now, ``note`` on where the daemons ran) and every setting (paths as text), so a figure read
    later can be judged by the conditions it was measured under."""
    return {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "date": started,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_avg_start": list(load_start), "load_avg_end": list(os.getloadavg()), "note": note},
        "setting": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
    }
