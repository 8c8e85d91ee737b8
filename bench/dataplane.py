"""Activation throughput and per-hop latency of the node's data plane, next to a raw hivemind stream.

Why: ``node/dataplane/transport.py`` wraps hivemind's binary streams (``P2P.send_raw_data`` with 8-byte
length framing on one persistent stream per neighbour) with the wire protocol (msgpack envelope
around a raw-bytes :class:`~protocol.TensorFrame`). The wrapping should cost little: the target is
data-plane throughput >= 0.80 x the raw stream on the same machine.

Setup: two real ``hivemind.P2P`` instances (each spawns its own p2pd) listening on 127.0.0.1, both
driven from **one uvloop process**; the path is Python -> unix socket -> p2pd -> TCP (noise) ->
p2pd -> unix socket -> Python. Sender and receiver share one event loop (and one Python thread),
so the receiver's decode competes with the sender's encode exactly as it would on one core.

Measured per transfer, stop-and-wait (the next transfer starts when the previous one has arrived):

* **dataplane**: ``TensorFrame.from_tensor`` + ``ActivationMessage`` + ``DataPlane.send`` on A, until
  B's ``on_message`` callback has the decoded message and ``msg.tensor.to_tensor()`` returned.
* **raw**: ``P2P.send_raw_data(tensor_bytes)`` on a persistent stream opened with
  ``call_binary_stream_handler``, until B's handler has ``receive_raw_data`` back (the tensor's
  bytes are taken once outside the timing: transport only, the lower bound of any framing).

The two are interleaved round by round (warm-up first), so load drift on the shared CPUs hits
both; the ratio is the median over rounds of (dataplane median / raw median in that round).
The data plane's time is split by wrapping ``node.dataplane.transport.encode``/``decode`` (in this
process only; the module's file is untouched): frame (from_tensor), encode, send (write + drain
until ``send`` returns), wait (until B's decode starts: the rest of the bytes in flight and
``receive_raw_data``), decode, to_tensor.

Small messages: a 1 KiB fp32 tensor ping-pong. dataplane: A sends an ActivationMessage, B's
callback sends the decoded frame back as a GradientMessage through its own DataPlane (two
persistent streams, one per direction); raw: 1 KiB echoed on one open stream. One hop is half
a round trip.

Run: ``python bench/dataplane.py [--rounds N] [--profile] [--default-malloc]`` (``--profile``: cProfile
of extra 32 MiB data-plane transfers, top functions by total time). By default the bench applies
the node's malloc tuning (node.ops.memory.tune_malloc, as every skippipe process does), so that buffers of
>= 32 MiB are reused from the heap instead of being mmapped and page-faulted afresh for every copy;
``--default-malloc`` measures without it.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import statistics
import time


import node.compat  # noqa: F401  (before hivemind)
from node.compat import import_hivemind

hivemind = import_hivemind()

import torch
import uvloop

import node.dataplane.transport as dataplane_module
from node.dataplane.transport import DataPlane
from protocol import ActivationMessage, GradientMessage, MicrobatchId, TensorFrame

P2P = hivemind.p2p.P2P
MIB = 1024 * 1024
HIDDEN = 1024
SIZES_MIB = (4, 32)
SMALL_BYTES = 1024
RAW_HANDLER = "bench/raw/1"
ECHO_HANDLER = "bench/echo/1"
#: Timed transfers per size and method in each round (after warm-up).
PER_ROUND = {4: 6, 32: 3}
PINGS_PER_ROUND = 60


class _Split:
    """Wall-clock stamps of one data-plane transfer, filled by the wrappers and the callback."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.enc0 = self.enc1 = self.dec0 = self.dec1 = self.recv_done = 0.0


SPLIT = _Split()
_real_encode = dataplane_module.encode_parts
_real_decode = dataplane_module.decode


def _timed_encode(msg):
    SPLIT.enc0 = time.perf_counter()
    data = _real_encode(msg)
    SPLIT.enc1 = time.perf_counter()
    return data


def _timed_decode(data, **kw):
    SPLIT.dec0 = time.perf_counter()
    msg = _real_decode(data, **kw)
    SPLIT.dec1 = time.perf_counter()
    return msg


dataplane_module.encode_parts = _timed_encode
dataplane_module.decode = _timed_decode


def _activation(nbytes: int) -> torch.Tensor:
    return torch.randn(nbytes // 4 // HIDDEN if nbytes >= 4 * HIDDEN else 1, min(HIDDEN, nbytes // 4))


class Bench:
    async def setup(self) -> None:
        self.a = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        maddrs = [str(m) for m in await self.a.get_visible_maddrs()]
        self.b = await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        self.pa, self.pb = str(self.a.peer_id), str(self.b.peer_id)
        self.route = (self.pa, self.pb, self.pa)
        self.mb = MicrobatchId(run_id="bench", epoch=0, iteration=0, data_node=self.pa, index=0)
        self.arrived: asyncio.Future | None = None
        self.to_tensor_on_arrival = True

        def on_b(msg, sender):
            if isinstance(msg, ActivationMessage) and msg.tensor.nbytes > SMALL_BYTES:
                if self.to_tensor_on_arrival:
                    msg.tensor.to_tensor()
                SPLIT.recv_done = time.perf_counter()
                self.arrived.set_result(None)
                return None
            # small ping: send it straight back through B's own data plane
            return self.dp_b.send(sender, GradientMessage(mb=msg.mb, hop=0, route=msg.route, tensor=msg.tensor))

        def on_a(msg, sender):
            self.arrived.set_result(None)

        self.dp_a = DataPlane(self.a, "bench", on_a)
        self.dp_b = DataPlane(self.b, "bench", on_b)
        await self.dp_a.start()
        await self.dp_b.start()

        async def raw_sink(info, reader, writer):
            try:
                while True:
                    data = await P2P.receive_raw_data(reader)
                    if self.arrived is not None and not self.arrived.done():
                        self.arrived.set_result(len(data))
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        async def echo(info, reader, writer):
            try:
                while True:
                    await P2P.send_raw_data(await P2P.receive_raw_data(reader), writer)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        await self.b.add_binary_stream_handler(RAW_HANDLER, raw_sink)
        await self.b.add_binary_stream_handler(ECHO_HANDLER, echo)
        _, _, self.raw_writer = await self.a.call_binary_stream_handler(self.b.peer_id, RAW_HANDLER)
        _, self.echo_reader, self.echo_writer = await self.a.call_binary_stream_handler(self.b.peer_id, ECHO_HANDLER)

    async def close(self) -> None:
        for w in (self.raw_writer, self.echo_writer):
            w.close()
        await self.dp_a.close()
        await self.dp_b.close()
        await self.a.shutdown()
        await self.b.shutdown()

    # ------------------------------------------------------------------ transfers
    async def dp_once(self, tensor: torch.Tensor) -> dict:
        loop = asyncio.get_running_loop()
        self.arrived = loop.create_future()
        SPLIT.reset()
        t0 = time.perf_counter()
        msg = ActivationMessage(mb=self.mb, hop=1, route=self.route, tensor=TensorFrame.from_tensor(tensor))
        t1 = time.perf_counter()
        await self.dp_a.send(self.pb, msg)
        t2 = time.perf_counter()
        await self.arrived
        t3 = time.perf_counter()
        return {
            "total": t3 - t0,
            "frame": t1 - t0,
            "encode": SPLIT.enc1 - SPLIT.enc0,
            "send": t2 - SPLIT.enc1,
            "wait": SPLIT.dec0 - t2,
            "decode": SPLIT.dec1 - SPLIT.dec0,
            "to_tensor": SPLIT.recv_done - SPLIT.dec1,
        }

    async def raw_once(self, data: bytes) -> float:
        loop = asyncio.get_running_loop()
        self.arrived = loop.create_future()
        t0 = time.perf_counter()
        await P2P.send_raw_data(data, self.raw_writer)
        n = await self.arrived
        assert n == len(data)
        return time.perf_counter() - t0

    async def dp_ping(self, frame: TensorFrame) -> float:
        loop = asyncio.get_running_loop()
        self.arrived = loop.create_future()
        t0 = time.perf_counter()
        await self.dp_a.send(self.pb, ActivationMessage(mb=self.mb, hop=1, route=self.route, tensor=frame))
        await self.arrived
        return time.perf_counter() - t0

    async def raw_ping(self, data: bytes) -> float:
        t0 = time.perf_counter()
        await P2P.send_raw_data(data, self.echo_writer)
        back = await P2P.receive_raw_data(self.echo_reader)
        assert len(back) == len(data)
        return time.perf_counter() - t0


def _q(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run(args) -> None:
    bench = Bench()
    await bench.setup()
    try:
        tensors = {s: _activation(s * MIB) for s in SIZES_MIB}
        raws = {s: tensors[s].numpy().tobytes() for s in SIZES_MIB}
        small = _activation(SMALL_BYTES)
        small_frame = TensorFrame.from_tensor(small)
        small_raw = small.numpy().tobytes()
        assert len(small_raw) == SMALL_BYTES

        # warm-up: streams opened, handlers and allocators exercised
        for s in SIZES_MIB:
            for _ in range(2):
                await bench.dp_once(tensors[s])
                await bench.raw_once(raws[s])
        for _ in range(20):
            await bench.dp_ping(small_frame)
            await bench.raw_ping(small_raw)

        dp = {s: [] for s in SIZES_MIB}
        raw = {s: [] for s in SIZES_MIB}
        ratios = {s: [] for s in SIZES_MIB}
        dp_ping, raw_ping, ping_ratios = [], [], []
        for _ in range(args.rounds):
            for s in SIZES_MIB:
                d_round, r_round = [], []
                for _ in range(PER_ROUND[s]):  # alternate, so both see the same load
                    d_round.append(await bench.dp_once(tensors[s]))
                    r_round.append(await bench.raw_once(raws[s]))
                dp[s] += d_round
                raw[s] += r_round
                ratios[s].append(statistics.median(r_round) / statistics.median(x["total"] for x in d_round))
            dpp, rwp = [], []
            for _ in range(PINGS_PER_ROUND):
                dpp.append(await bench.dp_ping(small_frame))
                rwp.append(await bench.raw_ping(small_raw))
            dp_ping += dpp
            raw_ping += rwp
            ping_ratios.append(statistics.median(dpp) / statistics.median(rwp))

        print(f"two hivemind P2P peers (p2pd each) on 127.0.0.1, one uvloop process; {os.cpu_count()} CPUs, "
              f"load avg {os.getloadavg()[0]:.1f}; {args.rounds} rounds after warm-up, stop-and-wait transfers")
        print("throughput, MB/s = 1e6 B/s of tensor payload, median [p25-p75] over all timed transfers")
        print(f"{'size':>7} | {'n':>3} | {'dataplane MB/s':>20} | {'raw stream MB/s':>20} | dp/raw (median of rounds [min-max])")
        for s in SIZES_MIB:
            nb = s * MIB
            d = [nb / x["total"] / 1e6 for x in dp[s]]
            r = [nb / x / 1e6 for x in raw[s]]
            fmt = lambda v: f"{statistics.median(v):6.0f} [{_q(v, .25):4.0f}-{_q(v, .75):4.0f}]"  # noqa: E731
            print(f"{s:>3} MiB | {len(d):>3} | {fmt(d):>20} | {fmt(r):>20} | "
                  f"{statistics.median(ratios[s]):.2f} [{min(ratios[s]):.2f}-{max(ratios[s]):.2f}]")
        print()
        print("dataplane time split, median ms per transfer (frame=from_tensor, send=write+drain after encode,")
        print("wait=until B starts decoding); raw = median ms of the raw transfer")
        keys = ("frame", "encode", "send", "wait", "decode", "to_tensor", "total")
        print(f"{'size':>7} | " + " | ".join(f"{k:>9}" for k in keys) + f" | {'raw':>7}")
        for s in SIZES_MIB:
            cells = " | ".join(f"{statistics.median(x[k] for x in dp[s]) * 1e3:9.2f}" for k in keys)
            print(f"{s:>3} MiB | {cells} | {statistics.median(raw[s]) * 1e3:7.2f}")
        print()
        print(f"small message ({SMALL_BYTES} B fp32 tensor) round trip, ms: median [p10-p90] over {len(dp_ping)} pings")
        for name, v in (("dataplane", dp_ping), ("raw stream", raw_ping)):
            v = [x * 1e3 for x in v]
            print(f"  {name:>10}: RTT {statistics.median(v):.3f} [{_q(v, .1):.3f}-{_q(v, .9):.3f}]"
                  f"  per hop {statistics.median(v) / 2:.3f}")
        over = (statistics.median(dp_ping) - statistics.median(raw_ping)) / 2 * 1e3
        print(f"  data-plane overhead per hop: {over:+.3f} ms (dp/raw RTT ratio, median of rounds: "
              f"{statistics.median(ping_ratios):.2f})")

        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(4):
                await bench.dp_once(tensors[32])
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
            print("\ncProfile, 4 x 32 MiB data-plane transfers, by tottime:")
            print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:6000])
    finally:
        await bench.close()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--profile", action="store_true", help="also cProfile 32 MiB data-plane transfers")
    parser.add_argument("--default-malloc", action="store_true",
                        help="keep glibc's malloc defaults instead of the node's tuning (node.ops.memory.tune_malloc)")
    args = parser.parse_args(argv)
    if not args.default_malloc:
        from node.ops.memory import tune_malloc

        print(f"node.ops.memory.tune_malloc() (as every skippipe process does): {'ok' if tune_malloc() else 'FAILED'}")
    torch.manual_seed(0)
    uvloop.run(run(args))


if __name__ == "__main__":
    main()
