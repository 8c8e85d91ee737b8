"""Stage adverts and schedule epochs stored in the hivemind DHT.

Layout (one key per (run, stage), one subkey per peer):

* ``skippipe/<run>/stage/<k>`` -> subkey ``[owner:<ssh-rsa pubkey>]`` -> ``encode(StageAdvert)``,
  expiring ``advert_ttl`` after each re-announcement; a node that stops heartbeating drops out of
  every reader's view when its record expires, with no explicit goodbye needed.
* ``skippipe/<run>/epoch`` -> subkey ``[owner:<coordinator pubkey>]`` -> ``encode(ScheduleEpoch)``:
  the latest epoch, so that late joiners adopt it without waiting for gossip.

Protection: :class:`hivemind.dht.crypto.RSASignatureValidator` makes a subkey that carries a
public key writable only with the matching private key (the value is signed), and
:class:`SkipPipeRecordValidator` checks the *content*: a well-formed message whose peer id is
the one derived from that same public key. Together a peer can neither overwrite another peer's
subkey nor publish an advert in its own subkey that claims to be someone else. DHT keys reach
validators hashed, so the validator recognises our records by their envelope, not their key;
values that are not skippipe envelopes are left to their own validators.

Access control (:mod:`node.net.access`): with a swarm key every value is *sealed* (message + HMAC
proof) and a plain or badly proved skippipe record is rejected; with an allowlist the owner's
peer id must be listed. Readers apply the same checks, because a record can also come back from
the local storage of a DHT node that does not run our validator (or has another key).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterable, Iterator

import msgpack

import node.compat  # noqa: F401
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer

from node.net.access import SwarmAccess, _as_sealed
from node.net.identity import peer_id_from_rsa_public_key
from protocol.errors import ProtocolError
from protocol.messages import ScheduleEpoch, StageAdvert, decode, encode

__all__ = [
    "stage_key",
    "epoch_key",
    "owner_public_key",
    "SkipPipeRecordValidator",
    "make_record_validators",
    "FetchedAdvert",
    "AdvertStore",
]

logger = logging.getLogger(__name__)

#: Envelope keys of protocol messages (``{"v", "t", "b"}``), used to recognise our records.
_ENVELOPE_KEYS = {"v", "t", "b"}
_PROTECTED_TYPES = {StageAdvert.TYPE, ScheduleEpoch.TYPE}


def stage_key(run_id: str, stage: int) -> str:
    return f"skippipe/{run_id}/stage/{int(stage)}"


def epoch_key(run_id: str) -> str:
    return f"skippipe/{run_id}/epoch"


def owner_public_key(subkey: bytes) -> bytes | None:
    """The OpenSSH public key inside an ``[owner:...]`` subkey, or None."""
    found = RSASignatureValidator._PUBLIC_KEY_RE.findall(subkey) if isinstance(subkey, bytes) else []
    return found[0] if len(found) == 1 else None


class SkipPipeRecordValidator(RecordValidatorBase):
    """Content validator for stage adverts and epochs (runs after the RSA signature check).

    Rejects a skippipe record unless: it decodes as a :class:`StageAdvert` or
    :class:`ScheduleEpoch`, it sits in an ``[owner:...]`` subkey, and its ``peer_id`` (advert) or
    ``coordinator`` (epoch) is the peer id of that owner key; with ``access`` enabled also a
    valid swarm-key proof and an allowlisted owner. Must be picklable (it travels to the forked
    DHT process), so it holds nothing but the (immutable) access policy.
    """

    def __init__(self, access: SwarmAccess | None = None) -> None:
        self.access = access or SwarmAccess()

    def validate(self, record: DHTRecord) -> bool:
        try:
            raw = MSGPackSerializer.loads(record.value)
        except Exception:  # noqa: BLE001 - not msgpack: not ours
            return True
        if not isinstance(raw, bytes):
            return True
        if _as_sealed(raw) is not None or self.access.swarm_key is not None:
            opened = self.access.unseal(raw)
            if opened is None:
                if _as_sealed(raw) is not None:
                    logger.debug("rejecting sealed skippipe record with a wrong swarm-key proof")
                    return False
                if _is_protected_envelope(raw):
                    logger.debug("rejecting unsealed skippipe record: this swarm needs a swarm-key proof")
                    return False
                return True
            raw = opened
        try:
            envelope = msgpack.unpackb(raw, raw=False)
        except Exception:  # noqa: BLE001
            return True
        if not (isinstance(envelope, dict) and set(envelope) == _ENVELOPE_KEYS):
            return True
        if envelope.get("t") not in _PROTECTED_TYPES:
            return True
        try:
            message = decode(raw, expect=(StageAdvert, ScheduleEpoch))
        except ProtocolError as e:
            logger.debug("rejecting malformed skippipe record: %s", e)
            return False
        owner = owner_public_key(record.subkey)
        if owner is None:
            logger.debug("rejecting skippipe record without an owner subkey")
            return False
        try:
            owner_id = peer_id_from_rsa_public_key(owner)
        except Exception:  # noqa: BLE001 - malformed key from the network
            return False
        claimed = message.peer_id if isinstance(message, StageAdvert) else message.coordinator
        if claimed != owner_id:
            logger.debug("rejecting record claiming %s from key of %s", claimed, owner_id)
            return False
        if not self.access.listed(owner_id):
            logger.debug("rejecting record of %s: not in the allowlist", owner_id)
            return False
        return True

    @property
    def priority(self) -> int:
        return 0  # below RSASignatureValidator (10): it sees the value with the signature stripped

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, SkipPipeRecordValidator) and other.access == self.access


def _is_protected_envelope(raw: bytes) -> bool:
    try:
        envelope = msgpack.unpackb(raw, raw=False)
    except Exception:  # noqa: BLE001
        return False
    return isinstance(envelope, dict) and set(envelope) == _ENVELOPE_KEYS and envelope.get("t") in _PROTECTED_TYPES


def make_record_validators(private_key, access: SwarmAccess | None = None) -> list[RecordValidatorBase]:
    """Validators every daemon's DHT runs: RSA ownership + skippipe content (+ access policy)."""
    return [RSASignatureValidator(private_key), SkipPipeRecordValidator(access)]


@dataclass(frozen=True)
class FetchedAdvert:
    """An advert read back from the DHT, with the owner key that protects it."""

    advert: StageAdvert
    public_key: bytes
    expiration_time: float


class AdvertStore:
    """Reads and writes this run's adverts and epochs through a running ``hivemind.DHT``.

    Every call is non-blocking for the event loop (``return_future=True`` + ``await``).
    """

    def __init__(self, dht, run_id: str, owner_subkey: bytes, access: SwarmAccess | None = None):
        self.dht = dht
        self.run_id = run_id
        self.owner_subkey = owner_subkey
        self.access = access or SwarmAccess()
        #: Records skipped because they lacked a valid proof or an allowlisted owner.
        self.rejected = 0

    def _open(self, value: object, owner: bytes) -> bytes | None:
        """The message bytes of a stored value if the access policy accepts it."""
        if not isinstance(value, bytes):
            return None
        message = self.access.unseal(value)
        if message is None:
            self.rejected += 1
            return None
        if self.access.allowed_peers is not None:
            try:
                if not self.access.listed(peer_id_from_rsa_public_key(owner)):
                    self.rejected += 1
                    return None
            except Exception:  # noqa: BLE001 - malformed key from the network
                return None
        return message

    async def announce(self, advert: StageAdvert, ttl_s: float, stages: Iterable[int] | None = None) -> bool:
        """Store ``advert`` under each of its stages; True if every store succeeded."""
        value = self.access.seal(encode(advert))
        expiration = time.time() + ttl_s  # hivemind uses wall-clock (get_dht_time) expirations
        stages = tuple(advert.stages if stages is None else stages)
        results = []
        for stage in stages:
            fut = self.dht.store(
                stage_key(self.run_id, stage),
                value,
                expiration_time=expiration,
                subkey=self.owner_subkey,
                return_future=True,
            )
            results.append(fut)
        ok = True
        for fut in results:
            try:
                ok = bool(await fut) and ok
            except Exception as e:  # noqa: BLE001 - a failed store is retried next heartbeat
                logger.debug("advert store failed: %r", e)
                ok = False
        return ok

    async def fetch_all(self, num_stages: int) -> dict[str, FetchedAdvert]:
        """All live adverts of stages ``0..num_stages-1``, one per peer (the freshest)."""
        futures = [
            self.dht.get(stage_key(self.run_id, s), latest=True, return_future=True) for s in range(num_stages)
        ]
        by_peer: dict[str, FetchedAdvert] = {}
        for stage, fut in enumerate(futures):
            try:
                found = await fut
            except Exception as e:  # noqa: BLE001
                logger.debug("advert fetch for stage %d failed: %r", stage, e)
                continue
            for item in self._parse_adverts(found, stage):
                old = by_peer.get(item.advert.peer_id)
                if old is None or item.advert.timestamp > old.advert.timestamp:
                    by_peer[item.advert.peer_id] = item
        return by_peer

    def _owned_records(self, found, cls: type) -> Iterator[tuple[object, bytes, object]]:
        """(decoded message, owner public key, DHT item) for every subkey of ``found`` that opens
        (signature, swarm-key proof) and decodes as ``cls``; anything else is skipped."""
        if found is None or not isinstance(found.value, dict):
            return
        for subkey, item in found.value.items():
            owner = owner_public_key(subkey)
            message = self._open(item.value, owner) if owner is not None else None
            if message is None:
                continue
            try:
                decoded = decode(message, expect=cls)
            except ProtocolError:
                continue
            yield decoded, owner, item

    def _parse_adverts(self, found, stage: int) -> list[FetchedAdvert]:
        out = []
        for advert, owner, item in self._owned_records(found, StageAdvert):
            if advert.run_id != self.run_id or stage not in advert.stages:
                continue
            try:
                if peer_id_from_rsa_public_key(owner) != advert.peer_id:
                    continue  # defence in depth: validators should have dropped it already
            except Exception:  # noqa: BLE001
                continue
            out.append(FetchedAdvert(advert, owner, item.expiration_time))
        return out

    async def store_epoch(self, epoch: ScheduleEpoch, ttl_s: float) -> bool:
        fut = self.dht.store(
            epoch_key(self.run_id),
            self.access.seal(encode(epoch)),
            expiration_time=time.time() + ttl_s,
            subkey=self.owner_subkey,
            return_future=True,
        )
        try:
            return bool(await fut)
        except Exception as e:  # noqa: BLE001
            logger.debug("epoch store failed: %r", e)
            return False

    async def fetch_epochs(self) -> list[tuple[ScheduleEpoch, bytes]]:
        """Every stored epoch with its owner key (the caller checks signatures and picks one)."""
        try:
            found = await self.dht.get(epoch_key(self.run_id), latest=True, return_future=True)
        except Exception as e:  # noqa: BLE001
            logger.debug("epoch fetch failed: %r", e)
            return []
        return [(epoch, owner) for epoch, owner, _ in self._owned_records(found, ScheduleEpoch)
                if epoch.run_id == self.run_id]
