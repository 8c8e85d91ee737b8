"""Iteration time and tokens/s of the local swarm (full path vs skip schedule) vs single-process training.

Everything runs on this machine: the swarm is the in-process harness of ``skippipe up`` (one p2pd +
hivemind DHT per node, real libp2p streams and DecentralizedAverager), the baseline is
:class:`node.train.reference.ReferenceTrainer` (the same model, batches and optimizer, no network).
Every configuration processes the same number of microbatches per iteration, so tokens/s are
comparable; ratios are swarm / single-process. On a machine with few cores the swarm's nodes share
them, so this measures protocol + scheduling overhead, not the speed-up of real distributed GPUs.

    python bench/train_local.py [--model tiny|small] [--iterations 8] [--warmup 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional


import torch

from node.launch.inproc_swarm import InProcessSwarm
from node.launch.schedules import build_schedule
from node.train.data import DataConfig, load_splits
from node.spec import DEFAULT_MICROBATCH_SIZE
from node.train.model import model_config
from node.train.reference import ReferenceTrainer
from node.train.runtime import OptimConfig
from node.train.trainer import TrainerConfig

DATA_NODES = 2
MICROBATCHES = 4  # per data node per iteration
MEMORY = 2
SKIP_PATH_LENGTH = 4
SKIP_REPLICAS = [2, 2, 1, 1, 1]
#: IterationStats fields printed per swarm configuration (median seconds per iteration; data node 0's),
#: plus ``barrier_s``: per iteration the smallest norm exchange over all nodes (that of the member that
#: finished averaging last, so it waits for no one: what the barrier itself costs), median over iterations
PHASES = ("microbatch_s", "averaging_s", "norm_exchange_s", "step_s")


@dataclass
class Result:
    name: str
    iteration_s: float  # median over measured iterations
    tokens_per_s: float
    #: swarm only: median seconds per iteration of each commit phase (IterationStats of data node 0)
    phases: Optional[Dict[str, float]] = None


def _median_result(name: str, seconds: List[float], tokens_per_iter: int) -> Result:
    med = statistics.median(seconds)
    return Result(name, med, tokens_per_iter / med)


def bench_reference(name, cfg, splits, schedule, iterations, warmup, threads) -> Result:
    torch.set_num_threads(threads)
    ref = ReferenceTrainer(cfg.model, cfg.optim, cfg.data, splits, schedule, seed=cfg.seed)
    times = []
    for i in range(warmup + iterations):
        t = time.perf_counter()
        ref.train_iteration()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    n_mb = sum(ref.plan.microbatches_of(d) for d in ref.plan.data_nodes)
    return _median_result(name, times, n_mb * cfg.data.microbatch_size * cfg.data.seq_len)


async def bench_swarm(name, cfg, splits, schedule, iterations, warmup) -> Result:
    async with InProcessSwarm(schedule, cfg, splits) as swarm:
        stats = await swarm.train(warmup + iterations)
        its = {s.iteration for s in stats[warmup:]}
        per_it: Dict[int, List[float]] = {}
        for n in swarm.nodes:
            for h in n.history:
                if h.iteration in its:
                    per_it.setdefault(h.iteration, []).append(h.norm_exchange_s)
    measured = stats[warmup:]
    result = _median_result(name, [s.seconds for s in measured], measured[0].tokens)
    result.phases = {phase: statistics.median(getattr(s, phase) for s in measured) for phase in PHASES}
    # the member that finished averaging last waits for nobody: its exchange is the barrier's own cost
    result.phases["barrier_s"] = statistics.median(min(v) for v in per_it.values())
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the single-process baseline (default 1 = what each swarm node gets; "
                         "more threads on a shared, overloaded box can be far slower)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    mcfg = model_config(args.model)
    data = DataConfig(seq_len=min(mcfg.context, 128), microbatch_size=DEFAULT_MICROBATCH_SIZE)
    cfg = TrainerConfig(run_id=f"bench-{args.model}", model=mcfg, optim=OptimConfig(), data=data)
    splits = load_splits(data)
    S = mcfg.n_stages
    full = build_schedule(S, DATA_NODES, [1] * (S - 1), S, MICROBATCHES, MEMORY)
    skip = build_schedule(S, DATA_NODES, SKIP_REPLICAS, SKIP_PATH_LENGTH, MICROBATCHES, MEMORY, reorder=True)
    cores = os.cpu_count() or 1
    threads = args.threads

    results = [
        bench_reference("single-process, full model", cfg, splits, full, args.iterations, args.warmup, threads),
        bench_reference(f"single-process, skip paths (k={1 - SKIP_PATH_LENGTH / S:.2f})", cfg, splits, skip,
                        args.iterations, args.warmup, threads),
    ]
    results.append(asyncio.run(bench_swarm(f"swarm full path ({DATA_NODES + S - 1} nodes)", cfg, splits, full,
                                           args.iterations, args.warmup)))
    results.append(asyncio.run(bench_swarm(
        f"swarm skip schedule ({DATA_NODES + sum(SKIP_REPLICAS)} nodes, path {SKIP_PATH_LENGTH}/{S})", cfg, splits,
        skip, args.iterations, args.warmup)))

    base = results[0]
    tokens = MICROBATCHES * DATA_NODES * data.microbatch_size * data.seq_len
    print(f"model {args.model} ({S} stages x {mcfg.layers_per_stage} layers, d {mcfg.d_model}), {DATA_NODES} data "
          f"nodes x {MICROBATCHES} microbatches x {data.microbatch_size} x {data.seq_len} tokens = {tokens} "
          f"tokens/iteration; {cores} CPU cores, baseline with {threads} torch thread(s); median of {args.iterations} iterations after {args.warmup} warm-up")
    print(f"{'configuration':58s} {'s/iter':>8s} {'tokens/s':>10s} {'time ratio':>11s} {'tok/s ratio':>12s}")
    for r in results:
        print(f"{r.name:58s} {r.iteration_s:8.3f} {r.tokens_per_s:10.0f} {r.iteration_s / base.iteration_s:11.2f} "
              f"{r.tokens_per_s / base.tokens_per_s:12.2f}")
    for r in results:
        if r.phases:
            print(f"{r.name}: median per iteration " + ", ".join(
                f"{k[:-2]} {v:.3f} s" for k, v in r.phases.items())
                  + f"; norm exchange = {100 * r.phases['norm_exchange_s'] / r.iteration_s:.1f}% of the iteration "
                  f"(the barrier itself {100 * r.phases['barrier_s'] / r.iteration_s:.1f}%)")
    swarm_full, swarm_skip = results[2], results[3]
    print(f"swarm skip / swarm full iteration time: {swarm_skip.iteration_s / swarm_full.iteration_s:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in results], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
