"""What the benchmark scripts under ``bench/`` share at their outermost level.

A bench starts daemons, network namespaces and temporary folders, and must leave none behind however it
ends; its user wants one ``error:`` line for a failure it can name, not a traceback. So a bench raises
:class:`BenchError` for those, and :func:`run_bench` turns it into that line (exit 2), turns Ctrl-C and
SIGTERM (a CI job's timeout, ``kill``) into exit 130 after the bench's own ``finally`` blocks have run,
and restores the SIGTERM handler it found.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import platform
import shutil
import signal
import sys
import tempfile
from typing import Callable, Iterator, Optional, Sequence

__all__ = ["BenchError", "run_bench", "run_record", "add_swarm_run_arguments", "resolve_run_length", "bench_workdir"]


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


def add_swarm_run_arguments(p: argparse.ArgumentParser, results_dir: pathlib.Path) -> None:
    """The flags of a bench that starts swarms: how long to wait for them, where their logs and the results go."""
    p.add_argument("--start-timeout", type=float, default=480.0,
                   help="seconds for the daemons to come up and train their first iteration (default %(default)s)")
    p.add_argument("--stall-timeout", type=float, default=300.0,
                   help="seconds without a committed iteration before a configuration is given up (default %(default)s)")
    p.add_argument("--workdir", type=pathlib.Path, default=None,
                   help="keep the daemons' folders (logs) here; default a temporary folder, kept only on failure")
    p.add_argument("--out", type=pathlib.Path, default=results_dir, help="results folder (default bench/results)")


def resolve_run_length(p: argparse.ArgumentParser, args: argparse.Namespace, iterations: int, warmup: int) -> None:
    """Fill ``--iterations``/``--warmup`` left unset: the bench's ``iterations``/``warmup``, or 3 and 1 with
    ``--quick`` (an explicit count wins); a count out of range is the parser's one error line."""
    if args.iterations is None:
        args.iterations = 3 if args.quick else iterations
    if args.warmup is None:
        args.warmup = 1 if args.quick else warmup
    if args.iterations < 1 or args.warmup < 0:
        p.error("--iterations must be >= 1 and --warmup >= 0")


@contextlib.contextmanager
def bench_workdir(workdir: Optional[pathlib.Path], prefix: str) -> Iterator[pathlib.Path]:
    """The folder the bench's daemons live in: ``workdir`` as given (kept), else a temporary one that is removed
    when the body succeeds and kept, with a line saying where, when it fails (its logs say why)."""
    base = pathlib.Path(workdir) if workdir is not None else pathlib.Path(tempfile.mkdtemp(prefix=prefix))
    ok = False
    try:
        yield base
        ok = True
    finally:
        if workdir is None:
            if ok:
                shutil.rmtree(base, ignore_errors=True)
            else:
                print(f"  daemon logs kept in {base}", file=sys.stderr, flush=True)
