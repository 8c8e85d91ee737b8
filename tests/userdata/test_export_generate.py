"""`skippipe export` -> transformers Llama, and `skippipe generate`/`eval` on gathered checkpoints."""

from __future__ import annotations

import json
import math

import pytest
import torch

from node.cli import main
from node.eval.generate import next_token_logits
from node.eval.omission import load_checkpoint_dirs
from node.train.model import model_config

from tests.userdata.helpers import save_node_checkpoints


def test_export_loads_in_transformers_with_matching_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    dirs = save_node_checkpoints(tmp_path / "ckpt")
    out = tmp_path / "hf"
    assert main(["export", "--from", *map(str, dirs), "--out", str(out)]) == 0
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32)
    hf.eval()
    ours = load_checkpoint_dirs(dirs)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = next_token_logits(ours.modules, ids, tuple(range(ours.n_stages)))
        got = hf(input_ids=ids).logits
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=1e-4, rtol=0), (got - expected).abs().max()
    # the exported byte tokenizer encodes text as its UTF-8 bytes
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "To be, or not to be: é"
    assert tok(text)["input_ids"] == list(text.encode("utf-8"))
    assert tok.decode(list(text.encode("utf-8"))) == text


def test_export_grouped_query_and_several_layers_per_stage(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = model_config("tiny", n_stages=3, layers_per_stage=2, n_heads=8, n_kv_heads=2, d_model=64)
    dirs = save_node_checkpoints(tmp_path / "ckpt", cfg=cfg)
    out = tmp_path / "hf"
    assert main(["export", "--from", *map(str, dirs), "--out", str(out)]) == 0
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    assert hf.config.num_hidden_layers == 6 and hf.config.num_key_value_heads == 2
    ours = load_checkpoint_dirs(dirs)
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf(input_ids=ids).logits - next_token_logits(ours.modules, ids, (0, 1, 2))).abs().max()
    assert diff < 1e-4


def test_export_errors_are_one_line(tmp_path, capsys):
    dirs = save_node_checkpoints(tmp_path / "ckpt")
    assert main(["export", "--from", *map(str, dirs[:-1]), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "missing stages [5]" in err[0]
    assert main(["export", "--from", str(tmp_path / "nope"), "--out", str(tmp_path / "hf")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["export", "--peer", "/ip4/127.0.0.1/tcp/1/p2p/QmX", "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err


@pytest.mark.parametrize("fill", [math.nan, 0.0])
def test_export_refuses_non_finite_weights_and_warns_about_all_zero_ones(tmp_path, capsys, fill):
    from node.train.checkpoint import CheckpointStore

    dirs = save_node_checkpoints(tmp_path / "ckpt")
    store = CheckpointStore(dirs[1], "run1", 1, "peer1")
    ckpt = store.load()
    store.save(ckpt.iteration, {"model": {k: torch.full_like(v, fill) for k, v in ckpt.state["model"].items()}},
               ckpt.meta)
    code = main(["export", "--from", *map(str, dirs), "--out", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if math.isnan(fill):
        lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
        assert code == 2 and len(lines) == 1 and "stage 1 holds non-finite weights" in lines[0], err
        assert not (tmp_path / "hf").exists()
    else:
        assert code == 0 and "warning: stage 1: " in err and "all zero" in err, err


def test_generate_and_eval_take_gathered_checkpoints(tmp_path, capsys):
    dirs = save_node_checkpoints(tmp_path / "ckpt")
    args = ["generate", "--checkpoint", *map(str, dirs), "--prompt", "ROMEO:", "--max-new-tokens", "12",
            "--temperature", "0"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert first.startswith("ROMEO:")
    assert main(args) == 0 and capsys.readouterr().out == first  # greedy is deterministic
    assert main(args[:-2] + ["--temperature", "1.0", "--top-k", "5", "--keep-stages", "0,2,4"]) == 0
    assert capsys.readouterr().out.startswith("ROMEO:")
    assert main(["generate", "--checkpoint", *map(str, dirs), "--prompt", "x", "--keep-stages", "1,2"]) == 2
    assert "stage 0" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", *map(str, dirs), "--batches", "2", "--keep-stages", "0,1,3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rows"][0]["kept"] == [0, 1, 2, 3, 4, 5] and report["rows"][1]["kept"] == [0, 1, 3]


def test_export_ships_the_runs_bpe_tokenizer(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from node.train.data import DataConfig, resolve_data_config

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(f"The {i}th line of a small corpus, said the {i % 7}th speaker." for i in range(400)))
    data, tok = resolve_data_config(DataConfig(corpus=str(corpus), tokenizer="bpe", bpe_vocab_size=300))
    dirs = save_node_checkpoints(tmp_path / "ckpt", cfg=model_config("tiny", vocab_size=tok.vocab_size), data=data)
    out = tmp_path / "hf"
    assert main(["export", "--from", *map(str, dirs), "--out", str(out)]) == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "The 12th line, said the speaker."
    assert hf_tok(text)["input_ids"] == [int(i) for i in tok.encode(text)]
    # a tokenizer whose vocabulary does not fit the model is refused in one line
    small = save_node_checkpoints(tmp_path / "ckpt256", data=data)
    assert main(["export", "--from", *map(str, small), "--out", str(tmp_path / "hf2")]) == 2
    assert "model's vocabulary is 256" in capsys.readouterr().err
