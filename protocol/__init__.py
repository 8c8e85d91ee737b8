"""Wire protocol of SkipPipe Swarm: versioned msgpack envelopes and tensor frames.

This package imports nothing else of ours, so every other package can depend on it; it does not
import torch either (tensor conversions import it on first use). Modules, one job each:
``version`` (the protocol number), ``errors`` (what decoders raise), ``limits`` (size caps),
``schema`` (annotation-driven validation), ``registry`` (``@register_message``), ``codec``
(``encode``/``decode``), ``tensor`` (``TensorFrame``), ``compression`` (payload codec hook) and
``messages`` (the swarm's message types).
"""

from __future__ import annotations

from .codec import decode, encode, encode_parts
from .errors import (
    FrameTooLarge,
    MalformedMessage,
    NonFiniteTensor,
    ProtocolError,
    ShapeMismatch,
    UnknownMessageType,
    UnsupportedVersion,
)
from .limits import DEFAULT_MAX_BYTES
from .messages import (
    ActivationMessage,
    GradientMessage,
    HopMessage,
    HopFailure,
    IterationDone,
    LinkReport,
    MembershipEvent,
    MicrobatchId,
    NormReport,
    RpcRequest,
    RpcResponse,
    ScheduleEpoch,
    StageAdvert,
)
from .registry import register_message
from .tensor import TensorFrame
from .version import PROTOCOL_VERSION

__all__ = [
    "PROTOCOL_VERSION",
    "DEFAULT_MAX_BYTES",
    "encode",
    "encode_parts",
    "decode",
    "register_message",
    "TensorFrame",
    "ProtocolError",
    "UnsupportedVersion",
    "UnknownMessageType",
    "MalformedMessage",
    "FrameTooLarge",
    "ShapeMismatch",
    "NonFiniteTensor",
    "MicrobatchId",
    "ActivationMessage",
    "GradientMessage",
    "HopMessage",
    "HopFailure",
    "IterationDone",
    "NormReport",
    "StageAdvert",
    "MembershipEvent",
    "LinkReport",
    "ScheduleEpoch",
    "RpcRequest",
    "RpcResponse",
]
