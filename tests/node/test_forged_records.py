"""An outsider forges every per-member training record while a small private swarm trains.

Three real daemons (``skippipe node run --train --swarm-key``, one per stage) train a few
iterations. An outsider, a plain hivemind DHT peer joined to the swarm's DHT without the swarm key,
writes the records that froze a private swarm before records were owner-signed: norm records of
every iteration (under each member's peer id as a plain subkey, and signed under its own key)
claiming a gradient norm of 1e15 and loss 0, start records pinning epoch 424242, and finished
records. Training must not notice: every member commits every iteration, the loss stays a sane
number, and the members report the forgeries they ignored (``rejected_records`` in the ``training``
RPC), so the forgeries did reach them. No timing assertion; a hang fails through the timeout.
"""

from __future__ import annotations

import math
import os
import threading
import time

import pytest

from node.net.records import START_RECORD_TTL_S, SCHEMA_VERSION, finished_key, norm_key, start_key
from node.net.rpc import call_http
from node.launch.process_swarm import ProcessSwarm, training_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RUN_ID = "forged-run"
ITERATIONS = 6
SIZES = [1, 1, 1]


class Forger(threading.Thread):
    """Rewrites the forged records every second until stopped."""

    def __init__(self, swarm: ProcessSwarm, member_ids: list[str]):
        super().__init__(daemon=True)
        self.swarm, self.member_ids = swarm, member_ids
        self.stop_event = threading.Event()
        self.stored = 0  # forged values some DHT node accepted
        self.first_round = threading.Event()  # every forged record was written once
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def _run(self) -> None:
        import node.compat  # noqa: F401
        from hivemind import DHT
        from hivemind.dht.crypto import RSASignatureValidator
        from hivemind.utils.crypto import RSAPrivateKey

        while not self.swarm.nodes[0].ready_file.exists() and not self.stop_event.is_set():
            time.sleep(0.2)
        time.sleep(0.5)
        signer = RSASignatureValidator(RSAPrivateKey())
        dht = DHT(initial_peers=[self.swarm.bootstrap_maddr], start=True, client_mode=True,
                  record_validators=[signer])
        try:
            while not self.stop_event.is_set():
                epoch = 0
                try:
                    epoch = int(call_http(self.swarm.nodes[0].rpc_url, "schedule", {}).get("epoch") or 0)
                except Exception:  # noqa: BLE001 - the schedule may not be out yet
                    pass
                # Past every record's TTL: a DHT read keeps the one replica's dictionary that expires
                # last, so this makes the forged entries the ones the members read, whichever node
                # holds them; the reader must drop them all the same.
                expiry = time.time() + 2 * START_RECORD_TTL_S
                norm = {"v": SCHEMA_VERSION, "stage": 0, "sq": 3e30, "checksum": 1.0, "epoch": epoch,
                        "loss_sum": 0.0, "n_mb": 1000, "tokens": 0, "dropped": 0, "avg_group": [], "epochs": []}
                start = {"v": SCHEMA_VERSION, "epoch": 424242, "config": {"forged": 1}, "start": 0,
                         "time": time.time() + 5}
                finished = {"v": SCHEMA_VERSION, "config": {"forged": 1}, "iteration": ITERATIONS - 1,
                            "time": time.time()}
                # The start record first: every member reads it while confirming the start, so
                # each must find (and count) these forgeries.
                writes = [(start_key(RUN_ID), start), (finished_key(RUN_ID), finished)]
                writes += [(norm_key(RUN_ID, it), dict(norm, stage=s)) for it in range(ITERATIONS)
                           for s in range(len(SIZES))]
                for key, value in writes:
                    subkeys = list(self.member_ids) + [signer.local_public_key]
                    for subkey in subkeys:
                        if self.stop_event.is_set():
                            return
                        try:
                            if dht.store(key, value, expiry, subkey=subkey):
                                self.stored += 1
                        except Exception:  # noqa: BLE001 - keep forging
                            pass
                self.first_round.set()
                self.stop_event.wait(1.0)
        finally:
            self.first_round.set()
            dht.shutdown()


def test_forged_records_do_not_disturb_training(tmp_path):
    from node.net.identity import load_or_create_identity

    base = tmp_path / "swarm"
    key = tmp_path / "swarm.key"
    key.write_bytes(os.urandom(32).hex().encode())
    ids = [load_or_create_identity(base / f"node{i}" / "identity.key").peer_id.to_base58() for i in range(3)]
    swarm = ProcessSwarm(
        3, SIZES, base_dir=base, run_id=RUN_ID, heartbeat_s=1.0,
        extra_args=lambda i: ["--swarm-key", str(key), "--train", "--iterations", str(ITERATIONS),
                              "--min-members", "3", "--threads", "1", "--microbatches", "2",
                              "--start-debounce", "6", "--node-name", f"node{i}",
                              "--iteration-timeout", "240", "--agreement-timeout", "400"])
    forger = Forger(swarm, ids)
    forger.start()
    try:
        # Only the founder runs until every forged record is in the DHT: with --min-members 3 no
        # member can pin a start or read a norm record before the forgeries are there to be read.
        swarm.spawn(swarm.nodes[0])
        swarm.wait_ready(swarm.nodes[:1], timeout=240)
        assert forger.first_round.wait(timeout=240), "the forger never finished writing its records"
        assert forger.error is None, forger.error
        for n in swarm.nodes[1:]:
            swarm.spawn(n)
        swarm.wait_ready(swarm.nodes[1:], timeout=240)
        deadline = time.monotonic() + 480
        states = {}
        while time.monotonic() < deadline:
            for n in swarm.nodes:
                assert n.alive, f"node {n.index} exited: {swarm.last_error(n)}"
                st = training_state(n, limit=ITERATIONS)
                if st is not None:
                    states[n.index] = st
            errors = {i: s["error"] for i, s in states.items() if s.get("state") == "error"}
            assert not errors, errors
            if len(states) == 3 and all(s.get("state") == "done" for s in states.values()):
                break
            time.sleep(1.0)
        else:
            raise AssertionError(f"timed out: {[(i, s.get('state'), s.get('committed_iteration')) for i, s in states.items()]}")
        assert forger.error is None, forger.error
        assert forger.stored > 0, "no forged record was accepted by any DHT node: the test proves nothing"
        rejected = {}
        for n in swarm.nodes:
            st = call_http(n.rpc_url, "training", {"limit": ITERATIONS})
            assert [h["iteration"] for h in st["history"]] == list(range(ITERATIONS)), st["history"]
            for h in st["history"]:
                assert math.isfinite(h["loss"]) and 1.0 < h["loss"] < 50.0, h
                assert math.isfinite(h["grad_norm"]) and h["grad_norm"] < 1e6, h
                assert h["active_nodes"] == 3, h
            for reason, count in st["rejected_records"].items():
                rejected[reason] = rejected.get(reason, 0) + count
        assert sum(rejected.values()) > 0, "the members never saw a forged record"
    finally:
        forger.stop_event.set()
        swarm.stop()
        forger.join(timeout=30)
