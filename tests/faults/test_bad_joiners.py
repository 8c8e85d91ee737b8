"""Joiners that must not disturb a run: one that trains another model, thirty that are only adverts, one that
does not hold its stage.

Real ``skippipe node run --train`` daemons on 127.0.0.1 (tiny model, one torch thread):

* a joiner whose model differs (``d_model``, layers, context) starts together with the founder's
  honest stage-1 member, at the start barrier: it exits with one ``error:`` line naming the fields, the
  founder and the honest member train to the end, and no epoch ever names it;
* the same joiner arrives while the run trains: it exits the same way, training goes on, and no epoch
  ever names it;
* a peer that answers its admission challenge, enters an epoch and then goes silent (its adverts
  stay fresh) is dropped: a later epoch leaves it out and training goes on;
* an outsider announces 30 identities (adverts signed with 30 keys, copying the run's configuration
  digest, but no daemon behind them) to a training swarm: they show ONLINE in the founder's view,
  yet no epoch ever names one of them (they never answer their admission challenge), and training
  goes on;
* a candidate daemon that holds wrong weights for its stage fails its stage probe and never enters an
  epoch while an honest joiner proves its stage and trains; then, of two replicas of a stage, the one with
  the lower id lies: its partner refuses to copy it and a new joiner refuses its state.

No timing assertion: each test waits (bounded) for progress, and a hang fails through the timeout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import threading
import time

import pytest

from node.net.rpc import call_http
from node.launch.process_swarm import ProcessSwarm, training_state
from tests.faults.daemon_helpers import RUN_UNTIL_STOPPED, train_args, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

#: The joiner's model: another width, depth and context than ``--model tiny`` on 2 stages.
OTHER_MODEL = {"layers": 4, "d_model": 32, "heads": 4, "kv_heads": 2, "ffn": 96, "context": 32, "stages": 2}
#: Fields the joiner's error line must name.
DIFFERING = ("model.d_model", "model.layers_per_stage", "model.context")
#: Number of made-up identities the outsider announces.
FAKES = 30
#: ``sitecustomize`` that makes one daemon hold wrong weights for its stage as its admission proof, and another
#: serve wrong stage state.
EVIL_HOOKS = pathlib.Path(__file__).resolve().parent / "evil_state"


def _other_model(tmp_path):
    path = tmp_path / "other-model.json"
    path.write_text(json.dumps(OTHER_MODEL))
    return path


class EpochWatch(threading.Thread):
    """Polls a node's ``schedule`` RPC and remembers every member any epoch named."""

    def __init__(self, node):
        super().__init__(daemon=True)
        self.node, self.members, self.epochs = node, set(), set()
        self.latest: tuple = (0, ())  # (number, members) of the newest epoch seen
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                s = call_http(self.node.rpc_url, "schedule", {}, timeout=5.0)
                if s.get("epoch") is not None:
                    self.epochs.add(int(s["epoch"]))
                    self.members.update(s.get("members") or ())
                    if int(s["epoch"]) > self.latest[0]:
                        self.latest = (int(s["epoch"]), tuple(s.get("members") or ()))
            except Exception:  # noqa: BLE001 - a busy daemon answers next time
                pass
            self.stop_event.wait(0.5)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=10)


def _assert_refused(node, peer_id: str, watch: EpochWatch) -> None:
    """The mismatched joiner exited with one error line naming the differing fields, no traceback, and
    no epoch named it."""
    assert not node.alive, "the mismatched joiner is still running"
    log = node.log_path.read_text(errors="replace")
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, log[-3000:]
    assert "training configuration differs" in errors[0] and all(f in errors[0] for f in DIFFERING), errors[0]
    assert "Traceback" not in log, log[-3000:]
    assert peer_id not in watch.members, "the mismatched joiner entered a schedule epoch"


def _wait_exit(swarm: ProcessSwarm, node, peer_id: str, watch: EpochWatch, timeout: float = 240) -> None:
    """Wait for the mismatched joiner to exit; fail at once if an epoch names it or a member fails."""
    deadline = time.monotonic() + timeout
    while node.alive:
        assert peer_id not in watch.members, "the mismatched joiner entered a schedule epoch"
        st = training_state(swarm.nodes[0], limit=1)
        assert st is None or st.get("state") != "error", f"the founder failed: {st.get('error')}"
        assert time.monotonic() < deadline, "the mismatched joiner did not exit"
        time.sleep(0.5)


def _joiner_id(path) -> str:
    from node.net.identity import load_or_create_identity

    return load_or_create_identity(path).peer_id.to_base58()


def test_a_mismatched_joiner_at_the_start_barrier_is_refused_and_the_run_goes_on(tmp_path):
    other = _other_model(tmp_path)
    iterations = 6
    swarm = ProcessSwarm(
        3, [1, 2], base_dir=tmp_path / "swarm", run_id="barrier-joiner", heartbeat_s=1.0,
        extra_args=lambda i: train_args(iterations, 2, "--node-name", f"node{i}", "--start-debounce", "5")
        + (["--model-config", str(other)] if i == 2 else []))
    joiner = swarm.nodes[2]
    joiner.workdir.mkdir(parents=True)
    joiner_id = _joiner_id(joiner.identity_path)
    watch = None
    try:
        swarm.spawn(swarm.nodes[0])
        swarm.wait_ready(swarm.nodes[:1], timeout=240)
        watch = EpochWatch(swarm.nodes[0])
        watch.start()
        swarm.spawn(swarm.nodes[1])
        swarm.spawn(joiner)  # together with the honest member: both are there for the first epoch
        swarm.wait_ready(swarm.nodes[1:2], timeout=240)
        _wait_exit(swarm, joiner, joiner_id, watch)
        done = wait_for(swarm, [0, 1], lambda s: s.get("state") == "done", 600, "the run to finish")
    finally:
        if watch is not None:
            watch.stop()
        swarm.stop()
    _assert_refused(joiner, joiner_id, watch)
    for i in (0, 1):
        assert [h["iteration"] for h in done[i]["history"]] == list(range(iterations)), done[i]["history"]


def test_a_mismatched_joiner_mid_run_is_refused_and_training_goes_on(tmp_path):
    other = _other_model(tmp_path)
    swarm = ProcessSwarm(
        2, [1, 1], base_dir=tmp_path / "swarm", run_id="midrun-joiner", heartbeat_s=1.0,
        extra_args=lambda i: train_args(RUN_UNTIL_STOPPED, 2, "--node-name", f"node{i}")
        + (["--model-config", str(other)] if i == 2 else []))
    watch = None
    try:
        swarm.start(timeout=240)
        watch = EpochWatch(swarm.nodes[0])
        watch.start()
        wait_for(swarm, [0, 1], lambda s: s.get("state") == "training" and (s.get("committed_iteration") or -1) >= 2,
                 400, "training to start")
        joiner = swarm.add_node(stage=1, wait=False)
        joiner_id = None
        deadline = time.monotonic() + 240
        while joiner_id is None and time.monotonic() < deadline:  # its identity file appears at start-up
            if joiner.identity_path.exists():
                joiner_id = _joiner_id(joiner.identity_path)
            time.sleep(0.2)
        assert joiner_id is not None, "the joiner never created its identity"
        _wait_exit(swarm, joiner, joiner_id, watch)
        after = training_state(swarm.nodes[0], limit=1)["committed_iteration"]
        wait_for(swarm, [0, 1], lambda s: s.get("state") == "training" and s["committed_iteration"] >= after + 5,
                 400, "training to go on after the joiner left")
    finally:
        if watch is not None:
            watch.stop()
        swarm.stop()
    _assert_refused(joiner, joiner_id, watch)


class Faker(threading.Thread):
    """An outsider: a plain DHT client that keeps re-announcing signed adverts of stage 1, one per
    identity (``FAKES`` made-up ones unless ``keys`` are given), at ``maddrs`` (by default an address
    where nothing answers)."""

    def __init__(self, swarm: ProcessSwarm, digest: str, keys=None, maddrs: tuple = ("/ip4/127.0.0.1/tcp/9",)):
        super().__init__(daemon=True)
        self.swarm, self.digest, self.keys, self.maddrs = swarm, digest, keys, tuple(maddrs)
        self.ids: list[str] = []
        self.stop_event = threading.Event()
        self.stored = 0
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
        from hivemind.dht.validation import RecordValidatorBase
        from hivemind.utils.crypto import RSAPrivateKey

        from node.net.identity import peer_id_from_rsa_public_key
        from node.swarm.adverts import stage_key
        from protocol.messages import StageAdvert, encode

        class ManyKeys(RecordValidatorBase):
            """Signs each record with the key its owner subkey names (hivemind merges RSA validators)."""

            def __init__(self, signers):
                self.signers = signers

            def validate(self, record) -> bool:
                return True

            def sign_value(self, record) -> bytes:
                for signer in self.signers:
                    if signer.local_public_key in record.subkey:
                        return signer.sign_value(record)
                return record.value

            def strip_value(self, record) -> bytes:
                return RSASignatureValidator._SIGNATURE_RE.sub(b"", record.value)

            @property
            def priority(self) -> int:
                return 10

            def merge_with(self, other) -> bool:
                return False

        signers = [RSASignatureValidator(k) for k in (self.keys or [RSAPrivateKey() for _ in range(FAKES)])]
        owners = [s.local_public_key for s in signers]
        self.ids = [peer_id_from_rsa_public_key(o[len(b"[owner:"):-1]) for o in owners]
        # the advert carries the run's configuration digest where this protocol has one
        extra = {"config_digest": self.digest} if "config_digest" in {f.name for f in dataclasses.fields(StageAdvert)} else {}
        dht = DHT(initial_peers=[self.swarm.bootstrap_maddr], start=True, client_mode=True,
                  record_validators=[ManyKeys(signers)])
        try:
            while not self.stop_event.is_set():
                for peer_id, owner in zip(self.ids, owners):
                    advert = StageAdvert(
                        run_id=self.swarm.run_id, peer_id=peer_id, gossip_peer_id="", maddrs=self.maddrs,
                        gossip_maddrs=(), stages=(1,), state="ONLINE", compute_s_per_sample_per_layer=1e-6,
                        memory_slots=8, free_slots=8, protocol_version=self.swarm_protocol(), rpc_port=None,
                        location=None, timestamp=time.time(), **extra)  # fmt: skip
                    try:
                        if dht.store(stage_key(self.swarm.run_id, 1), encode(advert), time.time() + 15, subkey=owner):
                            self.stored += 1
                    except Exception:  # noqa: BLE001 - keep announcing
                        pass
                self.stop_event.wait(2.0)
        finally:
            dht.shutdown()

    def swarm_protocol(self) -> int:
        return int(self.swarm.nodes[0].info.get("protocol_version") or 1)


def _training_pair(tmp_path, run_id: str) -> ProcessSwarm:
    """A data node and one stage-1 node training for long enough that the test ends them."""
    return ProcessSwarm(2, [1, 1], base_dir=tmp_path / "swarm", run_id=run_id, heartbeat_s=1.0,
                        extra_args=lambda i: train_args(RUN_UNTIL_STOPPED, 2, "--node-name", f"node{i}"))


def _start_training(swarm: ProcessSwarm):
    """Start ``swarm``, watch the founder's epochs, wait for training; ``(watch, the run's config digest)``."""
    swarm.start(timeout=240)
    watch = EpochWatch(swarm.nodes[0])
    watch.start()
    try:
        wait_for(swarm, [0, 1], lambda s: s.get("state") == "training" and (s.get("committed_iteration") or -1) >= 2,
                 400, "training to start")
        view = call_http(swarm.nodes[0].rpc_url, "swarm", {})
    except BaseException:
        watch.stop()  # the caller's cleanup never saw it
        raise
    return watch, next((p.get("config_digest") or "") for p in view["peers"] if p["peer_id"] == swarm.nodes[0].peer_id)


def test_thirty_fake_adverts_never_enter_an_epoch_and_training_goes_on(tmp_path):
    swarm = _training_pair(tmp_path, "fake-adverts")
    watch = faker = None
    try:
        watch, digest = _start_training(swarm)
        faker = Faker(swarm, digest)
        faker.start()
        deadline = time.monotonic() + 240
        while True:  # until the founder sees every fake ONLINE in its view
            assert faker.error is None, faker.error
            assert time.monotonic() < deadline, f"the fakes never showed up (stored {faker.stored})"
            view = call_http(swarm.nodes[0].rpc_url, "swarm", {})
            online = {p["peer_id"] for p in view["peers"] if p["state"] == "ONLINE"}
            if faker.ids and set(faker.ids) <= online:
                break
            time.sleep(1.0)
        seen = training_state(swarm.nodes[0], limit=1)["committed_iteration"]

        def goes_on(s: dict) -> bool:
            entered = set(faker.ids) & watch.members
            assert not entered, f"{len(entered)} fakes entered a schedule epoch"
            return s.get("state") == "training" and s["committed_iteration"] >= seen + 40

        # Long enough for the founder to have challenged every fake (and, before admission, to have
        # put them all into an epoch that starts a join lead later), and for training to pass that point.
        wait_for(swarm, [0, 1], goes_on, 600, "training to go on with the fakes announced")
        status = call_http(swarm.nodes[0].rpc_url, "status", {})
    finally:
        if faker is not None:
            faker.stop_event.set()
            faker.join(timeout=60)
        if watch is not None:
            watch.stop()
        swarm.stop()
    assert faker.error is None, faker.error
    fakes_in_epochs = set(faker.ids) & watch.members
    assert not fakes_in_epochs, f"{len(fakes_in_epochs)} fakes entered a schedule epoch"
    assert status["admission"]["failed"] >= FAKES, status["admission"]


class Squatter(threading.Thread):
    """A peer that earns its place and then goes silent: a real libp2p host with its own identity that
    answers admission challenges like a daemon, until ``silence`` is set; then its host shuts down while
    its adverts (a :class:`Faker` with its key) stay fresh. It trains nothing, but to pass the stage probe
    it holds stage 1's weights: at each probe it downloads them from ``replica`` (peer id, maddr)."""

    def __init__(self, key_path, digest: str, replica: tuple = ("", ""), run_id: str = ""):
        super().__init__(daemon=True)
        self.key_path, self.digest, self.replica, self.run_id = key_path, digest, replica, run_id
        self.maddrs: list[str] = []
        self.up, self.silence, self.done = threading.Event(), threading.Event(), threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        import asyncio

        try:
            asyncio.run(self._main())
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.up.set()
            self.done.set()

    async def _main(self) -> None:
        import asyncio

        import node.compat  # noqa: F401
        from hivemind.p2p import P2P

        from node.net.identity import load_or_create_identity
        from node.net.rpc import RpcServer

        from node.dataplane.probe import stage_sketch
        from node.dataplane.state_codec import ExpectedState
        from node.dataplane.state_transfer import fetch_state
        from node.train.model import build_stage, model_config

        me = load_or_create_identity(self.key_path).peer_id.to_base58()
        p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=str(self.key_path),
                               initial_peers=[self.replica[1]])
        rpc = RpcServer()
        cfg = model_config("tiny", n_stages=2)
        stage = build_stage(cfg, 1)

        async def admit(params: dict) -> dict:
            reply = {"nonce": params.get("nonce"), "peer_id": me, "config_digest": self.digest, "stages": [1]}
            if "probe" in params:  # hold the stage's current weights, as a joiner's proof does
                _, snap = await fetch_state(p2p, self.run_id, [self.replica[0]], 1, -1, timeout_s=4.0,
                                            max_state_bytes=ExpectedState.of_module(stage).max_bytes(),
                                            expected=ExpectedState.of_module(stage))
                stage.load_state_dict(snap.state["model"])
                reply["probe"] = stage_sketch(stage, bytes.fromhex(params["nonce"]), cfg.d_model)
            return reply

        rpc.register("admit", admit)
        await rpc.attach_p2p(p2p)
        self.maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
        self.up.set()
        while not self.silence.is_set():
            await asyncio.sleep(0.2)
        await asyncio.wait_for(p2p.shutdown(), 30)


def test_a_member_that_goes_silent_is_dropped_and_training_goes_on(tmp_path):
    from node.net.identity import load_or_create_identity

    swarm = _training_pair(tmp_path, "silent-member")
    key_path = tmp_path / "squatter.key"
    squatter_id = load_or_create_identity(key_path).peer_id.to_base58()
    watch = squatter = announcer = None
    try:
        watch, digest = _start_training(swarm)
        squatter = Squatter(key_path, digest, (swarm.nodes[1].peer_id, swarm.nodes[1].maddr), swarm.run_id)
        squatter.start()
        assert squatter.up.wait(120) and squatter.error is None, squatter.error
        announcer = Faker(swarm, digest, keys=[load_or_create_identity(key_path).private_key],
                          maddrs=tuple(squatter.maddrs))
        announcer.start()
        wait_for(swarm, [0], lambda s: squatter_id in watch.members, 300, "the squatter to enter an epoch")
        squatter.silence.set()  # from now on nothing answers at its address; its adverts stay fresh
        seen = training_state(swarm.nodes[0], limit=1)["committed_iteration"]
        wait_for(swarm, [0, 1], lambda s: s.get("state") == "training" and squatter_id not in watch.latest[1]
                 and s["committed_iteration"] >= seen + 20, 400, "training to go on without the silent member")
        status = call_http(swarm.nodes[0].rpc_url, "status", {})
    finally:
        if announcer is not None:
            announcer.stop_event.set()
            announcer.join(timeout=60)
        if squatter is not None:
            squatter.silence.set()
            squatter.join(timeout=60)
        if watch is not None:
            watch.stop()
        swarm.stop()
    assert announcer.error is None, announcer.error
    assert squatter_id[-8:] in status["admission"]["silent"], status["admission"]


def test_membership_needs_the_stage_and_a_lying_replica_of_two_moves_no_one(tmp_path):
    """Membership is earned by holding the stage: a candidate daemon whose proof holds re-initialised weights
    for stage 1 (``tests/faults/evil_state``, ``SKIPPIPE_TEST_WRONG_STAGE_IDENTITY``) fails every stage probe
    and never enters an epoch, while an honest joiner that arrives after it proves its stage and trains.

    The same swarm then has two stage-1 replicas, and the one with the lower peer id starts to lie (``drift``:
    its checksum report differs, it serves and vouches for weights 100 learning-rate steps away). Its honest
    partner sees a tie and tries to copy it, but refuses (beyond the 10-step bound of
    ``node.train.resync.TIE_MAX_LR_STEPS``), and a new joiner refuses its download (the honest replica
    disputes it) instead of taking it, so it never enters an epoch."""
    from node.net.identity import load_or_create_identity

    base = tmp_path / "swarm"
    # the founder's stage-1 replica (node 1, the liar later) gets the lower peer id of it and the honest joiner (node 3)
    ids = sorted(((load_or_create_identity(tmp_path / f"id{i}.key"), tmp_path / f"id{i}.key") for i in range(2)),
                 key=lambda pair: pair[0].peer_id.to_base58())
    for node_index, (_, path) in zip((1, 3), ids):
        (base / f"node{node_index}").mkdir(parents=True)
        (base / f"node{node_index}" / "identity.key").write_bytes(path.read_bytes())
    liar = ids[0][0].peer_id.to_base58()
    mode = tmp_path / "mode"
    mode.write_text("honest")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(EVIL_HOOKS), os.environ.get("PYTHONPATH", "")]),
               SKIPPIPE_TEST_WRONG_STAGE_IDENTITY=str(base / "node2" / "identity.key"),
               SKIPPIPE_TEST_EVIL_IDENTITY=str(base / "node1" / "identity.key"), SKIPPIPE_TEST_EVIL_MODE=str(mode),
               SKIPPIPE_TEST_EVIL_MARKER=str(tmp_path / "unused"))
    swarm = ProcessSwarm(2, [1, 1], base_dir=base, run_id="wrong-stage", heartbeat_s=1.0, env=env,
                         extra_args=lambda i: train_args(RUN_UNTIL_STOPPED, 2, "--node-name", f"node{i}"))
    watch = None
    try:
        watch, _ = _start_training(swarm)
        wrong = swarm.add_node(stage=1, timeout=240)
        honest = swarm.add_node(stage=1, timeout=240)
        assert (wrong.index, honest.index, swarm.nodes[1].peer_id) == (2, 3, liar)
        wait_for(swarm, [honest.index], lambda s: s.get("state") == "training" and (s.get("committed_iteration") or -1)
                 >= (s.get("start_iteration") or 0), 400, "the honest joiner to train")
        status = call_http(swarm.nodes[0].rpc_url, "status", {})["admission"]
        wrong_log = wrong.log_path.read_text(errors="replace")
        assert wrong.peer_id not in watch.members, "the candidate with wrong weights entered a schedule epoch"
        # part two: the lower-id replica of two lies
        mode.write_text("drift")
        wait_for(swarm, [honest.index], lambda s: any(
            line in honest.log_path.read_text(errors="replace")
            for line in (f"not copying replica {liar[-8:]}: its weights are", "under a tie")),
            300, "the honest replica to try the liar's state")
        joiner = swarm.add_node(stage=1, timeout=240)
        wait_for(swarm, [joiner.index], lambda s: any(
            line in joiner.log_path.read_text(errors="replace")
            for line in (f"from {liar[-8:]} refused: 1 replica(s) hold other weights", "as admission proof")),
            300, "the joiner to try the liar's state")
        after = training_state(swarm.nodes[0], limit=1)["committed_iteration"]
        wait_for(swarm, [0, honest.index], lambda s: s.get("state") == "training" and s["committed_iteration"]
                 >= after + 3, 300, "training to go on")
        honest_log, joiner_log = honest.log_path.read_text(errors="replace"), joiner.log_path.read_text(errors="replace")
    finally:
        if watch is not None:
            watch.stop()
        swarm.stop()
    assert honest.peer_id in watch.members
    assert wrong.peer_id not in watch.members, "the candidate with wrong weights entered a schedule epoch"
    assert "as admission proof" in wrong_log, wrong_log[-3000:]  # it did take the state: its proof is what is wrong
    assert status["probe_refused"] >= 1 and wrong.peer_id[-8:] not in status["trusted_alone"], status
    # the honest replica never took the liar's weights (no copy under the tie); the joiner took nothing either
    assert "under a tie" not in honest_log and "re-syncing" in honest_log, honest_log[-3000:]
    assert "joined stage 1" not in joiner_log and "as admission proof" not in joiner_log, joiner_log[-3000:]
    assert joiner.peer_id not in watch.members, "a joiner that could verify no state entered a schedule epoch"
