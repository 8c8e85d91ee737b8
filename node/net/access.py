"""Swarm access control: a shared secret (``--swarm-key``) and/or an allowlist (``--allow-peers``).

Why both: a swarm key keeps out anybody who was not given the file, without having to collect
peer ids first; an allowlist pins the exact machines (peer ids survive restarts), and is what an
operator uses to evict one member whose copy of the key leaked.

How a peer proves membership:

* **Adverts and epochs in the DHT** are *sealed*: the stored value is the msgpack map
  ``{"sealed": encode(message), "proof": HMAC-SHA256(swarm key, encode(message))}``. The message
  is already bound to its owner (RSA-signed ``[owner:…]`` subkey whose peer id must equal the
  message's peer id), so a sealed advert cannot be replayed under another identity, and nobody
  without the key can produce one. The DHT record validator and every reader check the proof.
* **Allowlist**: the owner's peer id (derived from the RSA key of the subkey) must be listed.
* **Gossip**: a message is accepted only from a gossip id that an accepted advert names, i.e.
  from a peer that passed the two checks above; everything else is dropped and logged.
* **Data plane / RPC**: :meth:`SwarmAccess.peer_allowed` (exposed as
  ``Daemon.is_peer_allowed``) combines the allowlist with "has an accepted advert".
* **hello**: a joiner sends ``HMAC(key, "hello/" + its peer id)`` so that an honest operator
  with the wrong key file gets a clear error at once instead of a silent, empty view.

Without either option everything is accepted, exactly as before (values are stored unsealed).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass
from pathlib import Path

import msgpack

from node.errors import UserError

__all__ = [
    "SwarmAccess",
    "load_swarm_key",
    "load_allowlist",
    "MIN_SWARM_KEY_BYTES",
    "HELLO_PROOF_PARAM",
]

logger = logging.getLogger(__name__)

#: A shorter secret is refused: it would be guessable offline from one sealed advert.
MIN_SWARM_KEY_BYTES = 16
#: hello parameter carrying the joiner's proof of the swarm key.
HELLO_PROOF_PARAM = "swarm_proof"
_SEALED_KEYS = {"sealed", "proof"}
_HELLO_CONTEXT = b"hello/"


def load_swarm_key(path: Path) -> bytes:
    """The secret in ``path`` (surrounding whitespace stripped); UserError if unusable."""
    path = Path(path).expanduser()
    try:
        data = path.read_bytes().strip()
    except FileNotFoundError:
        raise UserError(f"--swarm-key {path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"--swarm-key {path}: is a directory, not a key file") from None
    except OSError as e:
        raise UserError(f"--swarm-key {path}: cannot read it: {e.strerror}") from None
    if not data:
        raise UserError(f"--swarm-key {path}: the file is empty (generate one with: head -c 32 /dev/urandom | base64 > {path})")
    if len(data) < MIN_SWARM_KEY_BYTES:
        raise UserError(f"--swarm-key {path}: key is {len(data)} bytes, at least {MIN_SWARM_KEY_BYTES} are needed")
    return data


def load_allowlist(path: Path) -> frozenset[str]:
    """Peer ids in ``path``, one per line, ``#`` starts a comment; UserError if unusable."""
    path = Path(path).expanduser()
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"--allow-peers {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--allow-peers {path}: cannot read it: {getattr(e, 'strerror', None) or e}") from None
    peers = set()
    for number, line in enumerate(text.splitlines(), 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        if " " in entry or not entry.isalnum():
            raise UserError(f"--allow-peers {path}:{number}: {entry!r} is not a peer id (one per line)")
        peers.add(entry)
    if not peers:
        raise UserError(f"--allow-peers {path}: lists no peer id (one per line, # for comments)")
    return frozenset(peers)


@dataclass(frozen=True)
class SwarmAccess:
    """The access policy of one node. Picklable (it travels to the forked DHT process)."""

    swarm_key: bytes | None = None
    allowed_peers: frozenset[str] | None = None

    @property
    def enabled(self) -> bool:
        return self.swarm_key is not None or self.allowed_peers is not None

    # ------------------------------------------------------------------ DHT values
    def proof(self, message: bytes) -> bytes:
        return hmac.new(self.swarm_key, message, hashlib.sha256).digest()

    def seal(self, message: bytes) -> bytes:
        """What goes into the DHT for an encoded advert/epoch (unchanged without a swarm key)."""
        if self.swarm_key is None:
            return message
        return msgpack.packb({"sealed": message, "proof": self.proof(message)}, use_bin_type=True)

    def unseal(self, value: bytes) -> bytes | None:
        """The encoded message inside a DHT value, or None if it lacks a valid proof.

        Without a swarm key, plain values pass and sealed ones are opened unchecked (a node
        without a key cannot judge them; it is not a member of a keyed swarm anyway).
        """
        sealed = _as_sealed(value)
        if self.swarm_key is None:
            return sealed[0] if sealed is not None else value
        if sealed is None:
            return None
        message, proof = sealed
        return message if hmac.compare_digest(self.proof(message), proof) else None

    # ------------------------------------------------------------------ peers
    def listed(self, peer_id: str) -> bool:
        """Allowlist check only (True without an allowlist)."""
        return self.allowed_peers is None or peer_id in self.allowed_peers

    def hello_proof(self, peer_id: str) -> str | None:
        if self.swarm_key is None:
            return None
        return hmac.new(self.swarm_key, _HELLO_CONTEXT + peer_id.encode(), hashlib.sha256).hexdigest()

    def check_hello(self, peer_id: str | None, proof: object) -> str | None:
        """Why a joiner is refused in ``hello`` (None = welcome)."""
        if self.swarm_key is not None:
            if not isinstance(proof, str) or peer_id is None:
                return "access denied: this swarm needs a swarm key (--swarm-key FILE)"
            if not hmac.compare_digest(self.hello_proof(peer_id), proof):
                return "access denied: wrong swarm key (--swarm-key FILE differs from this swarm's)"
        if peer_id is not None and not self.listed(peer_id):
            return f"access denied: peer {peer_id} is not in this swarm's allowlist (--allow-peers)"
        return None


def _as_sealed(value: bytes) -> tuple[bytes, bytes] | None:
    try:
        obj = msgpack.unpackb(value, raw=False)
    except Exception:  # noqa: BLE001 - not msgpack at all
        return None
    if isinstance(obj, dict) and set(obj) == _SEALED_KEYS:
        message, proof = obj["sealed"], obj["proof"]
        if isinstance(message, bytes) and isinstance(proof, bytes):
            return message, proof
    return None
