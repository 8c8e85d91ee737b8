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

__all__ = ["install_protobuf_shim", "import_hivemind"]


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


install_protobuf_shim()
