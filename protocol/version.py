"""The wire protocol version.

Peers compare this number before trusting anything else in a message, so that a daemon
running an older release rejects a newer peer's messages loudly instead of misreading them.
Bump it whenever the encoding of any existing message changes incompatibly.
"""

from __future__ import annotations

__all__ = ["PROTOCOL_VERSION"]

#: Version carried in the ``"v"`` key of every envelope; decoders accept only this value.
#: 2: ``MicrobatchId.attempt`` (recomputed microbatches) and ``ScheduleEpoch.start_iteration``
#: (epochs switch at an announced iteration boundary).
#: 3: ``ActivationMessage``/``GradientMessage.deliver_at_unix`` (WAN emulation: the receiver holds a
#: hop message until its emulated delivery time, so real transport time counts against the emulated one).
PROTOCOL_VERSION: int = 3
