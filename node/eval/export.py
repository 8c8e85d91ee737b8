"""Export a swarm-trained model as a Hugging Face ``transformers`` Llama checkpoint.

Our decoder is the Llama architecture, so the export is a renaming of weights, no conversion:

- rotary embeddings rotate the pairs ``(x[i], x[i + head_dim/2])`` with frequencies
  ``theta^(-2i/head_dim)`` (:func:`node.train.model.apply_rotary`), the same "rotate half" layout as
  ``transformers``' Llama, so q/k weights are copied without permutation;
- RMSNorm with ``eps`` = :data:`~node.train.model.NORM_EPS`, computed the same way;
- untied embedding and LM head (``tie_word_embeddings: false``), no biases, SwiGLU MLP;
- layer ``j`` of stage ``s`` is layer ``s * layers_per_stage + j`` (stage 0's layers run first, after
  the embedding; stage 0 also holds the final norm and the LM head).

The export folder gets ``config.json``, ``model.safetensors``, ``generation_config.json``,
``tokenizer.json`` and ``tokenizer_config.json`` (a ``PreTrainedTokenizerFast``), so
``LlamaForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)`` load it without
this package. ``transformers`` itself is not needed to export (only ``safetensors``).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
from typing import Dict, List, Optional, Sequence

import torch

from node.errors import UserError
from node.eval.omission import LoadedModel, load_checkpoint_dirs
from node.train.model import NORM_EPS, ROPE_THETA, ModelConfig, StageModule

__all__ = ["hf_config", "hf_state_dict", "export_model", "export_checkpoints", "export_loaded", "load_model_tokenizer"]

logger = logging.getLogger(__name__)

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}


def hf_config(cfg: ModelConfig) -> Dict[str, object]:
    """``config.json`` of the equivalent ``LlamaForCausalLM``."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.context,
        "rms_norm_eps": NORM_EPS,
        "rope_theta": ROPE_THETA,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "torch_dtype": "float32",
        "initializer_range": 0.02,
        "use_cache": True,
    }


def hf_state_dict(modules: Sequence[StageModule]) -> Dict[str, torch.Tensor]:
    """Weights of every stage under ``transformers``' Llama names (fp32, contiguous, no sharing)."""
    if not modules:
        raise UserError("no stages to export")
    cfg = modules[0].cfg
    stage0 = modules[0]
    assert stage0.embedding is not None and stage0.final_norm is not None and stage0.lm_head is not None
    out: Dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": stage0.embedding.weight,
        "model.norm.weight": stage0.final_norm.weight,
        "lm_head.weight": stage0.lm_head.weight,
    }
    for s, module in enumerate(modules):
        for j, layer in enumerate(module.layers):
            index = s * cfg.layers_per_stage + j
            for ours, tensor in layer.state_dict().items():
                if ours not in _LAYER_NAMES:
                    raise UserError(f"unexpected weight {ours!r} in stage {s}; cannot export")
                out[f"model.layers.{index}.{_LAYER_NAMES[ours]}"] = tensor
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in out.items()}


def load_model_tokenizer(loaded: LoadedModel, tokenizer: Optional[str] = None, corpus: Optional[str] = None):
    """The tokenizer a gathered checkpoint was trained with (recorded in its meta; ``tokenizer`` /
    ``corpus`` override), checked against the model's vocabulary and the recorded hash."""
    from node.eval.omission import data_config_for
    from node.train.data import load_tokenizer

    data = data_config_for(loaded.meta, loaded.config, corpus=corpus, tokenizer=tokenizer)
    tok = load_tokenizer(data)
    if tok.vocab_size != loaded.config.vocab_size:
        raise UserError(f"tokenizer {data.tokenizer!r} has {tok.vocab_size} tokens but the model's vocabulary is "
                        f"{loaded.config.vocab_size}; pass the run's tokenizer with --tokenizer")
    return tok


def _write_json(path: pathlib.Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def export_model(loaded: LoadedModel, out: "str | os.PathLike", tokenizer=None) -> List[pathlib.Path]:
    """Write ``loaded`` as a transformers Llama folder; returns the files written."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise UserError("exporting needs the safetensors package (pip install safetensors)") from None
    out = pathlib.Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    cfg = loaded.config
    written = []
    config = hf_config(cfg)
    config["skippipe"] = {"run_id": loaded.meta.get("run_id"), "iteration": loaded.iteration,
                          "n_stages": cfg.n_stages, "layers_per_stage": cfg.layers_per_stage,
                          "tokenizer_hash": getattr(tokenizer, "hash", None)}
    _write_json(out / "config.json", config)
    written.append(out / "config.json")
    _write_json(out / "generation_config.json", {"do_sample": False, "max_length": cfg.context})
    written.append(out / "generation_config.json")
    tmp = out / "model.safetensors.tmp"
    save_file(hf_state_dict(loaded.modules), str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    written.append(out / "model.safetensors")
    if tokenizer is not None:
        (out / "tokenizer.json").write_text(tokenizer.to_json(), encoding="utf-8")
        _write_json(out / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast",
                                                    "model_max_length": cfg.context, "clean_up_tokenization_spaces": False})
        written += [out / "tokenizer.json", out / "tokenizer_config.json"]
    return written


def export_checkpoints(paths: Sequence["str | os.PathLike"], out: "str | os.PathLike", tokenizer: Optional[str] = None,
                       corpus: Optional[str] = None) -> Dict[str, object]:
    """Gather the stages from ``paths`` and export them; returns a summary for the command to print."""
    return export_loaded(load_checkpoint_dirs(list(paths)), out, tokenizer, corpus)


def check_weights(loaded: LoadedModel) -> List[str]:
    """Refuse a stage with non-finite weights (:class:`UserError`); return a warning per stage with
    all-zero tensors (a trained stage has none). Both are what a broken or hostile replica serves,
    and an export must not pass them on silently."""
    warnings = []
    for stage, module in enumerate(loaded.modules):
        state = module.state_dict()
        bad = [k for k, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
        if bad:
            raise UserError(f"stage {stage} holds non-finite weights (NaN or inf) in {len(bad)} tensors "
                            f"({', '.join(bad[:3])}): refusing to export it")
        zero = [k for k, t in state.items() if t.numel() and not bool(t.any())]
        if zero:
            warnings.append(f"stage {stage}: {len(zero)} of {len(state)} tensors are all zero ({', '.join(zero[:3])}"
                            f"{', ...' if len(zero) > 3 else ''}); a trained stage has none: check where it came "
                            "from before using this export")
            logger.warning("%s", warnings[-1])
    return warnings


def export_loaded(loaded: LoadedModel, out: "str | os.PathLike", tokenizer: Optional[str] = None,
                  corpus: Optional[str] = None) -> Dict[str, object]:
    """Export stages already gathered (from checkpoints or live replicas); returns the command's summary."""
    warnings = check_weights(loaded)
    tok = load_model_tokenizer(loaded, tokenizer, corpus)
    files = export_model(loaded, out, tok)
    return {"out": str(pathlib.Path(out).expanduser()), "iteration": loaded.iteration, "run_id": loaded.meta.get("run_id"),
            "n_stages": loaded.config.n_stages, "n_layers": loaded.config.n_layers,
            "parameters": sum(p.numel() for m in loaded.modules for p in m.parameters()),
            "sources": [str(p) for p in loaded.sources], "files": [f.name for f in files],
            "tokenizer": tok.name, "vocab_size": tok.vocab_size, "warnings": warnings}
