"""Stage state (weights + optimizer) from a live replica: for joiners and for diverged replicas.

Why a stream of our own and not hivemind's ``load_state_from_peers``: that API lives inside a
DecentralizedAverager, and ours are per (stage, epoch) and exist only while a stage has several
replicas; a node joining a single-replica stage, or one re-syncing after a failed all-reduce,
must still be able to fetch. So every trainer serves its stage's state on one binary stream
handler, ``skippipe/<run>/state/1``.

Request: one msgpack frame ``{"stage": s, "min_iteration": i}``. The server waits (bounded) until
it has committed iteration ``i`` and answers with a msgpack header ``{"ok", "stage", "iteration",
"checksum", "digest", "error"}`` followed by one frame holding the state blob of
:mod:`node.dataplane.state_codec` (safetensors + a typed manifest; no pickle): the state right after
committing ``iteration``; ``digest`` is the SHA-256 of its weights, which the receiver recomputes.
The snapshot is taken on the trainer's compute thread, so it never interleaves with an optimizer step.

**Verified state** (:func:`fetch_verified_state`). A blob that decodes is not yet a blob to trust:
a hostile replica can serve all-zero or perturbed weights of the right shapes. So the receiver
asks the stage's *other* replicas what they hold: a request ``{"stage", "min_iteration": k,
"sketch_nonce": n}`` is answered by a header carrying the server's
:func:`~node.dataplane.state_codec.weights_sketch` of its weights at iteration ``k`` for the random
``n`` the receiver chose *after* it received the blob (so its sender could not shape its weights
for those directions). The blob is taken when its sender and the replicas whose sketch matches it
outnumber those whose sketch does not; otherwise the next replica's blob is tried. With two or
more other replicas one liar cannot pass; with none answering, the receiver logs whom it trusted
alone. Sketches tolerate the float rounding by which honest replicas differ (a SHA-256 of the
weights would not: replicas are close, not bit-identical). A replica answering a sketch request
first stores the same claim as a signed, owner-keyed
:class:`~node.net.records.StateClaimRecord` in the DHT (key per stage and nonce); the verifier
counts the signed record where it finds one and the direct answer (whose peer id the libp2p
transport authenticated) for the rest.

Limits (a hostile peer reaches this handler like any other): the request frame is read through
:func:`node.net.framing.read_frame` (its length is checked before any of the body is read, and
it must arrive within :data:`REQUEST_TIMEOUT_S`); with ``allow`` (``Daemon.is_peer_allowed``)
only peers of the swarm are served (in a keyed swarm: an advert with the key's proof); at most
:data:`MAX_CONCURRENT_SERVES` snapshots are sent at once (each is a full copy of the stage's state).
A requester that is no member of the current epoch is served one at a time (:data:`MAX_CANDIDATE_SERVES`,
so non-members never hold the slot the members' joins and re-syncs need). An admission candidate taking its
stage's state as proof (:mod:`node.train.proof`) is served at most once per :data:`CANDIDATE_FETCH_EVERY_S`
once it answered an admission challenge with this run's configuration (``vouch``, cached by admission);
any other (``skippipe export --peer`` in an open swarm) once per :data:`OUTSIDER_FETCH_EVERY_S`. This is no
weaker than before: in an open swarm anyone could download the state (and anyone who answers the challenge
becomes a member anyway), now non-members share one slot; in a keyed swarm ``allow`` still gates every
request. The client bounds the answer by its own stage's size
(:meth:`~node.dataplane.state_codec.ExpectedState.max_bytes`), never by a constant, and decodes
it only against the tensor names, shapes and dtypes of its own stage.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Dict, List, Optional, Sequence, Tuple

import msgpack

from node.compat import import_hivemind
from node.dataplane.state_codec import (MAX_SKETCH_VALUES, ExpectedState, StateCodecError, decode_state,
                                       sketches_agree, weights_digest, weights_sketch)
from node.net.framing import FrameTooLarge, read_frame, write_frame
from node.net.identity import looks_like_peer_id
from node.net.records import read_state_claims

__all__ = ["StateSnapshot", "StateServer", "fetch_state", "fetch_verified_state", "fetch_sketches",
           "StateTransferError", "StateDisputed", "state_handler_name", "state_relay_handler_name",
           "relayed_state_handler_name", "Via",
           "encode_relayed_origin", "decode_relayed_origin", "ask_vouch"]

logger = logging.getLogger(__name__)

#: Largest request frame we read (a request is a few dozen bytes).
MAX_REQUEST_BYTES = 4096
#: Largest origin frame of a relayed request (:func:`encode_relayed_origin`: a base58 libp2p peer id of 46-53
#: characters and a flag, about 80 bytes packed).
MAX_ORIGIN_BYTES = 256
#: Seconds a caller has to send its whole request.
REQUEST_TIMEOUT_S = 30.0
#: Largest answer header a client reads.
MAX_HEADER_BYTES = 64 * 1024
#: A weights digest is SHA-256 in hex.
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
#: Bytes of the random nonce a verifier sends with a sketch request.
NONCE_BYTES = 16
#: Seconds the other replicas have to answer a sketch request (they only wait for their commit and hash).
SKETCH_TIMEOUT_S = 60.0
#: Times one source is asked again, at the iteration the other replicas have reached, when none of them
#: could vouch for its state because training moved on while it was downloaded (a fast run commits several
#: iterations per second): without a retry, the state would be taken on its source's word alone.
MAX_CATCH_UP_ROUNDS = 5
#: Snapshots served at the same time; further requests wait for a slot (within the wait timeout).
MAX_CONCURRENT_SERVES = 2
#: One "refused" log line per this many refused requests.
REFUSED_LOG_EVERY = 100
#: Snapshots served at once to requesters that are no epoch member (admission candidates taking their stage's
#: state as proof, :mod:`node.train.proof`): one, so candidates, however many identities they come with,
#: never take the upload slot the members' joins and re-syncs need.
MAX_CANDIDATE_SERVES = 1
#: Seconds between two snapshots served to the same candidate: below its fastest proof refresh
#: (``node.train.proof.PROOF_REFRESH_S``, 3 s), so an honest candidate is never refused for asking too often.
CANDIDATE_FETCH_EVERY_S = 2.0
#: Seconds between two snapshots served to the same non-member that admission does not vouch for (an
#: operator's ``skippipe export --peer``, a tool): it shares the candidates' one slot, and one copy per
#: half minute is plenty for an export (each run of it is a fresh identity anyway).
OUTSIDER_FETCH_EVERY_S = 30.0
#: Most candidates whose last download time is remembered (the oldest are forgotten first).
MAX_CANDIDATES_TRACKED = 1024


#: ``via(peer)``: the relay through which to reach ``peer``'s state handler, or None to dial it directly.
Via = Callable[[str], Optional[str]]


def state_relay_handler_name(run_id: str) -> str:
    """A relay's handler that pipes a state request to a member nobody can dial (:mod:`node.dataplane.relay`)."""
    return f"skippipe/{run_id}/relay-state/1"


def relayed_state_handler_name(run_id: str) -> str:
    """A state server's handler for requests a relay pipes to it: the relay's first frame
    (:func:`encode_relayed_origin`) names the peer it pipes for, whom the server then treats as the requester."""
    return f"skippipe/{run_id}/state-relayed/2"


def encode_relayed_origin(peer_id: str, vouched: bool) -> bytes:
    """The relay's first frame to a target: the requester, and whether the relay's own admission vouches for it.

    Why the relay vouches: a candidate is served at its candidates' rate once admission vouches for it, and
    vouching means challenging it, which needs a connection to it. A target that nobody can dial, serving a
    requester that nobody can dial either, can never open one; the relay can (the requester dialled it). The
    target already takes a member relay's word for who the requester is, so it takes its vouch too."""
    return msgpack.packb({"origin": peer_id, "vouched": bool(vouched)})


async def ask_vouch(vouch: Callable[[str], Awaitable[bool]], peer: str, timeout_s: Optional[float] = None) -> bool:
    """``await vouch(peer)`` within ``timeout_s``; a vouch that fails or times out is a no (the requester is then
    served at a stranger's rate, never refused for it)."""
    try:
        return bool(await asyncio.wait_for(vouch(peer), timeout_s))
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - no vouch
        logger.debug("no vouch for %s: %r", peer[-8:], e)
        return False


def decode_relayed_origin(data: bytes) -> Tuple[str, bool]:
    """``(peer id, vouched)`` of an origin frame; ValueError when it is not one."""
    msg = msgpack.unpackb(data, raw=False)
    if not isinstance(msg, dict) or not isinstance(msg.get("origin"), str) or not isinstance(msg.get("vouched"), bool):
        raise ValueError("not an origin frame")
    if not looks_like_peer_id(msg["origin"]):
        raise ValueError("origin is not a peer id")
    return msg["origin"], msg["vouched"]


def state_handler_name(run_id: str) -> str:
    return f"skippipe/{run_id}/state/1"


class StateTransferError(RuntimeError):
    """No live replica could hand over its state."""


class StateDisputed(StateTransferError):
    """Replicas handed over state, but every one was disputed by as many others as backed it: the stage's
    replicas disagree (two replicas, one of them lying or diverged), and asking again soon will not help."""


@dataclass
class StateSnapshot:
    stage: int
    iteration: int  # last committed iteration the state belongs to (-1 = initial weights)
    checksum: float
    payload: bytes  # state_codec blob of {"model": ..., "optimizer": ...}
    digest: str = ""  # the sender's weights_digest of the model weights (a claim, checked by the receiver)
    state: Optional[dict] = field(default=None, repr=False)  # decoded by fetch_state(expected=...)

    def state_dict(self, expected: Optional[ExpectedState]) -> dict:
        """The state, decoded without running code; its model tensors must match ``expected`` (the
        receiver's own stage) and its weights the claimed digest. :class:`StateCodecError` otherwise."""
        manifest, state = decode_state(self.payload, expected)
        if manifest.get("stage") != self.stage or manifest.get("iteration") != self.iteration:
            raise StateCodecError(f"blob holds stage {manifest.get('stage')!r} iteration "
                                  f"{manifest.get('iteration')!r}, the header said {self.stage}/{self.iteration}")
        if self.digest and weights_digest(state["model"]) != self.digest:
            raise StateCodecError("weights do not match the digest their sender claimed")
        return state


#: ``snapshot(stage, min_iteration) -> StateSnapshot``; raises ValueError for a stage not held here. A request
#: through a relay adds ``claim_nonce``: the server then stores a signed claim of the sent weights' sketch under it
SnapshotFn = Callable[..., Awaitable[StateSnapshot]]
#: ``sketch(stage, min_iteration, nonce) -> (iteration, weights_sketch)``; ValueError for a stage not held here
SketchFn = Callable[[int, int, bytes], Awaitable[Tuple[int, List[float]]]]


class StateServer:
    """Serves ``snapshot`` on the state stream handler of one node's hivemind ``P2P``."""

    def __init__(self, p2p, run_id: str, snapshot: SnapshotFn, wait_timeout_s: float = 120.0,
                 allow: Optional[Callable[[str], bool]] = None, sketch: Optional[SketchFn] = None,
                 member: Optional[Callable[[str], bool]] = None,
                 vouch: Optional[Callable[[str], Awaitable[bool]]] = None):
        """``member(peer)``: is ``peer`` a member of the current epoch (None: everyone counts as one)? Others are
        admission candidates: served only once ``await vouch(peer)`` (a challenge with this run's configuration,
        cached by admission) says so, one at a time, and at most once per :data:`CANDIDATE_FETCH_EVERY_S` each."""
        self.p2p, self.name, self._snapshot, self._sketch = p2p, state_handler_name(run_id), snapshot, sketch
        self.relayed_name = relayed_state_handler_name(run_id)
        self.wait_timeout_s, self._allow, self._member, self._vouch = wait_timeout_s, allow, member, vouch
        self._candidate_slots = asyncio.Semaphore(MAX_CANDIDATE_SERVES)
        self._candidate_served: Dict[str, float] = {}  # candidate -> when its last snapshot was started
        self.served = 0
        self.refused = 0  # requests refused: not allowed, oversized, late or malformed
        self._slots = asyncio.Semaphore(MAX_CONCURRENT_SERVES)
        self._started = False

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.name, self._handle)
        await self.p2p.add_binary_stream_handler(self.relayed_name, self._handle_relayed)
        self._started = True

    async def _handle(self, stream_info, reader, writer) -> None:
        await self._serve(str(stream_info.peer_id), reader, writer)

    async def _handle_relayed(self, stream_info, reader, writer) -> None:
        """A request a relay pipes (:mod:`node.dataplane.relay`): the relay must be a member; the peer it names
        is the requester for every rule below (a candidate stays a candidate when it comes through a relay)."""
        relay = str(stream_info.peer_id)
        try:
            if (self._allow is not None and not self._allow(relay)) or (self._member is not None and not self._member(relay)):
                self._refuse(relay, "a relay that is no member")
                writer.close()
                return
            origin, vouched = decode_relayed_origin(await read_frame(reader, MAX_ORIGIN_BYTES, REQUEST_TIMEOUT_S))
        except Exception as e:  # noqa: BLE001 - a frame too large, late, cut or not an origin: refused alike
            self._refuse(relay, f"relayed request without its origin: {e!r}")
            writer.close()
            return
        await self._serve(origin, reader, writer, relay_vouched=vouched)

    async def _serve(self, sender: str, reader, writer, relay_vouched: bool = False) -> None:
        """Answer one request of ``sender``; ``relay_vouched``: the member relay that piped it vouches for the
        sender (:func:`encode_relayed_origin`), so it counts as vouched without a challenge from here."""
        try:
            if self._allow is not None and not self._allow(sender):
                self._refuse(sender, "peer not allowed")
                return
            raw = await read_frame(reader, MAX_REQUEST_BYTES, REQUEST_TIMEOUT_S)
            req = msgpack.unpackb(raw, raw=False)
            if not isinstance(req, dict):
                raise ValueError("request is not a map")
            stage, min_it = int(req["stage"]), int(req["min_iteration"])
            nonce = req.get("sketch_nonce")
            candidate = self._member is not None and not self._member(sender)
            claim_nonce = req.get("claim_nonce")
            args = (stage, min_it) if claim_nonce is None else (stage, min_it, claim_nonce)
            try:
                if claim_nonce is not None and (not isinstance(claim_nonce, bytes) or len(claim_nonce) != NONCE_BYTES):
                    raise ValueError("bad claim nonce")
                if candidate and nonce is None:
                    vouched = relay_vouched or await self._vouched(sender)
                    await self._serve_candidate(sender, writer, args,
                                                CANDIDATE_FETCH_EVERY_S if vouched else OUTSIDER_FETCH_EVERY_S)
                    return
                if nonce is not None:
                    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES or self._sketch is None:
                        raise ValueError("bad sketch request")
                    async with self._slots:
                        it, sketch = await asyncio.wait_for(self._sketch(stage, min_it, nonce), self.wait_timeout_s)
                    await write_frame(writer, msgpack.packb({"ok": True, "stage": stage, "iteration": it,
                                                             "checksum": 0.0, "sketch": sketch}))
                    return
                async with self._slots:
                    snap = await asyncio.wait_for(self._snapshot(*args), self.wait_timeout_s)
                    header = {"ok": True, "stage": snap.stage, "iteration": snap.iteration, "checksum": snap.checksum,
                              "digest": snap.digest}
                    await write_frame(writer, msgpack.packb(header))
                    await write_frame(writer, snap.payload)
            except (ValueError, asyncio.TimeoutError) as e:
                await write_frame(writer, msgpack.packb({"ok": False, "error": str(e) or type(e).__name__}))
                return
            self.served += 1
            logger.info("served stage %d state at iteration %d to %s (%d bytes)", snap.stage, snap.iteration,
                        sender[-8:], len(snap.payload))
        except asyncio.CancelledError:
            raise
        except (FrameTooLarge, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
            self._refuse(sender, repr(e))
        except Exception as e:  # noqa: BLE001 - a bad request must not take the server down
            self._refuse(sender, f"malformed request: {e!r}")
        finally:
            writer.close()

    async def _vouched(self, sender: str) -> bool:
        """Whether admission vouches for ``sender`` (no admission: everyone)."""
        return self._vouch is None or await ask_vouch(self._vouch, sender)

    async def _serve_candidate(self, sender: str, writer, args: tuple, every_s: float) -> None:
        """A snapshot for a non-member (``args`` for the snapshot callback), within the non-members' own slot and
        at most once per ``every_s`` each."""
        now = time.monotonic()
        if now - self._candidate_served.get(sender, -every_s) < every_s:
            raise ValueError(f"a non-member gets one state download per {every_s:.0f} s")
        if self._candidate_slots.locked():
            raise ValueError("busy serving another candidate")
        self._candidate_served.pop(sender, None)
        self._candidate_served[sender] = now
        while len(self._candidate_served) > MAX_CANDIDATES_TRACKED:
            self._candidate_served.pop(next(iter(self._candidate_served)))
        async with self._candidate_slots, self._slots:
            snap = await asyncio.wait_for(self._snapshot(*args), self.wait_timeout_s)
            await write_frame(writer, msgpack.packb({"ok": True, "stage": snap.stage, "iteration": snap.iteration,
                                                     "checksum": snap.checksum, "digest": snap.digest}))
            await write_frame(writer, snap.payload)
        self.served += 1
        logger.info("served stage %d state at iteration %d to candidate %s (%d bytes)", snap.stage, snap.iteration,
                    sender[-8:], len(snap.payload))

    def _refuse(self, sender: str, why: str) -> None:
        self.refused += 1
        if self.refused % REFUSED_LOG_EVERY == 1:
            logger.warning("state request from %s refused: %s (%d refused so far)", sender[-8:], why[:200], self.refused)

    async def close(self) -> None:
        if self._started:
            for name in (self.name, self.relayed_name):
                try:
                    await self.p2p.remove_binary_stream_handler(name)
                except Exception:  # noqa: BLE001
                    pass
            self._started = False


def _parse_header(raw: bytes, stage: int, min_iteration: int) -> dict:
    header = msgpack.unpackb(raw, raw=False)
    if not isinstance(header, dict):
        raise ValueError("answer header is not a map")
    if not header.get("ok"):
        return header
    it, digest = header.get("iteration"), header.get("digest", "")
    if header.get("stage") != stage or isinstance(it, bool) or not isinstance(it, int) or it < min_iteration:
        raise ValueError(f"answer is for stage {header.get('stage')!r:.20} iteration {it!r:.20}, asked stage {stage} "
                         f"from iteration {min_iteration}")
    if not isinstance(digest, str) or (digest and not _DIGEST_RE.fullmatch(digest)):
        raise ValueError("answer's digest is not a SHA-256 hex string")
    checksum = header.get("checksum")
    if isinstance(checksum, bool) or not isinstance(checksum, (int, float)):
        raise ValueError("answer's checksum is not a number")
    return header


async def _open(p2p, run_id: str, peer: str, via: Optional[Via]):
    """A stream to ``peer``'s state handler: direct, or through the relay ``via(peer)`` names, which pipes the
    bytes untouched (the first frame tells it the target); either way the same request and answer follow."""
    hivemind = import_hivemind()
    relay = via(peer) if via is not None else None
    target, handler = (peer, state_handler_name(run_id)) if relay is None else (relay, state_relay_handler_name(run_id))
    _, reader, writer = await asyncio.wait_for(
        p2p.call_binary_stream_handler(hivemind.p2p.PeerID.from_base58(target), handler), 30.0)
    if relay is not None:
        await write_frame(writer, peer.encode("ascii"))
    return reader, writer


async def _ask(p2p, run_id: str, peer: str, request: dict, timeout_s: float, max_state_bytes: int,
               via: Optional[Via] = None) -> dict:
    """One request to ``peer``'s state handler: the checked header, plus ``payload`` unless it asked a sketch."""
    stage, min_iteration = request["stage"], request["min_iteration"]
    reader, writer = await _open(p2p, run_id, peer, via)
    try:
        await write_frame(writer, msgpack.packb(request))
        header = _parse_header(await read_frame(reader, MAX_HEADER_BYTES + 16 * MAX_SKETCH_VALUES, timeout_s), stage,
                               min_iteration)
        if not header.get("ok"):
            raise StateTransferError(str(header.get("error"))[:200])
        if "sketch_nonce" not in request:
            header["payload"] = await read_frame(reader, max_state_bytes, timeout_s)
        return header
    finally:
        writer.close()


async def fetch_state(p2p, run_id: str, peers: Sequence[str], stage: int, min_iteration: int, *,
                      max_state_bytes: int, timeout_s: float = 180.0,
                      expected: Optional[ExpectedState] = None, via: Optional[Via] = None) -> Tuple[str, StateSnapshot]:
    """Ask ``peers`` in order for ``stage``'s state at committed iteration >= ``min_iteration``.

    ``max_state_bytes`` bounds the answer (the receiver's :meth:`ExpectedState.max_bytes`). With
    ``expected`` the blob is decoded here (never running code) and a peer whose blob does not fit
    the receiver's stage, or whose weights do not match its own digest, is skipped like one that
    did not answer; the decoded state is then on ``snap.state``."""
    errors: List[str] = []
    for peer in peers:
        snap = await _fetch_one(p2p, run_id, peer, stage, min_iteration, max_state_bytes, timeout_s, expected, errors,
                                via)
        if snap is not None:
            return peer, snap
    raise StateTransferError(f"no replica of stage {stage} handed over its state: " + ("; ".join(errors) or "none alive"))


async def _fetch_one(p2p, run_id: str, peer: str, stage: int, min_iteration: int, max_state_bytes: int,
                     timeout_s: float, expected: Optional[ExpectedState], errors: List[str],
                     via: Optional[Via] = None, claim_nonce: Optional[bytes] = None) -> Optional[StateSnapshot]:
    request = {"stage": stage, "min_iteration": min_iteration}
    if claim_nonce is not None:
        request["claim_nonce"] = claim_nonce
    try:
        h = await _ask(p2p, run_id, peer, request, timeout_s, max_state_bytes, via)
        snap = StateSnapshot(stage, h["iteration"], float(h["checksum"]), h["payload"], h.get("digest", ""))
        if expected is not None:
            # decoding copies and hashes the whole state: off the event loop
            snap.state = await asyncio.get_running_loop().run_in_executor(None, snap.state_dict, expected)
        return snap
    except StateCodecError as e:
        logger.warning("stage %d state from %s refused: %s", stage, peer[-8:], e)
        errors.append(f"{peer[-8:]}: refused its state ({e})")
    except Exception as e:  # noqa: BLE001 - try the next replica
        errors.append(f"{peer[-8:]}: {e!r}"[:300])
    return None


async def fetch_sketches(p2p, run_id: str, peers: Sequence[str], stage: int, iteration: int, nonce: bytes,
                         timeout_s: float = SKETCH_TIMEOUT_S, via: Optional[Via] = None
                         ) -> Dict[str, Tuple[int, List[float]]]:
    """Ask every one of ``peers`` at once for its weights sketch at ``iteration`` (or later) under
    ``nonce``: peer -> (iteration, sketch) of those that answered well-formed."""

    async def one(peer: str) -> Optional[Tuple[int, List[float]]]:
        try:
            h = await _ask(p2p, run_id, peer, {"stage": stage, "min_iteration": iteration, "sketch_nonce": nonce},
                           timeout_s, 0, via)
        except Exception as e:  # noqa: BLE001 - a silent or broken replica makes no claim
            logger.info("no weights sketch of stage %d from %s: %r", stage, peer[-8:], e)
            return None
        sketch = h.get("sketch")
        if (not isinstance(sketch, list) or len(sketch) > MAX_SKETCH_VALUES
                or not all(isinstance(x, float) for x in sketch)):
            logger.info("malformed weights sketch of stage %d from %s", stage, peer[-8:])
            return None
        return h["iteration"], sketch

    answers = await asyncio.gather(*(one(p) for p in peers))
    return {p: a for p, a in zip(peers, answers) if a is not None}


async def _signed_claims(dht, run_id: str, stage: int, nonce: bytes,
                         others: Sequence[str]) -> Dict[str, Tuple[int, List[float]]]:
    """The signed claims the other replicas stored for ``nonce`` (empty on a DHT miss or error)."""
    try:
        records = await asyncio.wait_for(read_state_claims(dht, run_id, stage, nonce, members=set(others)),
                                         SKETCH_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - the direct answers still count
        logger.info("reading the signed state claims of stage %d failed: %r", stage, e)
        return {}
    return {p: (r.iteration, list(r.sketch)) for p, r in (records or {}).items() if r.stage == stage}


async def _source_confirms(dht, run_id: str, source: str, snap: StateSnapshot, claim_nonce: bytes) -> bool:
    """Whether ``source``'s signed claim under ``claim_nonce`` (stored before it sent the state, see
    :data:`SnapshotFn`) matches the sketch of the weights that came through the relay; says why not."""
    own = None
    if dht is not None:
        own = (await _signed_claims(dht, run_id, snap.stage, claim_nonce, [source])).get(source)
    loop = asyncio.get_running_loop()
    if own is not None and own[0] == snap.iteration:
        mine = await loop.run_in_executor(None, weights_sketch, snap.state["model"], claim_nonce)
        if sketches_agree(mine, own[1]):
            return True
    logger.warning("stage %d state of iteration %d from %s refused: it came through a relay and its source's signed "
                   "sketch %s", snap.stage, snap.iteration, source[-8:], "is missing" if own is None else "does not match it")
    return False


@dataclass
class Verdict:
    """Why a downloaded state was taken: who served it, who vouched for it, who disagreed."""

    source: str
    iteration: int
    agree: List[str]
    disagree: List[str]
    silent: List[str]

    @property
    def alone(self) -> bool:
        return not self.agree and not self.disagree

    def to_dict(self) -> dict:
        return {"source": self.source, "iteration": self.iteration, "backed_by": list(self.agree),
                "disputed_by": list(self.disagree), "silent": list(self.silent)}


async def fetch_verified_state(p2p, run_id: str, peers: Sequence[str], stage: int, min_iteration: int, *,
                               expected: ExpectedState, timeout_s: float = 180.0,
                               sketch_timeout_s: float = SKETCH_TIMEOUT_S, dht=None,
                               via: Optional[Via] = None) -> Tuple[StateSnapshot, Verdict]:
    """``stage``'s state from one of ``peers`` (tried in order), taken only when the other peers'
    sketches of their weights at the same iteration back it (see the module docstring). A refused
    source's state is dropped and the next peer tried, the peers that disagreed with it first. With
    ``dht`` the peers' signed claims there take precedence over their direct answers.

    ``via``: peers nobody can dial are asked through a relay (:func:`_open`). A relay could alter what it
    pipes, so a state that came through one is taken only when its source's own signed claim in the DHT
    (which the relay cannot forge) matches it, and without ``dht`` not at all."""
    import os

    errors: List[str] = []
    order = list(dict.fromkeys(peers))
    tried: set = set()
    catch_up = MAX_CATCH_UP_ROUNDS
    disputed = False  # some source's state was refused because other replicas hold other weights
    while True:
        source = next((p for p in order if p not in tried), None)
        if source is None:
            error = StateDisputed if disputed else StateTransferError
            raise error(f"no replica of stage {stage} handed over state the others back: "
                        + ("; ".join(errors) or "none alive"))
        tried.add(source)
        relayed = via is not None and via(source) is not None
        claim_nonce = os.urandom(NONCE_BYTES) if relayed else None
        snap = await _fetch_one(p2p, run_id, source, stage, min_iteration, expected.max_bytes(), timeout_s, expected,
                                errors, via, claim_nonce)
        if snap is None:
            continue
        assert snap.state is not None
        if relayed and not await _source_confirms(dht, run_id, source, snap, claim_nonce):
            errors.append(f"{source[-8:]}: its relayed state was not confirmed by its signed sketch")
            continue
        nonce = os.urandom(NONCE_BYTES)
        others = [p for p in order if p != source]
        loop = asyncio.get_running_loop()
        mine, claims = await asyncio.gather(
            loop.run_in_executor(None, weights_sketch, snap.state["model"], nonce),
            fetch_sketches(p2p, run_id, others, stage, snap.iteration, nonce, sketch_timeout_s, via))
        if dht is not None:
            claims.update(await _signed_claims(dht, run_id, stage, nonce, others))
        agree = [p for p, (it, sk) in claims.items() if it == snap.iteration and sketches_agree(mine, sk)]
        disagree = [p for p, (it, sk) in claims.items() if it == snap.iteration and p not in agree]
        verdict = Verdict(source, snap.iteration, agree, disagree, [p for p in others if p not in agree and p not in disagree])
        ahead = [it for it, _ in claims.values() if it > snap.iteration]
        if not agree and not disagree and ahead and catch_up > 0:  # they moved on: ask again where they are
            catch_up -= 1
            tried.discard(source)
            min_iteration = min(ahead)  # the nearest: a liar claiming a far iteration cannot stall the fetch
            continue
        if 1 + len(agree) > len(disagree):
            if verdict.alone:
                logger.warning("stage %d state of iteration %d taken from %s on its word alone: no other replica "
                               "answered for that iteration", stage, snap.iteration, source)
            return snap, verdict
        logger.warning("stage %d state of iteration %d from %s refused: %d replica(s) hold other weights (%s), %d "
                       "back it", stage, snap.iteration, source[-8:], len(disagree),
                       ", ".join(p[-8:] for p in disagree), len(agree))
        errors.append(f"{source[-8:]}: its weights were disputed by {len(disagree)} other replica(s)")
        disputed = True
        # the replicas that disputed it are the likeliest honest majority: try them next
        order = [p for p in order if p in disagree] + [p for p in order if p not in disagree]
