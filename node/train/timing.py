"""What the microbatch deadlines are built from: this stage's forward time and the links between members."""

from __future__ import annotations

import time
from typing import Callable, Optional, Tuple

import torch

from scheduler.simulator import allreduce_time_s

__all__ = ["deadline_links", "measure_forward_s", "synchronize", "emulated_allreduce_s"]

LinkEstimate = Callable[[str, str], Optional[Tuple[float, float]]]


def deadline_links(emulation, measured: Optional[LinkEstimate], peer_id: str) -> Optional[LinkEstimate]:
    """Link estimates for the deadlines: the emulated links when links are emulated (the measured
    ones run over loopback and know nothing of the WAN the microbatches really cross), else measured."""
    between = emulation.link_between if emulation is not None else None
    if between is None:
        return measured

    def estimate(a: str, b: str):
        spec = between(a, b, peer_id)
        if spec is not None:
            return spec.latency_s, spec.bandwidth_Bps
        return measured(a, b) if measured is not None else None

    return estimate


def synchronize(device) -> None:
    """Wait until ``device`` has finished the work queued on it. A GPU runs kernels asynchronously, so a
    clock read right after a launch measures the launch, not the work; the CPU has nothing to wait for."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def measure_forward_s(runtime, cfg, stage: int, emulation=None, sync=synchronize) -> float:
    """Seconds of one microbatch forward through this stage (padded when compute is emulated).

    ``cfg`` is the :class:`node.train.common.TrainerConfig`; the probe tensors live on the stage's device,
    which is synchronized (``sync(device)``) before the clock starts and before it is read."""
    padder = emulation.padder if emulation is not None else None
    if padder is not None:
        return padder.target_s("forward", cfg.data.microbatch_size, runtime.n_layers)
    m, d = cfg.model, cfg.data
    device = runtime.device
    x = torch.randn(d.microbatch_size, d.seq_len, m.d_model, device=device)
    times = []
    with torch.no_grad():
        for _ in range(3):
            sync(device)
            t0 = time.perf_counter()
            if stage == 0:
                runtime.module.head_loss(x, torch.zeros(d.microbatch_size, d.seq_len, dtype=torch.long, device=device))
            else:
                runtime.module(x)
            sync(device)
            times.append(time.perf_counter() - t0)
    return sorted(times)[1]


def emulated_allreduce_s(emulation, grads, group, me: str) -> float:
    """Seconds the all-reduce of ``grads`` among ``group`` takes on the emulated links (the slowest link of the
    group, :func:`scheduler.simulator.allreduce_time_s`), as node ``me`` sees them; 0 without link emulation, or
    when a link of the group is not emulated."""
    if emulation is None or emulation.link_emulator is None:
        return 0.0
    peers = list(dict.fromkeys(group))
    if len(peers) < 2:
        return 0.0
    links = {(a, b): emulation.link_between(a, b, me) for a in peers for b in peers if a != b}
    if any(link is None for link in links.values()):
        return 0.0
    n = len(peers)
    latency = [[0.0 if i == j else links[peers[i], peers[j]].latency_s for j in range(n)] for i in range(n)]
    bandwidth = [[1.0 if i == j else links[peers[i], peers[j]].bandwidth_Bps for j in range(n)] for i in range(n)]
    nbytes = sum(g.numel() * g.element_size() for g in grads if g is not None)
    return allreduce_time_s(nbytes, range(n), latency, bandwidth)
