"""``skippipe generate``: sample text from a gathered checkpoint, optionally with stages omitted."""

from __future__ import annotations

import argparse
import sys

__all__ = ["register"]


def _handler(args: argparse.Namespace) -> int:
    from node.errors import UserError
    from node.eval.export import load_model_tokenizer
    from node.eval.generate import generate_ids
    from node.eval.omission import check_kept_stages, load_checkpoint_dirs, parse_stage_list
    from node.train.branch_scaling import inference_branch_scale

    if args.max_new_tokens < 0:
        raise UserError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.threads is not None:
        if args.threads < 1:
            raise UserError(f"--threads must be at least 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    loaded = load_checkpoint_dirs(args.checkpoint)
    n = loaded.n_stages
    kept = check_kept_stages(parse_stage_list(args.keep_stages), n) if args.keep_stages else tuple(range(n))
    tok = load_model_tokenizer(loaded, args.tokenizer, args.corpus)
    prompt = [int(i) for i in tok.encode(args.prompt)]
    ids = generate_ids(loaded.modules, prompt, kept, args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, seed=args.seed,
                       branch_scale=inference_branch_scale(loaded.branch_scaling, n, len(kept)))
    sys.stdout.write(tok.decode(ids) + "\n")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="sample text from a checkpoint (stages may be omitted)",
        description="Load a run's stages (one folder holding every stage<k>/, or every node's --checkpoint-dir) and "
                    "continue a prompt. Stage 0 always runs; --keep-stages leaves the others out.")
    p.add_argument("--checkpoint", nargs="+", required=True, metavar="DIR", help="checkpoint folder(s) of the run")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=100, metavar="N", help="tokens to generate (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T", help="sampling temperature; 0 = greedy (default %(default)s)")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="sample only among the K likeliest tokens")
    p.add_argument("--keep-stages", default=None, metavar="0,S1,...", help="stages to run (must include 0; default all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's; 1 is fastest for small models on a busy machine)")
    p.add_argument("--tokenizer", default=None, metavar="bytes|bpe:VOCAB|PATH",
                   help="the run's tokenizer (default: the one the checkpoint records)")
    p.add_argument("--corpus", default=None, help="corpus a bpe:VOCAB tokenizer was trained on (default: recorded)")
    p.set_defaults(func=_handler)
