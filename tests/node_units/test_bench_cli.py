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
