"""Throughput of the wire protocol for activation-sized tensors, against torch.save and pickle.

Why: activations and gradients are the swarm's bulk traffic, so encoding must not be the
bottleneck next to a home uplink. This measures a full round trip as the daemon does it
(``TensorFrame.from_tensor`` + ``encode`` on the sender, ``decode`` + ``to_tensor`` on the
receiver) for 4 MiB and 32 MiB fp32 activations, next to ``torch.save``/``torch.load`` through
``BytesIO`` and ``pickle`` of the same tensor, and prints medians of a few repeats.

Run: ``python bench/wire_codec.py [--repeats N]``.
"""

from __future__ import annotations

import argparse
import io
import pickle
import statistics
import time
from collections.abc import Callable

import torch

from protocol import ActivationMessage, MicrobatchId, TensorFrame, decode, encode

__all__ = ["main"]

MIB = 1024 * 1024
#: Hidden size of a ~500M-parameter model; activations are (batch*seq) x hidden fp32.
HIDDEN = 1024
#: The two activation sizes the issue asks for: 4 MiB (1024 tokens) and 32 MiB (8 x 1024 tokens).
SIZES_MIB = (4, 32)
#: Repeats per measurement; the median damps noise on shared CPUs.
DEFAULT_REPEATS = 7

_MB_ID = MicrobatchId(run_id="bench", epoch=0, iteration=0, data_node="data-0", index=0)
_ROUTE = ("data-0", "peer-1", "peer-2", "data-0")


def _ours_encode(tensor: torch.Tensor) -> bytes:
    return encode(ActivationMessage(mb=_MB_ID, hop=1, route=_ROUTE, tensor=TensorFrame.from_tensor(tensor)))


def _ours_decode(data: bytes) -> torch.Tensor:
    return decode(data, expect=ActivationMessage).tensor.to_tensor()


def _torch_encode(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def _torch_decode(data: bytes) -> torch.Tensor:
    return torch.load(io.BytesIO(data))


def _pickle_encode(tensor: torch.Tensor) -> bytes:
    return pickle.dumps(tensor, protocol=pickle.HIGHEST_PROTOCOL)


def _pickle_decode(data: bytes) -> torch.Tensor:
    return pickle.loads(data)  # noqa: S301 - benchmark of our own bytes; the daemon never unpickles


METHODS: dict[str, tuple[Callable[[torch.Tensor], bytes], Callable[[bytes], torch.Tensor]]] = {
    "ours (msgpack)": (_ours_encode, _ours_decode),
    "torch.save/load": (_torch_encode, _torch_decode),
    "pickle": (_pickle_encode, _pickle_decode),
}


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first calls pay for imports and allocator growth
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(size_mib: int, repeats: int) -> dict[str, tuple[float, float, float, int]]:
    """Return ``method -> (encode MiB/s, decode MiB/s, round-trip MiB/s, wire bytes)``."""
    tensor = torch.randn(size_mib * MIB // 4 // HIDDEN, HIDDEN, dtype=torch.float32)
    results = {}
    for name, (enc, dec) in METHODS.items():
        data = enc(tensor)
        assert torch.equal(dec(data), tensor), name
        t_enc = _median_seconds(lambda: enc(tensor), repeats)
        t_dec = _median_seconds(lambda: dec(data), repeats)
        results[name] = (size_mib / t_enc, size_mib / t_dec, size_mib / (t_enc + t_dec), len(data))
    return results


def main(argv: list[str] | None = None) -> None:
    """Print the comparison table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the codecs are single-threaded copies; keep torch comparable
    print(f"torch {torch.__version__}, {args.repeats} repeats, medians, MiB/s of tensor payload")
    header = f"{'size':>6}  {'method':<16} {'encode':>9} {'decode':>9} {'roundtrip':>9} {'wire bytes':>11}"
    print(header)
    print("-" * len(header))
    for size in SIZES_MIB:
        results = measure(size, args.repeats)
        for name, (enc, dec, rt, nbytes) in results.items():
            print(f"{size:>4}Mi  {name:<16} {enc:9.0f} {dec:9.0f} {rt:9.0f} {nbytes:11d}")
        ours = results["ours (msgpack)"][2]
        print(
            f"{size:>4}Mi  ratio ours/torch.save {ours / results['torch.save/load'][2]:.2f}x, "
            f"ours/pickle {ours / results['pickle'][2]:.2f}x (round trip)"
        )


if __name__ == "__main__":
    main()
