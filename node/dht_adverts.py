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
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterable

import msgpack

import node.compat  # noqa: F401
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer

from node.identity import peer_id_from_rsa_public_key
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
    ``coordinator`` (epoch) is the peer id of that owner key. Must be picklable (it travels to
    the forked DHT process), so it holds no state.
    """

    def validate(self, record: DHTRecord) -> bool:
        try:
            raw = MSGPackSerializer.loads(record.value)
        except Exception:  # noqa: BLE001 - not msgpack: not ours
            return True
        if not isinstance(raw, bytes):
            return True
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
        return True

    @property
    def priority(self) -> int:
        return 0  # below RSASignatureValidator (10): it sees the value with the signature stripped

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, SkipPipeRecordValidator)


def make_record_validators(private_key) -> list[RecordValidatorBase]:
    """Validators every daemon's DHT runs: RSA ownership + skippipe content."""
    return [RSASignatureValidator(private_key), SkipPipeRecordValidator()]


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

    def __init__(self, dht, run_id: str, owner_subkey: bytes):
        self.dht = dht
        self.run_id = run_id
        self.owner_subkey = owner_subkey

    async def announce(self, advert: StageAdvert, ttl_s: float, stages: Iterable[int] | None = None) -> bool:
        """Store ``advert`` under each of its stages; True if every store succeeded."""
        value = encode(advert)
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

    async def fetch_stage(self, stage: int) -> list[FetchedAdvert]:
        found = await self.dht.get(stage_key(self.run_id, stage), latest=True, return_future=True)
        return self._parse_adverts(found, stage)

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

    def _parse_adverts(self, found, stage: int) -> list[FetchedAdvert]:
        if found is None or not isinstance(found.value, dict):
            return []
        out = []
        for subkey, item in found.value.items():
            owner = owner_public_key(subkey)
            if owner is None or not isinstance(item.value, bytes):
                continue
            try:
                advert = decode(item.value, expect=StageAdvert)
            except ProtocolError:
                continue
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
            encode(epoch),
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
        if found is None or not isinstance(found.value, dict):
            return []
        out = []
        for subkey, item in found.value.items():
            owner = owner_public_key(subkey)
            if owner is None or not isinstance(item.value, bytes):
                continue
            try:
                epoch = decode(item.value, expect=ScheduleEpoch)
            except ProtocolError:
                continue
            if epoch.run_id == self.run_id:
                out.append((epoch, owner))
        return out
