"""`skippipe up` takes the model and stage flags of `node run` (--num-stages, --model-config, --tokenizer)."""

import json

import pytest

from node.cli import main
from dataclasses import replace

from node.cli.up_runners import UP_SPEC, UpOptions, _layout, run_up

pytestmark = pytest.mark.timeout(400)


def test_up_num_stages_resizes_the_model_and_the_default_replicas():
    mcfg, data, replicas = _layout(UpOptions(replace(UP_SPEC, num_stages=4)))
    assert mcfg.n_stages == 4 and mcfg.layers_per_stage == 1 and replicas == [2, 2, 1]
    assert data.tokenizer == "byte" and data.tokenizer_hash and mcfg.vocab_size == 256


def test_up_model_config_file(tmp_path):
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"layers": 6, "d_model": 32, "heads": 4, "kv_heads": 2, "ffn": 64, "context": 32,
                             "stages": 3}))
    mcfg, data, replicas = _layout(UpOptions(replace(UP_SPEC, model_config=f, path_length=3)))
    assert (mcfg.n_stages, mcfg.layers_per_stage, mcfg.d_model, data.seq_len) == (3, 2, 32, 32)
    assert replicas == [2, 2]


@pytest.mark.parametrize("extra, message", [
    (["--num-stages", "1"], "--num-stages must be at least 2"),
    (["--num-stages", "3"], "path length must be in 1..3"),
    (["--tokenizer", "bpe:12"], "at least 257"),
    (["--corpus", "/nonexistent/corpus.txt"], "no such file or folder"),
])
def test_up_rejects_bad_model_flags_with_one_line(extra, message, capsys, tmp_path):
    assert main(["up", "--out", str(tmp_path)] + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


async def test_up_in_process_trains_on_four_stages(tmp_path):
    spec = replace(UP_SPEC, iterations=2, num_stages=4, path_length=3, microbatches=2)
    summary = await run_up(UpOptions(spec, out=str(tmp_path), data_nodes=1, replicas="1", quiet=True, in_process=True))
    assert summary["n_stages"] == 4 and summary["nodes"] == 4 and summary["iterations"] == 2
