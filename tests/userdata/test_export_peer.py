"""``skippipe export --peer`` pulls every stage from the live replicas of a running swarm.

Two ``skippipe node run --train`` daemons (stage 0, stage 1) train a few iterations and stay up, idle; the
exporter, a plain libp2p client, pulls both stages over the state-transfer protocol and writes a
``transformers`` checkpoint that loads and whose logits match the stages the daemons hold.
"""

import pytest
import torch

from node.cli import main
from node.cli.export_pull import pull_stages
from node.eval.generate import next_token_logits
from node.launch.process_swarm import ProcessSwarm
from tests.faults.daemon_helpers import train_args, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_export_from_a_live_swarm(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    swarm = ProcessSwarm(2, [1, 1], base_dir=tmp_path / "swarm", run_id="pull", heartbeat_s=1.0,
                         extra_args=lambda i: train_args(3, 2))
    try:
        swarm.start(timeout=240)
        wait_for(swarm, [0, 1], lambda s: s.get("state") == "done", 400, "training to finish")
        maddr = swarm.nodes[0].maddr
        loaded = pull_stages([maddr])
        assert main(["export", "--peer", maddr, "--out", str(tmp_path / "hf")]) == 0
    finally:
        swarm.stop()
    assert loaded.config.n_stages == 2 and loaded.iteration == 2, (loaded.config, loaded.iteration)
    model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    tokens = torch.randint(0, loaded.config.vocab_size, (1, 16))
    ours = next_token_logits(loaded.modules, tokens, list(range(loaded.config.n_stages)))
    with torch.no_grad():
        theirs = model(tokens).logits
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()
    assert "exported run pull" in capsys.readouterr().out
