"""The join command a founding node prints is complete: parsed back, it trains in the same run."""

import shlex
import types

from node.cli import build_parser
from node.ops.join_command import join_command_lines, join_lines_for_daemon
from node.spec import TrainSpec

MADDR = "/ip4/10.0.0.1/tcp/31337/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
SHARED = ("train", "model", "model_config", "corpus", "text_field", "tokenizer", "iterations", "lr", "seed",
          "microbatch_size", "seq_len", "min_members", "checkpoint_dir", "checkpoint_every", "run_id")


def _join_flags(args):
    """The flags the founder's banner prints for a joiner (node/cli/train_args.py: TrainSpec.join_argv)."""
    return TrainSpec.from_args(args).join_argv()


def _parse(argv):
    return build_parser().parse_args(argv)


def test_printed_command_reproduces_every_shared_training_flag():
    founder = _parse(["node", "run", "--new-swarm", "--stages", "0", "--num-stages", "4", "--path-length", "3",
                      "--run-id", "my run", "--train", "--corpus", "/data/my corpus.jsonl", "--text-field", "body",
                      "--tokenizer", "bpe:4096", "--lr", "0.003", "--seed", "7", "--microbatch-size", "4",
                      "--seq-len", "48", "--iterations", "300", "--min-members", "5", "--checkpoint-dir", "ckpt",
                      "--swarm-key", "swarm.key"])
    lines = join_command_lines(founder.run_id, [MADDR], _join_flags(founder), swarm_key="swarm.key")
    command = lines[0].strip()
    argv = shlex.split(command)
    assert argv[:3] == ["skippipe", "node", "run"]
    joiner = _parse(argv[1:])
    assert joiner.initial_peers == [MADDR] and joiner.auto and not joiner.new_swarm
    assert str(joiner.swarm_key) == "swarm.key"
    for name in SHARED:
        assert getattr(joiner, name) == getattr(founder, name), name
    # run-level settings travel in the hello handshake, not on the command line
    assert joiner.num_stages is None and joiner.path_length is None
    assert any("copy swarm.key" in line for line in lines[1:])


def test_model_config_and_defaults():
    founder = _parse(["node", "run", "--train", "--model-config", "m.json"])
    flags = _join_flags(founder)
    joiner = _parse(["node", "run", "--initial-peers", MADDR, "--auto", *flags])
    assert str(joiner.model_config) == "m.json" and joiner.tokenizer is None and joiner.lr is None
    assert _join_flags(_parse(["node", "run"])) == []  # no --train: nothing to repeat


def test_daemon_banner_lines_from_config_and_services():
    config = types.SimpleNamespace(run_id="r1", swarm_key_path=None, allow_peers_path="allow.txt")
    svc = types.SimpleNamespace(join_flags=["--train", "--model", "tiny"],
                                config=types.SimpleNamespace(data=types.SimpleNamespace(tokenizer_hash="abc123")))
    lines = join_lines_for_daemon(config, [object(), svc], [MADDR])
    assert lines[0] == f"  skippipe node run --run-id r1 --initial-peers {MADDR} --auto --train --model tiny"
    assert any("allow.txt" in line for line in lines) and any("abc123" in line for line in lines)
    bare = join_lines_for_daemon(types.SimpleNamespace(run_id="r1", swarm_key_path=None, allow_peers_path=None), [], [])
    assert "announce-maddrs" in bare[0]
