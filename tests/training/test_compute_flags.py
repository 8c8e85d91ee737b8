"""--device, --precision and --wire on `skippipe node run --train` and `skippipe up`."""

import argparse
import pathlib

import pytest
import torch

from node.cli import main

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")


@pytest.mark.parametrize("argv", [["up", "--device", "cuda"],
                                  ["node", "run", "--device", "cuda", "--rpc-port", "-1"]])
def test_an_unusable_device_is_one_error_line(argv, capsys, tmp_path):
    extra = ["--out", str(tmp_path)] if argv[0] == "up" else ["--identity", str(tmp_path / "id.key")]
    assert main(argv + extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "no CUDA device" in err and "Traceback" not in err


def test_node_run_train_flags_reach_the_trainer_config():
    from node.cli.train_args import add_training_arguments, training_services_from_args

    p = argparse.ArgumentParser()
    p.add_argument("--run-id", default="r")
    p.add_argument("--device", default="auto")
    add_training_arguments(p)
    args = p.parse_args(["--train", "--precision", "fp16", "--wire", "int8"])
    cfg = training_services_from_args(args)[0].config
    assert (cfg.device, cfg.precision, cfg.wire, cfg.averaging.compression) == ("cpu", "fp16", "int8", "fp16")
    auto = training_services_from_args(p.parse_args(["--train"]))[0].config
    assert (auto.device, auto.precision, auto.wire) == ("cpu", "fp32", "fp32")  # auto precision on a CPU
    assert auto.observed_deadlines.enabled  # observed deadlines by default; the cost model only when asked
    model_only = training_services_from_args(p.parse_args(["--train", "--deadlines", "model"]))[0].config
    assert not model_only.observed_deadlines.enabled
    assert auto.hedging.enabled  # hedged microbatches by default; off for the straggler bench's control
    assert not training_services_from_args(p.parse_args(["--train", "--hedging", "off"]))[0].config.hedging.enabled


def test_up_passes_the_flags_to_every_node(tmp_path):
    from dataclasses import replace

    from node.cli.up_runners import UP_SPEC, UpOptions, _compute_config, _daemon_spec

    opts = UpOptions(replace(UP_SPEC, device="auto", precision="bf16", wire="int8"))
    args = _daemon_spec(opts, pathlib.Path(tmp_path), 9).to_argv()
    i = args.index("--device")
    assert args[i:i + 6] == ["--device", "auto", "--precision", "bf16", "--wire", "int8"]
    assert _compute_config(opts)["wire"] == "int8" and _compute_config(opts)["device"] == "cpu"
