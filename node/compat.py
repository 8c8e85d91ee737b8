"""Import hivemind and py-libp2p side by side.

Both packages register the protobuf package ``crypto.pb`` (hivemind's ``crypto.proto`` is a strict
subset of libp2p's), so importing both into one process fails with "duplicate symbol
'crypto.pb.KeyType'". Pointing ``hivemind.proto.crypto_pb2`` at libp2p's module before hivemind is
first imported makes them share one descriptor. Every module of ours that needs hivemind imports it
through :func:`import_hivemind` (or imports this module first).
"""

from __future__ import annotations

import sys
from types import ModuleType

__all__ = ["install_protobuf_shim", "import_hivemind", "make_dht_storage_total_order"]


def install_protobuf_shim() -> None:
    """Make ``hivemind.proto.crypto_pb2`` an alias of ``libp2p.crypto.pb.crypto_pb2``.

    Must run before the first ``import hivemind``; calling it again is a no-op.
    """
    if "hivemind.proto.crypto_pb2" in sys.modules:
        return
    if "hivemind" in sys.modules:
        raise RuntimeError("hivemind was imported before the protobuf shim; import node.compat first")
    from libp2p.crypto.pb import crypto_pb2

    sys.modules["hivemind.proto.crypto_pb2"] = crypto_pb2


def import_hivemind() -> ModuleType:
    """Return the ``hivemind`` module, installing the shim first."""
    install_protobuf_shim()
    import hivemind

    return hivemind


def _heap_entry_lt(self, other) -> bool:
    if self.expiration_time != other.expiration_time:
        return self.expiration_time < other.expiration_time
    try:
        return bool(self.key < other.key)
    except TypeError:  # e.g. a str subkey next to a bytes one: order by type name, then repr
        return (type(self.key).__name__, repr(self.key)) < (type(other.key).__name__, repr(other.key))


def make_dht_storage_total_order() -> None:
    """Let hivemind's ``TimedStorage`` hold subkeys of mixed types that expire at the same instant.

    Its expiration heap orders entries by ``(expiration_time, key)``. A dictionary value whose
    subkeys are a ``str`` and a ``bytes`` (any peer may store any msgpack subkey) with equal
    expiration times makes ``heapq`` raise ``TypeError`` on that key's every later store, and a
    search that merges such a dictionary dies without resolving its future: an outsider can make
    a key of the run unreadable and unwritable on a node. Ties are broken by type name, then repr.
    Must run before the DHT process forks (it inherits the patched class); idempotent.
    """
    import_hivemind()
    from hivemind.utils import timed_storage

    timed_storage.HeapEntry.__lt__ = _heap_entry_lt


install_protobuf_shim()
