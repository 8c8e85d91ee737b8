"""``skippipe export``: gather every stage of a run into one Hugging Face ``transformers`` Llama folder.

Each node checkpoints only its own stage (``--checkpoint-dir``); pass all of them (or one folder that
holds every ``stage<k>/``) with ``--from``. The result loads with
``transformers.LlamaForCausalLM.from_pretrained(OUT)`` and ``AutoTokenizer.from_pretrained(OUT)``.
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["register"]


def _handler(args: argparse.Namespace) -> int:
    from node.errors import UserError
    from node.eval.export import export_checkpoints

    if args.peer and args.sources:
        raise UserError("pass either --from (checkpoint folders) or --peer (a live swarm), not both")
    if args.peer:
        from node.cli.export_pull import pull_stages
        from node.eval.export import export_loaded

        summary = export_loaded(pull_stages(args.peer), args.out, tokenizer=args.tokenizer, corpus=args.corpus)
    elif not args.sources:
        raise UserError("--from DIR [DIR ...] or --peer MADDR is required: where the run's stages are")
    else:
        summary = export_checkpoints(args.sources, args.out, tokenizer=args.tokenizer, corpus=args.corpus)
    for warning in summary.get("warnings", []):
        print(f"warning: {warning}", file=sys.stderr)
    if args.json:
        json.dump(summary, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(f"exported run {summary['run_id']} at iteration {summary['iteration']}: {summary['n_stages']} stages, "
              f"{summary['n_layers']} layers, {summary['parameters']:,} parameters, {summary['tokenizer']} tokenizer "
              f"(vocab {summary['vocab_size']}) -> {summary['out']} ({', '.join(summary['files'])})")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "export", help="gather a run's stages into a Hugging Face transformers Llama checkpoint",
        description="Gather every stage from local checkpoint folders (each node's --checkpoint-dir, or one folder "
                    "holding stage0/, stage1/, ...) and write a transformers Llama checkpoint: config.json, "
                    "model.safetensors, tokenizer.json, tokenizer_config.json.")
    p.add_argument("--from", dest="sources", nargs="+", metavar="CHECKPOINT_DIR", default=[],
                   help="checkpoint folders that together hold every stage")
    p.add_argument("--peer", nargs="+", metavar="MADDR", default=[], help="pull every stage from the live replicas of a running swarm (an open swarm; a private one "
                        "serves members only)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write the Hugging Face checkpoint to")
    p.add_argument("--tokenizer", default=None, metavar="bytes|bpe:VOCAB|PATH",
                   help="the run's tokenizer (default: the one the checkpoints record; its hash must match)")
    p.add_argument("--corpus", default=None, help="corpus a bpe:VOCAB tokenizer was trained on (default: recorded)")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=_handler)
