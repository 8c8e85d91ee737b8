"""Persistent node identities and the guard against running one identity twice.

A node has two keys because it runs two listening stacks:

* an RSA key for hivemind's p2pd. RSA (not Ed25519) because hivemind's own "identity already
  taken" check and its ``RSASignatureValidator`` only understand RSA, so one key gives the peer id,
  the DHT record ownership (``[owner:ssh-rsa ...]`` subkeys) and the schedule-epoch signatures;
* an Ed25519 key for the py-libp2p gossip host. Sharing one key between two listeners would give
  two hosts with one peer id and different addresses, which confuses peers and routing; the
  signed stage advert names both ids instead.

Both are created once and reused, so the peer id survives restarts. :class:`IdentityLock` holds
an exclusive ``flock`` on ``<identity>.lock`` (with the owner's pid inside) for the daemon's
lifetime: the kernel releases it when the process dies, even on SIGKILL.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

import node.compat  # noqa: F401  (protobuf shim before hivemind)
from cryptography.hazmat.primitives import serialization
from hivemind.p2p import P2P, PeerID
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.pb import crypto_pb2

from node.errors import UserError

__all__ = [
    "NodeIdentity",
    "IdentityLock",
    "load_or_create_identity",
    "load_or_create_gossip_key",
    "peer_id_from_rsa_public_key",
    "verify_rsa_signature",
    "looks_like_peer_id",
]

#: An RSA identity file is about 1.2 KiB; anything much larger is not one (and is not read into memory).
MAX_IDENTITY_FILE_BYTES = 64 << 10
#: Bytes of an Ed25519 seed (the gossip key file holds exactly this).
ED25519_SEED_BYTES = 32


class _LoadedRSAPrivateKey(RSAPrivateKey):
    """hivemind's RSAPrivateKey built from existing DER bytes (hivemind only generates fresh ones).

    Pickles like its parent, so it can be handed to the forked DHT process inside a validator.
    """

    def __init__(self, der: bytes):  # noqa: D107 - parent __init__ would generate a new key
        self._private_key = serialization.load_der_private_key(der, password=None)


@dataclass
class NodeIdentity:
    """The node's hivemind identity: file path, RSA key and the peer id p2pd will use."""

    path: Path
    private_key: RSAPrivateKey
    peer_id: PeerID

    @property
    def public_key_bytes(self) -> bytes:
        """OpenSSH encoding, as embedded in ``[owner:...]`` DHT subkeys."""
        return self.private_key.get_public_key().to_bytes()

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)


def load_or_create_identity(path: Path) -> NodeIdentity:
    """Read the RSA identity at ``path``, generating it (mode 0400) on first use."""
    path = Path(path).expanduser()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(path))
    try:
        if path.stat().st_size > MAX_IDENTITY_FILE_BYTES:
            raise ValueError(f"larger than {MAX_IDENTITY_FILE_BYTES} bytes, not an identity key")
        raw = path.read_bytes()
        try:
            proto = crypto_pb2.PrivateKey.FromString(raw)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError (not a ValueError) on garbage
            raise ValueError("not a libp2p private key file") from None
        if proto.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError("not an RSA key")
        try:
            key = _LoadedRSAPrivateKey(proto.data)
            peer_id = PeerID.from_identity(raw)
        except Exception:  # noqa: BLE001 - cryptography raises several kinds on a damaged key
            raise ValueError("damaged RSA key") from None
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read identity {path}: {e} (delete it to create a new one)") from None
    return NodeIdentity(path=path, private_key=key, peer_id=peer_id)


def load_or_create_gossip_key(path: Path) -> KeyPair:
    """The gossip host's Ed25519 key pair, stored as its 32-byte seed (mode 0400)."""
    from libp2p.crypto.ed25519 import create_new_key_pair

    path = Path(path).expanduser()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        seed = os.urandom(ED25519_SEED_BYTES)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(seed)
    try:
        seed = path.read_bytes() if path.stat().st_size <= MAX_IDENTITY_FILE_BYTES else b""
    except OSError as e:
        raise UserError(f"cannot read gossip key {path}: {e.strerror or e}") from None
    if len(seed) != ED25519_SEED_BYTES:
        raise UserError(f"gossip key {path} is corrupt (expected {ED25519_SEED_BYTES} bytes); delete it")
    return create_new_key_pair(seed)


def peer_id_from_rsa_public_key(openssh_public_key: bytes) -> str:
    """The libp2p peer id (``Qm...``) of an RSA public key given in OpenSSH form.

    Lets a validator check that an advert's claimed peer id belongs to the key that signed it.
    """
    import multihash

    pub = serialization.load_ssh_public_key(openssh_public_key)
    der = pub.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


def verify_rsa_signature(openssh_public_key: bytes, data: bytes, signature: bytes) -> bool:
    """Check a hivemind-style (base64 PSS/SHA-256) signature; False on any malformed input."""
    try:
        return RSAPublicKey.from_bytes(openssh_public_key).verify(data, signature)
    except Exception:  # malformed key bytes from the network
        return False


class IdentityLock:
    """Exclusive lock on an identity: a second daemon with the same key fails with a clear error."""

    def __init__(self, identity_path: Path):
        self.path = Path(str(identity_path) + ".lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise
            owner = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise UserError(
                f"identity {str(self.path)[: -len('.lock')]} is already used by a running daemon (pid {owner}); "
                "stop it or pass --identity with another file"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "IdentityLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


#: A libp2p peer id as text: base58 (no 0, O, I, l) of a multihash, 46 characters for an RSA key's
#: sha2-256 and 52-53 for an inlined Ed25519 key; the bounds leave room for other key types.
_PEER_ID_TEXT = re.compile(r"[1-9A-HJ-NP-Za-km-z]{32,64}")


def looks_like_peer_id(text: object) -> bool:
    """Whether ``text`` (a str from a peer) is shaped like a base58 peer id: checked before it names anyone
    in a log, a table or a relayed frame (its key is proved elsewhere, by the stream or a signature)."""
    return isinstance(text, str) and _PEER_ID_TEXT.fullmatch(text) is not None
