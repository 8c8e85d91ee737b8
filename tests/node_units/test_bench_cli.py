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


def test_a_temporary_workdir_goes_on_success_and_stays_with_a_line_on_failure(tmp_path, capsys):
    import pytest

    from node.ops.bench_cli import bench_workdir

    with bench_workdir(None, "skippipe-test-") as base:
        (base / "node0").mkdir()
    assert not base.exists()
    with pytest.raises(RuntimeError):
        with bench_workdir(None, "skippipe-test-") as kept:
            raise RuntimeError("a daemon died")
    assert kept.exists() and f"daemon logs kept in {kept}" in capsys.readouterr().err
    kept.rmdir()
    with bench_workdir(tmp_path / "given", "skippipe-test-") as given:
        given.mkdir()
    assert given.exists()  # a folder the user named is theirs


def test_run_length_defaults_quick_and_bounds():
    import argparse

    import pytest

    from node.ops.bench_cli import resolve_run_length

    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--quick", action="store_true")
    for argv, want in (([], (20, 2)), (["--quick"], (3, 1)), (["--quick", "--iterations", "5"], (5, 1))):
        args = p.parse_args(argv)
        resolve_run_length(p, args, iterations=20, warmup=2)
        assert (args.iterations, args.warmup) == want
    with pytest.raises(SystemExit):
        resolve_run_length(p, p.parse_args(["--iterations", "0"]), iterations=20, warmup=2)
