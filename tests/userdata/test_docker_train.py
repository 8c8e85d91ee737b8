"""docker/compose.yaml brings up a swarm that trains: every node trains with the same flags, and
--min-members counts exactly the bootstrap plus the node replicas."""

import pathlib

import yaml

from node.cli import build_parser
from node.spec import TrainSpec

COMPOSE = pathlib.Path(__file__).resolve().parents[2] / "docker" / "compose.yaml"
PREFIX = {"bootstrap": ["--new-swarm"], "node": ["--initial-peers", "/dns4/bootstrap/tcp/31337/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"]}


def test_compose_swarm_trains_with_one_set_of_flags():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    parsed = {name: build_parser().parse_args(["node", "run", *PREFIX[name], *services[name]["command"]])
              for name in ("bootstrap", "node")}
    assert all(a.train for a in parsed.values())
    assert TrainSpec.from_args(parsed["bootstrap"]).join_argv() == TrainSpec.from_args(parsed["node"]).join_argv()
    members = 1 + services["node"]["deploy"]["replicas"]
    assert parsed["bootstrap"].min_members == members
    assert parsed["bootstrap"].path_length <= parsed["bootstrap"].num_stages <= members
    assert str(parsed["node"].checkpoint_dir).startswith("/data/")
