"""The ``skippipe`` entry point: version, help, and user errors without tracebacks."""

import subprocess
import sys

from node import __version__
from node.cli import main


def test_version_flag(capsys):
    try:
        main(["--version"])
    except SystemExit as e:
        assert e.code == 0
    assert __version__ in capsys.readouterr().out


def test_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "node", "--help"], capture_output=True, text=True, check=True).stdout
    assert "skippipe" in out and "quick start" in out


def test_unknown_command_is_a_usage_error():
    proc = subprocess.run([sys.executable, "-m", "node", "no-such-command"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- bad numbers on the command line
import pytest  # noqa: E402

from node.cli.validate import float_range, int_range, port  # noqa: E402

PLAN = ["plan", "--profile", "tests/scheduler/data/geo-distributed-12.json", "--nodes", "8", "--stage-sizes", "2,2,2,2",
        "--path-length", "3"]
RUN = ["node", "run", "--rpc-port", "-1"]


@pytest.mark.parametrize("argv, needle", [
    (RUN + ["--gossip-port", "-5"], "--gossip-port must be a TCP port"),
    (RUN + ["--gossip-port", "70000"], "--gossip-port must be a TCP port"),
    (["node", "run", "--rpc-port", "70000"], "--rpc-port must be a TCP port"),
    (RUN + ["--host-maddrs", "/ip4/127.0.0.1/tcp/70000"], "not a multiaddr"),
    (RUN + ["--heartbeat", "nan"], "--heartbeat must be a finite number"),
    (RUN + ["--heartbeat", "1e308"], "--heartbeat must be at most"),
    (RUN + ["--heartbeat", "0"], "--heartbeat must be at least"),
    (RUN + ["--memory-slots", "0"], "--memory-slots must be at least 1"),
    (RUN + ["--num-stages", "1"], "--num-stages must be at least 2"),
    (RUN + ["--num-stages", "1000000"], "--num-stages must be at most"),
    (RUN + ["--stages", "1000000"], "at most"),
    (RUN + ["--microbatches", "1000000000"], "--microbatches must be at most"),
    (RUN + ["--rpc-rate", "inf"], "--rpc-rate must be a finite number"),
    (RUN + ["--schedule-budget", "nan"], "--schedule-budget must be a finite number"),
    (RUN + ["--lr", "nan"], "--lr must be a finite number"),
    (RUN + ["--lr", "-1"], "--lr must be greater than 0"),
    (RUN + ["--threads", "0"], "--threads must be at least 1"),
    (RUN + ["--threads", "-3"], "--threads must be at least 1"),
    (RUN + ["--iteration-timeout", "inf"], "--iteration-timeout must be a finite number"),
    (RUN + ["--latency-scale", "nan"], "--latency-scale must be a finite number"),
    (RUN + ["--seq-len", "1e9"], "--seq-len"),
    (PLAN + ["--budget-s", "nan"], "--budget-s must be a finite number"),
    (PLAN + ["--budget-s", "inf"], "--budget-s must be a finite number"),
    (PLAN + ["--budget-s", "0"], "--budget-s must be greater than 0"),
    (PLAN + ["--max-swaps", "-1"], "--max-swaps must be at least 0"),
    (PLAN + ["--microbatches", "1000000000"], "--microbatches must be at most"),
    (PLAN[:4] + ["1000000"] + PLAN[5:], "--nodes must be at most"),
    (PLAN + ["--hop-overhead-s=-inf"], "--hop-overhead-s must be a finite number"),
    (["simulate", "x.json", "--microbatches", "0"], "--microbatches must be at least 1"),
    (["swarm", "status", "--rpc", "garbage"], "expected http://HOST:PORT"),
    (["swarm", "status", "--rpc", "http://127.0.0.1:99999"], "not a URL"),
    (["swarm", "status", "--timeout", "nan", "--rpc", "http://127.0.0.1:1"], "--timeout must be a finite number"),
    (["swarm", "local", "--nodes", "1000000"], "--nodes must be at most"),
    (["up", "--memory", "0"], "--memory must be at least 1"),
    (RUN + ["--initial-peers", "not-a-maddr"], "not a multiaddr"),
    (RUN + ["--initial-peers"] + ["/ip4/127.0.0.1/tcp/1"] * 65, "at most 64 multiaddrs"),
    (["eval", "--checkpoint", ".", "--batches", "1000000000"], "--batches must be at most"),
    (["eval", "--checkpoint", ".", "--omit-fraction", "0.5", "--trials", "1e9"], "--trials"),
])
def test_bad_numbers_are_one_error_line(argv, needle, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    errors = [line for line in (out + err).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], err
    assert "Traceback" not in out + err
    assert len((out + err).strip().splitlines()) == 1, err  # no usage block either


def test_oversized_plan_is_refused_up_front(capsys):
    # 1,024 nodes, 512 data nodes x 128 microbatches: building the problem alone would take many minutes
    argv = ["plan", "--profile", "tests/scheduler/data/geo-distributed-12.json", "--nodes", "1024", "--stage-sizes",
            "512,512", "--path-length", "2", "--microbatches", "128"]
    assert main(argv) == 2
    assert "plan too large" in capsys.readouterr().err


def test_run_whose_schedule_cannot_be_searched_is_refused(capsys):
    assert main(RUN + ["--num-stages", "200", "--stages", "0", "--microbatches", "64"]) == 2
    assert "--microbatches 64 x path length 200" in capsys.readouterr().err


def test_validators_accept_their_range_and_refuse_the_rest():
    import argparse

    f = float_range(0, 10, lo_open=True)
    assert f("10") == 10.0 and f("1e-3") == 0.001
    for bad in ("0", "nan", "inf", "-inf", "10.5", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            f(bad)
    i = int_range(1, 5)
    assert [i(x) for x in ("1", "5")] == [1, 5]
    for bad in ("0", "6", "1e3", "2.5", "9" * 100):
        with pytest.raises(argparse.ArgumentTypeError):
            i(bad)
    p = port(allow_zero=False)
    assert p("1") == 1 and p("65535") == 65535
    for bad in ("0", "-1", "65536", "70000"):
        with pytest.raises(argparse.ArgumentTypeError):
            p(bad)
    assert port(allow_zero=True, allow_off=True)("-1") == -1
