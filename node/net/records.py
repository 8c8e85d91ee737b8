"""Typed per-member DHT records of a training run: one key convention, one reader and one writer each.

Every record lives under a DHT key of the run with one subkey per member (its peer id), so a reader
gets all members' records with one ``get``:

* :class:`NormRecord` under ``<run>:gradnorm:<iteration>``: a member's stage gradient norm, loss sums
  and parameter checksum for one iteration (the norm exchange, the resync check, the averaging
  give-up rule and the "data node is done" fallback all read it);
* :class:`StartRecord` under ``<run>:trainstart``: the epoch, configuration and start iteration a
  member pinned (the start agreement, and a joiner's configuration check);
* :class:`FinishedRecord` under ``<run>:trainfinished``: a member trained the run to its end (a late
  joiner learns there is nothing left to train);
* :class:`StateClaimRecord` under ``<run>:stateclaim:<stage>:<nonce>``: what a replica says its stage's
  weights are at an iteration (a sketch under a verifier's nonce), which a joiner or re-syncing
  replica compares with the state it downloaded.

A record is a dict with a schema version ``v``. Readers validate what other peers wrote: sizes are
capped, numbers must be numbers (finite where a non-finite value has no meaning), and an entry whose
expiry lies further in the future than its record type's TTL allows is ignored (a peer cannot pin a
record in everyone's DHT).

**Ownership.** A daemon binds its DHT with :func:`sign_records` (its ``[owner:<ssh-rsa pubkey>]``
subkey and its :class:`~node.net.access.SwarmAccess`). A bound DHT writes each record under the
owner subkey, so hivemind's ``RSASignatureValidator`` signs it and every DHT node checks the
signature; the value is msgpack bytes sealed with the swarm key when one is set. A bound reader
keys records by the peer id *derived from the owner key* and ignores plain subkeys, other owners'
forgeries (they cannot sign), values without a valid swarm-key proof, oversized values, and owners
the caller's ``members`` filter leaves out; it counts every rejection (:func:`rejected_counts`)
and logs the first of each reason per owner. An unbound DHT (in-process harnesses whose DHTs run
no validators) keeps the plain peer-id subkeys: it has no identity to sign with.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Container, Dict, Optional, Tuple

import msgpack

from node.compat import import_hivemind
from node.net.access import SwarmAccess

__all__ = [
    "SCHEMA_VERSION",
    "NORM_RECORD_TTL_S",
    "START_RECORD_TTL_S",
    "FINISHED_RECORD_TTL_S",
    "RecordError",
    "NormRecord",
    "StartRecord",
    "FinishedRecord",
    "norm_key",
    "start_key",
    "finished_key",
    "write_norm_record",
    "read_norm_records",
    "write_start_record",
    "read_start_records",
    "write_finished_record",
    "read_finished_records",
    "StateClaimRecord",
    "STATE_CLAIM_TTL_S",
    "write_state_claim",
    "read_state_claims",
    "sign_records",
    "rejected_counts",
    "MAX_RECORD_BYTES",
]

logger = logging.getLogger(__name__)

#: Version of the record layout; a reader ignores records of another version (a member running other
#: code must not feed numbers it means differently into this member's step).
SCHEMA_VERSION = 1

#: A norm record is read only while its iteration is open; 5 minutes outlasts the longest norm-exchange
#: wait (``TrainerConfig.norm_exchange_timeout_s``, 2 minutes) with room, and then the key is garbage.
NORM_RECORD_TTL_S = 300.0
#: A start record is read during the start barrier and by joiners of the same session; an hour covers
#: any start debounce and agreement timeout, and an older session's record is ignored by its time anyway.
START_RECORD_TTL_S = 3600.0
#: A finished record tells late joiners the run is over; an hour is as long as anyone waits to join.
FINISHED_RECORD_TTL_S = 3600.0
#: A state claim is read once, seconds after it is written, by the verifier that asked for it.
STATE_CLAIM_TTL_S = 300.0
#: Values in one state claim's sketch (a few per tensor; a stage has at most a few thousand tensors).
MAX_SKETCH_VALUES = 3 * 4096
#: Slack on the expiry bound: members' DHT clocks disagree by a little.
EXPIRY_SLACK_S = 60.0
#: A DHT read that has not answered by then counts as a miss: hivemind can leave a search's future
#: unresolved when a replica's answer breaks it, and every caller polls again anyway.
DHT_READ_TIMEOUT_S = 30.0

MAX_PEER_ID_CHARS = 128
MAX_GROUP = 1024  # peers named in one averaging group
MAX_EPOCHS = 8  # announced epochs carried by one norm record
MAX_EPOCH_BYTES = 256 * 1024  # one encoded, signed schedule epoch
MAX_CONFIG_JSON = 64 * 1024  # a training summary, as JSON
MAX_COUNT = 2**40  # microbatches, tokens, iterations, epochs
#: One encoded (and sealed) record; a norm record with all its announced epochs fits with room.
MAX_RECORD_BYTES = MAX_EPOCHS * MAX_EPOCH_BYTES + 2 * MAX_CONFIG_JSON + 64 * 1024


class RecordError(ValueError):
    """A DHT record does not have the layout of its type."""


def norm_key(run_id: str, iteration: int) -> str:
    return f"{run_id}:gradnorm:{int(iteration)}"


def start_key(run_id: str) -> str:
    return f"{run_id}:trainstart"


def finished_key(run_id: str) -> str:
    return f"{run_id}:trainfinished"


# ---------------------------------------------------------------------- field checks
def _count(d: dict, name: str, default: Optional[int] = None) -> int:
    x = d.get(name, default)
    if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= MAX_COUNT:
        raise RecordError(f"{name} must be an integer in 0..{MAX_COUNT}, got {x!r}")
    return x


def _number(d: dict, name: str, finite: bool = True) -> float:
    x = d.get(name)
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise RecordError(f"{name} must be a number, got {type(x).__name__}")
    x = float(x)
    if finite and not math.isfinite(x):
        raise RecordError(f"{name} must be finite, got {x}")
    return x


def _positive(x: Any, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not (math.isfinite(x) and x > 0):
        raise RecordError(f"{name} must be a finite positive number, got {x!r:.40}")
    return float(x)


def _peer(x: Any) -> str:
    if not isinstance(x, str) or not 0 < len(x) <= MAX_PEER_ID_CHARS:
        raise RecordError(f"not a peer id: {x!r:.40}")
    return x


def _config(d: dict) -> dict:
    config = d.get("config")
    if not isinstance(config, dict) or not config:
        raise RecordError("config must be a non-empty dict")
    try:
        size = len(json.dumps(config))
    except (TypeError, ValueError) as e:
        raise RecordError(f"config is not JSON: {e}") from None
    if size > MAX_CONFIG_JSON:
        raise RecordError(f"config is {size} bytes of JSON, at most {MAX_CONFIG_JSON}")
    return config


def _check_version(d: Any) -> dict:
    if not isinstance(d, dict):
        raise RecordError(f"a record is a dict, got {type(d).__name__}")
    if d.get("v") != SCHEMA_VERSION:
        raise RecordError(f"schema version {d.get('v')!r}, this node reads {SCHEMA_VERSION}")
    return d


# ---------------------------------------------------------------------- record types
@dataclass(frozen=True)
class NormRecord:
    """One member's numbers for one iteration, published after its averaging round.

    ``sq`` (the stage's squared gradient norm), ``checksum`` and ``loss_sum`` may be non-finite: that
    is how a poisoned gradient or a diverged replica shows, and every member must see it to skip the
    step or to refuse that replica as a resync source."""

    stage: int
    sq: float
    checksum: float
    epoch: int
    loss_sum: float = 0.0
    n_mb: int = 0
    tokens: int = 0
    dropped: int = 0
    #: the peers this replica averaged with (empty: it skipped or failed its round)
    avg_group: Tuple[str, ...] = ()
    #: encoded schedule epochs the member knows of and others may not (see the epoch tracker)
    epochs: Tuple[bytes, ...] = field(default=(), repr=False)
    #: the member's fp16 loss scale (1.0 in fp32/bf16): every member checks the data nodes' one
    loss_scale: float = 1.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["avg_group"], d["epochs"] = list(self.avg_group), list(self.epochs)
        d["v"] = SCHEMA_VERSION
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "NormRecord":
        d = _check_version(d)
        group, epochs = d.get("avg_group", []), d.get("epochs", [])
        if not isinstance(group, (list, tuple)) or len(group) > MAX_GROUP:
            raise RecordError(f"avg_group must be a list of at most {MAX_GROUP} peer ids")
        if not isinstance(epochs, (list, tuple)) or len(epochs) > MAX_EPOCHS:
            raise RecordError(f"epochs must be a list of at most {MAX_EPOCHS} encoded epochs")
        if not all(isinstance(e, bytes) and len(e) <= MAX_EPOCH_BYTES for e in epochs):
            raise RecordError(f"an announced epoch is not bytes of at most {MAX_EPOCH_BYTES}")
        return cls(stage=_count(d, "stage"), sq=_number(d, "sq", finite=False),
                   checksum=_number(d, "checksum", finite=False), epoch=_count(d, "epoch"),
                   loss_sum=_number(d, "loss_sum", finite=False), n_mb=_count(d, "n_mb", 0),
                   tokens=_count(d, "tokens", 0), dropped=_count(d, "dropped", 0),
                   avg_group=tuple(_peer(p) for p in group), epochs=tuple(epochs),
                   loss_scale=_positive(d.get("loss_scale", 1.0), "loss_scale"))


@dataclass(frozen=True)
class StartRecord:
    """The schedule epoch, training configuration and start iteration a member pinned; ``time`` (unix)
    tells this session's records from an earlier session's."""

    epoch: int
    config: dict
    start: int
    time: float

    def to_dict(self) -> dict:
        return {"v": SCHEMA_VERSION, "epoch": self.epoch, "config": self.config, "start": self.start,
                "time": self.time}

    @classmethod
    def from_dict(cls, d: Any) -> "StartRecord":
        d = _check_version(d)
        return cls(epoch=_count(d, "epoch"), config=_config(d), start=_count(d, "start"), time=_number(d, "time"))


@dataclass(frozen=True)
class FinishedRecord:
    """A member trained the run with ``config`` through its last iteration ``iteration``."""

    config: dict
    iteration: int
    time: float

    def to_dict(self) -> dict:
        return {"v": SCHEMA_VERSION, "config": self.config, "iteration": self.iteration, "time": self.time}

    @classmethod
    def from_dict(cls, d: Any) -> "FinishedRecord":
        d = _check_version(d)
        return cls(config=_config(d), iteration=_count(d, "iteration"), time=_number(d, "time"))


@dataclass(frozen=True)
class StateClaimRecord:
    """A replica's sketch of its stage's weights at ``iteration`` under a verifier's nonce (the nonce is
    in the key): its signed word about what it holds, compared with a downloaded state."""

    stage: int
    iteration: int
    sketch: Tuple[float, ...]

    def to_dict(self) -> dict:
        return {"v": SCHEMA_VERSION, "stage": self.stage, "iteration": self.iteration, "sketch": list(self.sketch)}

    @classmethod
    def from_dict(cls, d: Any) -> "StateClaimRecord":
        d = _check_version(d)
        sketch = d.get("sketch")
        if not isinstance(sketch, (list, tuple)) or len(sketch) > MAX_SKETCH_VALUES:
            raise RecordError(f"sketch must be a list of at most {MAX_SKETCH_VALUES} numbers")
        if not all(isinstance(x, float) for x in sketch):
            raise RecordError("sketch values must be floats")
        return cls(stage=_count(d, "stage"), iteration=_count(d, "iteration"), sketch=tuple(sketch))


def state_claim_key(run_id: str, stage: int, nonce: bytes) -> str:
    return f"{run_id}:stateclaim:{int(stage)}:{bytes(nonce).hex()}"


# ---------------------------------------------------------------------- DHT access
_BINDING_ATTR = "_skippipe_record_signer"


@dataclass
class _Signer:
    owner_subkey: bytes
    access: SwarmAccess
    rejected: "collections.Counter[str]" = field(default_factory=collections.Counter)
    said: set = field(default_factory=set)

    def reject(self, reason: str, key: str, who: str) -> None:
        self.rejected[reason] += 1
        if len(self.said) < 1024 and (reason, who) not in self.said:
            self.said.add((reason, who))
            logger.warning("ignoring a DHT record under %s from %s: %s", key, who, reason)
        else:
            logger.debug("ignoring a DHT record under %s from %s: %s", key, who, reason)


def sign_records(dht, owner_subkey: bytes, access: Optional[SwarmAccess] = None) -> None:
    """Bind ``dht`` (a daemon's, whose validators include ``RSASignatureValidator`` for the key behind
    ``owner_subkey``) so that its records are owner-signed and sealed, and read back only so."""
    if not isinstance(owner_subkey, bytes) or not owner_subkey.startswith(b"[owner:"):
        raise ValueError("owner_subkey must be an [owner:<public key>] subkey")
    setattr(dht, _BINDING_ATTR, _Signer(owner_subkey, access or SwarmAccess()))


def _signer(dht) -> Optional[_Signer]:
    return getattr(dht, _BINDING_ATTR, None)


def rejected_counts(dht) -> Dict[str, int]:
    """Records a bound reader ignored so far, by reason (empty for an unbound DHT)."""
    signer = _signer(dht)
    return dict(signer.rejected) if signer is not None else {}


@functools.lru_cache(maxsize=4096)
def _owner_peer_id(subkey: bytes) -> Optional[str]:
    """The peer id of the public key inside an ``[owner:...]`` subkey, or None."""
    from node.net.identity import peer_id_from_rsa_public_key

    import_hivemind()
    from hivemind.dht.crypto import RSASignatureValidator

    found = RSASignatureValidator._PUBLIC_KEY_RE.findall(subkey)
    if len(found) != 1:
        return None
    try:
        return peer_id_from_rsa_public_key(found[0])
    except Exception:  # noqa: BLE001 - a malformed key from the network
        return None


def _dht_time() -> float:
    import_hivemind()
    from hivemind.utils import get_dht_time

    return get_dht_time()


async def _write(dht, key: str, subkey: str, record, ttl_s: float) -> None:
    signer = _signer(dht)
    if signer is None:
        value, subkey = record.to_dict(), str(subkey)
    else:
        value = signer.access.seal(msgpack.packb(record.to_dict(), use_bin_type=True))
        subkey = signer.owner_subkey
    await dht.store(key, value, expiration_time=_dht_time() + ttl_s, subkey=subkey, return_future=True)


def _open_signed(signer: _Signer, key: str, subkey: Any, value: Any) -> Tuple[Optional[str], Any]:
    """(owner peer id, decoded dict) of a bound entry, or (None, None) after counting why not."""
    who = _owner_peer_id(subkey) if isinstance(subkey, bytes) else None
    if who is None:
        signer.reject("not under an owner subkey", key, repr(subkey)[:24])
        return None, None
    if not isinstance(value, bytes):
        signer.reject("not a sealed record", key, who[-8:])
        return None, None
    if len(value) > MAX_RECORD_BYTES:
        signer.reject(f"larger than {MAX_RECORD_BYTES} bytes", key, who[-8:])
        return None, None
    message = signer.access.unseal(value)
    if message is None:
        signer.reject("no valid swarm-key proof", key, who[-8:])
        return None, None
    if not signer.access.listed(who):
        signer.reject("owner not in the allowlist", key, who[-8:])
        return None, None
    try:
        return who, msgpack.unpackb(message, raw=False)
    except Exception:  # noqa: BLE001 - garbage from the network
        signer.reject("not msgpack", key, who[-8:])
        return None, None


async def _read(dht, key: str, cls, ttl_s: float,
                members: Optional[Container[str]] = None) -> Optional[Dict[str, Any]]:
    """Peer id -> record of every valid entry under ``key`` (of an owner in ``members`` when given);
    None when the read found nothing (under load a miss is not "nobody wrote")."""
    try:
        res = await asyncio.wait_for(dht.get(key, latest=True, return_future=True), DHT_READ_TIMEOUT_S)
    except asyncio.TimeoutError:
        return None  # a search that never resolves (a poisoned replica) is a miss: the caller polls again
    if res is None or not isinstance(res.value, dict):
        return None
    signer = _signer(dht)
    latest_expiry = _dht_time() + ttl_s + EXPIRY_SLACK_S
    out: Dict[str, Any] = {}
    for subkey, entry in res.value.items():
        value = getattr(entry, "value", None)
        if signer is None:
            who = str(subkey)
        else:
            who, value = _open_signed(signer, key, subkey, value)
            if who is None:
                continue
        expiry = getattr(entry, "expiration_time", None)
        if isinstance(expiry, (int, float)) and expiry > latest_expiry:
            if signer is not None:
                signer.reject("expiry beyond the record's TTL", key, who[-8:])
            continue
        if members is not None and who not in members:
            if signer is not None:
                signer.reject("owner is not a member of the run", key, who[-8:])
            continue
        try:
            out[_peer(who)] = cls.from_dict(value)
        except RecordError as e:
            if signer is not None:
                signer.reject(f"malformed: {e}", key, who[-8:])
            continue
    return out


async def write_norm_record(dht, run_id: str, iteration: int, peer_id: str, record: NormRecord,
                            ttl_s: float = NORM_RECORD_TTL_S) -> None:
    await _write(dht, norm_key(run_id, iteration), peer_id, record, min(ttl_s, NORM_RECORD_TTL_S))


async def read_norm_records(dht, run_id: str, iteration: int,
                            members: Optional[Container[str]] = None) -> Optional[Dict[str, NormRecord]]:
    return await _read(dht, norm_key(run_id, iteration), NormRecord, NORM_RECORD_TTL_S, members)


async def write_start_record(dht, run_id: str, peer_id: str, record: StartRecord) -> None:
    await _write(dht, start_key(run_id), peer_id, record, START_RECORD_TTL_S)


async def read_start_records(dht, run_id: str,
                             members: Optional[Container[str]] = None) -> Optional[Dict[str, StartRecord]]:
    return await _read(dht, start_key(run_id), StartRecord, START_RECORD_TTL_S, members)


async def write_finished_record(dht, run_id: str, peer_id: str, record: FinishedRecord) -> None:
    await _write(dht, finished_key(run_id), peer_id, record, FINISHED_RECORD_TTL_S)


async def read_finished_records(dht, run_id: str,
                                members: Optional[Container[str]] = None) -> Optional[Dict[str, FinishedRecord]]:
    return await _read(dht, finished_key(run_id), FinishedRecord, FINISHED_RECORD_TTL_S, members)


async def write_state_claim(dht, run_id: str, peer_id: str, nonce: bytes, record: StateClaimRecord) -> None:
    await _write(dht, state_claim_key(run_id, record.stage, nonce), peer_id, record, STATE_CLAIM_TTL_S)


async def read_state_claims(dht, run_id: str, stage: int, nonce: bytes,
                            members: Optional[Container[str]] = None) -> Optional[Dict[str, StateClaimRecord]]:
    return await _read(dht, state_claim_key(run_id, stage, nonce), StateClaimRecord, STATE_CLAIM_TTL_S, members)
