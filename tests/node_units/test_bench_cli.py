"""The benches' outer level: one error line, exit codes, SIGTERM as an interruption, the handler restored."""

import os
import signal

from node.ops.bench_cli import BenchError, run_bench


def _raise(exc):
    def body():
        raise exc
    return body


def test_a_bench_error_is_one_line_and_exit_2(capsys):
    assert run_bench(_raise(BenchError("no namespaces here"))) == 2
    assert capsys.readouterr().err == "error: no namespaces here\n"


def test_sigterm_runs_the_cleanup_and_exits_130_and_the_old_handler_comes_back(capsys):
    before = signal.getsignal(signal.SIGTERM)
    cleaned = []

    def body():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            return 0
        finally:
            cleaned.append(True)

    assert run_bench(body, "the lab removed") == 130
    assert cleaned == [True]
    assert capsys.readouterr().err == "error: interrupted (the lab removed)\n"
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_body_exit_code_passes_through():
    assert run_bench(lambda: 0) == 0
    assert run_bench(lambda: 1) == 1


def test_the_run_record_says_how_a_figure_was_measured(tmp_path):
    import argparse
    import json

    from node.ops.bench_cli import run_record

    args = argparse.Namespace(iterations=3, workdir=tmp_path, quick=False)
    record = run_record(args, "2026-12-06 09:00:00 UTC", (1.5, 1.0, 0.5), "loopback")
    assert record["date"] == "2026-12-06 09:00:00 UTC"
    assert record["machine"]["load_avg_start"] == [1.5, 1.0, 0.5] and record["machine"]["note"] == "loopback"
    assert record["setting"] == {"iterations": 3, "workdir": str(tmp_path), "quick": False}
    json.dumps(record)  # goes into the result file as it is
