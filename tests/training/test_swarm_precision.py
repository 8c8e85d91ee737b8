"""A swarm training in bf16 with the int8 wire against the single-process reference doing the same.

Real hivemind P2P/DHT on 127.0.0.1 (the in-process harness of ``skippipe up``). One data node and one
replica per stage, so no all-reduce: every difference would come from the data plane (codec at each
hop, the guard accepting the run's codec, H2D placement) or from the stage's autocast. The reference
(:class:`node.train.reference.ReferenceTrainer` with ``precision="bf16", wire="int8"``) runs the same
StageRuntime code and passes every hop through the same codec.

Tolerance: parameters within ``BF16_SWARM_ABS`` = 1e-4 absolute after 3 AdamW steps (the swarm's nodes
run with 1 torch thread, the reference with the default count; bf16 matmuls may then round differently
in the last bit, which an int8 block scale can amplify to one quantization step on one element).
"""

import math

import pytest

from node.launch.inproc_swarm import InProcessSwarm
from node.launch.schedules import build_schedule
from node.train.data import DataConfig
from node.train.model import model_config
from node.train.reference import ReferenceTrainer
from node.train.runtime import OptimConfig
from node.train.trainer import TrainerConfig

pytestmark = pytest.mark.timeout(400)

BF16_SWARM_ABS = 1e-4


async def test_bf16_int8_swarm_matches_the_bf16_int8_reference(splits):
    iterations = 3
    cfg = TrainerConfig(run_id="bf16-int8", model=model_config("tiny", n_stages=3), optim=OptimConfig(lr=3e-3),
                        data=DataConfig(microbatch_size=2, seq_len=32), precision="bf16", wire="int8")
    schedule = build_schedule(3, data_nodes=1, replicas=[1, 1], path_length=3, microbatches=2, memory=2)
    reference = ReferenceTrainer(cfg.model, cfg.optim, cfg.data, splits, schedule, seed=cfg.seed,
                                 precision="bf16", wire="int8")
    ref_losses = [reference.train_iteration() for _ in range(iterations)]
    async with InProcessSwarm(schedule, cfg, splits) as swarm:
        stats = await swarm.train(iterations)
        worst = 0.0
        for stage, nodes in enumerate(schedule["stages"]):
            for n in nodes:
                for p, q in zip(swarm.nodes[n].runtime.parameters(), reference.stages[stage].parameters()):
                    worst = max(worst, float((p.detach() - q.detach()).abs().max()))
        rejected = sum(sum(n.dataplane.rejected.values()) for n in swarm.nodes)
        compressed = [n.dataplane.compression for n in swarm.nodes]
    assert compressed == ["int8"] * 3
    assert rejected == 0  # every int8 frame passed the guards
    assert [s.microbatches for s in stats] == [2] * iterations
    assert stats[0].loss == pytest.approx(ref_losses[0], abs=1e-3)
    assert worst <= BF16_SWARM_ABS, f"swarm parameters differ from the bf16/int8 reference by {worst}"
    assert ref_losses[-1] < ref_losses[0]


async def test_fp16_swarm_skips_a_forced_overflow_on_every_node(splits):
    """fp16 with its dynamic loss scale: one stage's gradient overflows in the first iteration; every
    member, both data nodes included, skips that step (the infinite norm travels in the norm records) and
    halves its scale, so all scales still agree, and training goes on with finite steps."""
    iterations = 3
    cfg = TrainerConfig(run_id="fp16-overflow", model=model_config("tiny", n_stages=3), optim=OptimConfig(lr=3e-3),
                        data=DataConfig(microbatch_size=2, seq_len=32), precision="fp16")
    schedule = build_schedule(3, data_nodes=2, replicas=[1, 1], path_length=3, microbatches=2, memory=2)
    async with InProcessSwarm(schedule, cfg, splits) as swarm:
        victim = swarm.nodes[schedule["stages"][1][0]].runtime
        plain = victim._gradient_out
        forced = []

        def overflowing(g):  # the first gradient this stage sends back is infinite, as an fp16 overflow makes it
            if not forced:
                forced.append(True)
                g = g * float("inf")
            return plain(g)

        victim._gradient_out = overflowing
        await swarm.train(iterations)
        data_nodes = [swarm.nodes[i] for i in schedule["stages"][0]]
        histories = [[(s.iteration, math.isfinite(s.grad_norm)) for s in n.history] for n in data_nodes]
        scales = {n.runtime.loss_scale for n in swarm.nodes}
    assert forced and len(data_nodes) == 2
    assert histories == [[(0, False), (1, True), (2, True)]] * 2, histories
    assert scales == {2.0 ** 15}  # 2^16 halved once, on every node
