"""GPU throughput of single-process training and of the 9-node swarm, by precision and wire format.

Run by ``bench/gpu.sh`` on a GPU machine (one prepared 10-minute run); ``--dry-run`` runs the same code
on the CPU with the tiny model and a couple of iterations (tests/training/test_gpu_bench.py does), so
every part of it except the CUDA device itself is exercised where there is no GPU.

Measures, for each model (default ``small`` and ``500m``):

* **reference**: :class:`node.train.reference.ReferenceTrainer` (all 6 stages in one process, full
  paths, 1 data node x 4 microbatches) in fp32 and bf16: tokens/s over the timed iterations;
* **swarm**: the in-process harness of ``skippipe up`` (:class:`node.launch.inproc_swarm.InProcessSwarm`: one p2pd +
  hivemind DHT per node, real libp2p streams and DecentralizedAverager) on the schedule of
  ``skippipe up``: 9 nodes = 2 data nodes + replicas 2,2,1,1,1, paths of 4 of 6 stages, with the
  ``fp32``, ``bf16`` and ``int8`` wire formats (compute precision: ``--precision``, default bf16 on a
  GPU that supports it): tokens/s, data-plane bytes per token (activations, gradients and control
  frames as sent by every node's DataPlane; the replicas' all-reduce goes through hivemind and is not
  in this figure), the wire's real cost per activation/gradient element (``hop_bytes_per_element``:
  tensor payload bytes, codec scales included, over the elements the frames carried) and the per-iteration phase times of node 0 (microbatches, averaging, norm
  exchange, step).

No corpus is needed: the tokens are uniformly random ids (throughput does not depend on them).
Each configuration's result is written to ``OUT/<model>-<kind>-<variant>.json`` as soon as it is
measured, a configuration that no longer fits in ``--budget-s`` is recorded as skipped, and the
table is printed at the end (also ``OUT/summary.json``). A configuration that raises is recorded as
failed (with its traceback on stderr) and the others still run, but the exit status is then 1 and
the last lines name every failed configuration and why: a GPU run in which everything crashed
must not look like a success. An unknown model, wire format or precision is an ``error:`` line.

The reference needs neither hivemind nor libp2p (``node.train.reference`` imports neither), so its
figures are measured on a machine that has only torch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import sys
import time
import traceback
from typing import List, Optional, Sequence

_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402

ROOT = _HERE.parent
SWARM_SCHEDULE = dict(data_nodes=2, replicas=[2, 2, 1, 1, 1], path_length=4, microbatches=4, memory=2)
REF_MICROBATCHES = 4
#: microbatch size per model (500m: 4 x 1024 tokens fits 9 nodes' activations on one GPU; notes/gpu.md)
MICROBATCH = {"tiny": 2, "small": 8, "500m": 4}
#: a swarm configuration is started only with at least this much budget left (start-up ~45-52 s, notes/gpu.md)
SWARM_MIN_LEFT_S = 75.0


def synthetic_splits(vocab_size: int, n_tokens: int, seed: int = 0):
    from node.train.data import TokenSplits

    g = torch.Generator().manual_seed(seed)
    return TokenSplits(train=torch.randint(0, vocab_size, (n_tokens,), generator=g, dtype=torch.int64),
                       val=torch.randint(0, vocab_size, (n_tokens // 10 + 1,), generator=g, dtype=torch.int64),
                       vocab_size=vocab_size)


def _data(model: str, seq_len: Optional[int]):
    from node.train.data import DataConfig
    from node.train.model import model_config

    mcfg = model_config(model)
    seq = seq_len or (min(mcfg.context, 64) if model == "tiny" else mcfg.context)
    return mcfg, DataConfig(microbatch_size=MICROBATCH[model], seq_len=seq)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def bench_reference(model: str, precision: str, device: str, iterations: int, warmup: int,
                    seq_len: Optional[int] = None) -> dict:
    from node.launch.schedules import build_schedule
    from node.train.reference import ReferenceTrainer
    from node.train.runtime import OptimConfig

    mcfg, data = _data(model, seq_len)
    splits = synthetic_splits(mcfg.vocab_size, 64 * data.seq_len * data.microbatch_size * REF_MICROBATCHES)
    schedule = build_schedule(mcfg.n_stages, data_nodes=1, replicas=[1] * (mcfg.n_stages - 1),
                              path_length=mcfg.n_stages, microbatches=REF_MICROBATCHES, memory=REF_MICROBATCHES)
    ref = ReferenceTrainer(mcfg, OptimConfig(), data, splits, schedule, device=device, precision=precision)
    for _ in range(warmup):
        ref.train_iteration()
    _sync(device)
    t0 = time.perf_counter()
    losses = [ref.train_iteration() for _ in range(iterations)]
    _sync(device)
    seconds = time.perf_counter() - t0
    tokens = iterations * REF_MICROBATCHES * data.microbatch_size * data.seq_len
    return {"kind": "reference", "model": model, "precision": precision, "device": device,
            "microbatch_size": data.microbatch_size, "seq_len": data.seq_len, "iterations": iterations,
            "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "final_loss": losses[-1]}


async def _swarm(model: str, precision: str, wire: str, device: str, iterations: int, warmup: int,
                 seq_len: Optional[int]) -> dict:
    from node.launch.inproc_swarm import InProcessSwarm
    from node.launch.schedules import build_schedule
    from node.train.averaging import AveragingConfig, averaging_compression_for_wire
    from node.train.runtime import OptimConfig
    from node.train.trainer import TrainerConfig

    mcfg, data = _data(model, seq_len)
    splits = synthetic_splits(mcfg.vocab_size, 64 * data.seq_len * data.microbatch_size * 8)
    schedule = build_schedule(mcfg.n_stages, reorder=True, **SWARM_SCHEDULE)
    cfg = TrainerConfig(run_id=f"gpu-{model}-{wire}", model=mcfg, optim=OptimConfig(), data=data, device=device,
                        precision=precision, wire=wire,
                        averaging=AveragingConfig(compression=averaging_compression_for_wire(wire)),
                        iteration_timeout_s=300.0)
    t_start = time.perf_counter()
    async with InProcessSwarm(schedule, cfg, splits) as swarm:
        startup_s = time.perf_counter() - t_start
        await swarm.train(warmup)
        planes = [n.dataplane for n in swarm.nodes if n.dataplane is not None]
        sent0 = sum(p.bytes_sent for p in planes)
        hop0 = (sum(p.hop_payload_bytes_sent for p in planes), sum(p.hop_elements_sent for p in planes))
        t0 = time.perf_counter()
        await swarm.train(warmup + iterations)
        seconds = time.perf_counter() - t0
        planes = [n.dataplane for n in swarm.nodes if n.dataplane is not None]
        sent = sum(p.bytes_sent for p in planes) - sent0
        hop_bytes = sum(p.hop_payload_bytes_sent for p in planes) - hop0[0]
        hop_elements = sum(p.hop_elements_sent for p in planes) - hop0[1]
        hist = [s for s in swarm.nodes[0].history if s.iteration >= warmup]
        n_nodes = len(swarm.nodes)
    tokens = sum(s.tokens for s in hist)

    def mean(attr: str) -> float:
        return sum(getattr(s, attr) for s in hist) / max(len(hist), 1)

    return {"kind": "swarm", "model": model, "precision": precision, "wire": wire, "device": device,
            "nodes": n_nodes, "schedule": SWARM_SCHEDULE, "microbatch_size": data.microbatch_size,
            "seq_len": data.seq_len, "iterations": len(hist), "tokens": tokens, "seconds": seconds,
            "startup_s": startup_s, "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "dataplane_bytes": sent, "bytes_per_token": sent / tokens if tokens else None,
            "hop_bytes_per_element": hop_bytes / hop_elements if hop_elements else None,
            "phases_s": {k: mean(k) for k in ("seconds", "microbatch_s", "averaging_s", "norm_exchange_s", "step_s")},
            "final_loss": hist[-1].loss if hist else None,
            "averaging_compression": cfg.averaging.compression}


def bench_swarm(model: str, precision: str, wire: str, device: str, iterations: int, warmup: int,
                seq_len: Optional[int] = None) -> dict:
    import node.compat  # noqa: F401  (the protobuf clash fix, before hivemind)

    return asyncio.run(_swarm(model, precision, wire, device, iterations, warmup, seq_len))


def _row(r: dict) -> str:
    if r.get("skipped") or r.get("failed"):
        state = "FAILED" if r.get("failed") else "skipped"
        return f"{r['model']:5s} {r['kind']:9s} {r.get('variant', ''):12s} {state}: {r.get('failed') or r['skipped']}"
    variant = r["precision"] if r["kind"] == "reference" else f"{r['precision']}/{r['wire']}"
    extra = ""
    if r["kind"] == "swarm":
        ph = r["phases_s"]
        extra = (f"  {r['bytes_per_token']:9.0f} B/tok {r['hop_bytes_per_element'] or 0:5.2f} B/el"
                 f"  it {ph['seconds']:.2f}s = mb {ph['microbatch_s']:.2f} "
                 f"+ avg {ph['averaging_s']:.2f} + norm {ph['norm_exchange_s']:.2f} + step {ph['step_s']:.2f}")
    return f"{r['model']:5s} {r['kind']:9s} {variant:12s} {r['tokens_per_s']:10.0f} tok/s{extra}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="torch device (default cuda)")
    p.add_argument("--models", default=None,
                   help="comma-separated model sizes (default small,500m; tiny with --dry-run)")
    p.add_argument("--precision", default="auto", help="swarm compute precision (default: bf16 on a GPU, else fp32)")
    p.add_argument("--wires", default="fp32,bf16,int8", help="swarm wire formats (default fp32,bf16,int8)")
    p.add_argument("--ref-precisions", default="fp32,bf16")
    p.add_argument("--ref-iterations", type=int, default=10)
    p.add_argument("--swarm-iterations", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's context)")
    p.add_argument("--budget-s", type=float, default=540.0, help="stop starting new configurations after this")
    p.add_argument("--no-swarm", action="store_true", help="reference only (no hivemind needed)")
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results" / "gpu")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny model, 2 iterations, seq 32: checks the script where there is no GPU")
    args = p.parse_args(argv)
    if args.dry_run:
        args.device, args.models, args.seq_len = "cpu", args.models or "tiny", args.seq_len or 32
        args.ref_iterations, args.swarm_iterations, args.warmup = 2, 2, 1
    from node.train.precision import PRECISIONS, resolve_device, resolve_precision
    from protocol.compression import WIRE_FORMATS

    try:
        device = resolve_device(args.device)
        precision = resolve_precision(args.precision, device)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    models = _names(args.models or "small,500m", MICROBATCH, "model")
    wires = _names(args.wires, WIRE_FORMATS, "wire format")
    ref_precisions = _names(args.ref_precisions, PRECISIONS, "precision")
    if not ref_precisions and (args.no_swarm or not wires):
        raise SystemExit("error: nothing to measure (no reference precision, and no swarm wire format)")
    t_begin = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    info = {"device": device, "torch": torch.__version__, "dry_run": args.dry_run,
            "gpu": torch.cuda.get_device_name(torch.device(device)) if torch.device(device).type == "cuda" else None,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count()}
    print(f"gpu bench on {info['gpu'] or device} (torch {info['torch']}), budget {args.budget_s:.0f}s", flush=True)
    results: List[dict] = []

    def left() -> float:
        return args.budget_s - (time.perf_counter() - t_begin)

    def record(r: dict, name: str) -> None:
        r["host"] = info
        (args.out / f"{name}.json").write_text(json.dumps(r, indent=1))
        results.append(r)
        print(_row(r), flush=True)

    failed: List[str] = []

    def run(kind: str, model: str, variant: str, name: str, measure) -> None:
        try:
            record(measure(), name)
        except Exception as e:  # noqa: BLE001 - one failed configuration must not lose the others' figures
            why = f"{type(e).__name__}: {e}"[:300]
            record({"kind": kind, "model": model, "variant": variant, "failed": why}, name)
            traceback.print_exc()
            failed.append(f"{name}: {why}")

    for model in models:
        for prec in ref_precisions:
            name = f"{model}-reference-{prec}"
            if left() <= 10:
                record({"kind": "reference", "model": model, "variant": prec, "skipped": "out of budget"}, name)
                continue
            run("reference", model, prec, name,
                lambda: bench_reference(model, prec, device, args.ref_iterations, args.warmup, args.seq_len))
    if not args.no_swarm:
        for model in models:
            for wire in wires:
                name = f"{model}-swarm-{wire}"
                if left() < (SWARM_MIN_LEFT_S if not args.dry_run else 0):
                    record({"kind": "swarm", "model": model, "variant": wire, "skipped": "out of budget"}, name)
                    continue
                run("swarm", model, wire, name, lambda: bench_swarm(model, precision, wire, device,
                                                                   args.swarm_iterations, args.warmup, args.seq_len))
    summary = {"host": info, "wall_s": time.perf_counter() - t_begin, "results": results, "failed": failed}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print("\n".join(["", "model kind      variant       throughput", *[_row(r) for r in results]]))
    print(f"wrote {args.out}/*.json in {summary['wall_s']:.0f}s")
    if failed:
        print(f"error: {len(failed)} of {len(results)} configurations failed:", *failed, sep="\n  ", file=sys.stderr)
        return 1
    return 0


def _names(csv: str, known, what: str) -> List[str]:
    """The comma-separated ``csv`` as a list; a name not in ``known`` is a user error (a typo must not
    turn into a run that measures nothing and reports success)."""
    names = [x for x in csv.split(",") if x]
    unknown = [x for x in names if x not in known]
    if unknown:
        raise SystemExit(f"error: unknown {what} {', '.join(unknown)} (known: {', '.join(known)})")
    return names


if __name__ == "__main__":
    sys.exit(main())
