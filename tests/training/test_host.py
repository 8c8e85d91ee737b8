"""The daemon is a TrainerHost: it has every member the trainer uses, under the protocol's names."""

from node.swarm.config import DaemonConfig
from node.swarm.daemon import Daemon
from node.train.host import TrainerHost, TrainingMetrics


def _members(protocol) -> set:
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {n for n in vars(protocol) if not n.startswith("_")}
    return names


def test_the_daemon_has_every_member_the_trainer_uses(tmp_path):
    daemon = Daemon(DaemonConfig(identity_path=tmp_path / "identity.key"))
    members = _members(TrainerHost)
    assert {"peer_id", "p2p", "dht", "view", "metrics", "current_epoch", "register_rpc", "on_schedule_epoch",
            "ensure_connected", "peer_alive", "verify_epoch", "fetch_epochs", "link_estimate", "is_peer_allowed",
            "training_progress", "run", "config", "report_failure", "reaches_directly", "leave_out", "move_stage",
            "stages", "training_iteration", "coordination_blocker", "training_ready", "measured_compute",
            "training_sketch"} == members
    assert all(hasattr(daemon, name) for name in members), sorted(n for n in members if not hasattr(daemon, n))
    assert hasattr(daemon.config, "heartbeat_s")
    assert all(hasattr(daemon.metrics, name) for name in _members(TrainingMetrics))
