"""Encoding and decoding of versioned msgpack envelopes ``{"v": version, "t": TYPE, "b": body}``.

Decoding is the one place where untrusted bytes from peers enter the daemon, so it is strict
and total: the size limit is checked before msgpack sees the data, msgpack itself runs with
length limits and without extension types, every field is validated against its annotation, and
any failure (including msgpack's own exceptions, Unicode errors or recursion) surfaces as a
:class:`~protocol.errors.ProtocolError` subclass and nothing else.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, TypeVar

import msgpack

from .errors import FrameTooLarge, MalformedMessage, ProtocolError, UnknownMessageType, UnsupportedVersion
from .limits import DEFAULT_MAX_BYTES
from .options import DecodeOptions
from .registry import message_class, message_spec
from .schema import Writer, spec_for_dataclass
from .version import PROTOCOL_VERSION

__all__ = ["encode", "encode_parts", "decode", "pack_value", "unpack_value", "ENVELOPE_KEYS"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Keys of the envelope map: protocol version, message type, message body.
ENVELOPE_KEYS: frozenset[str] = frozenset({"v", "t", "b"})

#: Longest prefix of a peer-supplied string quoted in an error message, so logs stay readable.
_QUOTE_LIMIT: int = 100


def _reject_ext(code: int, data: bytes) -> object:
    raise MalformedMessage(f"msgpack extension type {code} is not part of the protocol")


def _check_max_bytes(max_bytes: int) -> None:
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(f"max_bytes must be a non-negative int, got {max_bytes!r}")


def _unpack(data: Any, max_bytes: int) -> Any:
    """Parse msgpack with every length limit derived from the (already bounded) input size."""
    try:
        size = memoryview(data).nbytes
    except TypeError:
        raise MalformedMessage(f"expected a bytes-like object, got {type(data).__name__}") from None
    if size > max_bytes:
        raise FrameTooLarge(f"message of {size} bytes exceeds max_bytes={max_bytes}")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            timestamp=0,
            ext_hook=_reject_ext,
            # No string/array/map can be longer than the input itself; a map needs two bytes per
            # entry. Explicit limits stop a tiny header claiming 2**32 items from preallocating.
            max_bin_len=size,
            max_str_len=size,
            max_array_len=size,
            max_map_len=size // 2,
            max_ext_len=0,
        )
    except ProtocolError:
        raise
    except msgpack.ExtraData:
        raise MalformedMessage("trailing bytes after the msgpack value") from None
    except Exception as error:  # msgpack raises ValueError, FormatError, StackError, UnicodeDecodeError...
        raise MalformedMessage(f"invalid msgpack ({type(error).__name__}: {error})") from None


def _options(max_bytes: int, require_finite: bool) -> DecodeOptions:
    _check_max_bytes(max_bytes)
    return DecodeOptions(max_bytes=max_bytes, require_finite=bool(require_finite))


def encode(msg: object) -> bytes:
    """Encode a registered message as a versioned msgpack envelope.

    The message is validated against its annotations first; an invalid one raises
    :class:`MalformedMessage` (unregistered classes raise :class:`UnknownMessageType`).
    Large byte fields (tensor data) are copied into the output exactly once.
    """
    return _write(msg).getvalue()


def encode_parts(msg: object) -> list[bytes]:
    """:func:`encode`'s output as consecutive parts whose concatenation is exactly ``encode(msg)``.

    Large byte fields (tensor data) are parts of their own, by reference, never copied: a sender can
    write a 32 MiB frame to a stream piece by piece without first building it in one piece.
    """
    out = _write(msg)
    return [*out.chunks, out.packer.bytes()]


def _write(msg: object) -> Writer:
    spec = message_spec(type(msg))
    out = Writer()
    packer = out.packer
    packer.pack_map_header(len(ENVELOPE_KEYS))
    packer.pack("v")
    packer.pack(PROTOCOL_VERSION)
    packer.pack("t")
    packer.pack(type(msg).TYPE)  # type: ignore[attr-defined]
    packer.pack("b")
    try:
        spec.pack(msg, out, spec.describe, 0)
    except ProtocolError:
        raise
    except Exception as error:  # a validate() hook tripping over a wrongly typed value, etc.
        raise MalformedMessage(f"cannot encode {spec.describe}: {type(error).__name__}: {error}") from error
    return out


def decode(
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    require_finite: bool = False,
    expect: type | tuple[type, ...] | None = None,
) -> Any:
    """Decode and validate one envelope produced by :func:`encode`.

    ``max_bytes`` caps the input (checked before parsing) and every tensor size it declares;
    ``require_finite`` rejects NaN/inf in tensors and float fields; ``expect`` (a class or a
    tuple of classes) rejects any other message type with :class:`UnknownMessageType` before
    its body is decoded. Only :class:`ProtocolError` subclasses escape, whatever ``data`` holds.
    (Invalid *arguments*, e.g. a negative ``max_bytes``, raise ``ValueError`` as usual.)
    """
    options = _options(max_bytes, require_finite)
    expected = None if expect is None else (expect if isinstance(expect, tuple) else (expect,))
    try:
        envelope = _unpack(data, options.max_bytes)
        if type(envelope) is not dict:
            raise MalformedMessage(f"envelope must be a map, got {type(envelope).__name__}")
        version = envelope.get("v")
        if type(version) is int and version != PROTOCOL_VERSION:
            raise UnsupportedVersion(f"protocol version {version} is not supported (this build speaks {PROTOCOL_VERSION})")
        if envelope.keys() != ENVELOPE_KEYS:
            shown = [repr(key)[:_QUOTE_LIMIT] for key in itertools.islice(envelope, len(ENVELOPE_KEYS) + 1)]
            raise MalformedMessage(f"envelope keys must be {sorted(ENVELOPE_KEYS)}, got {shown}")
        if type(version) is not int:
            raise MalformedMessage(f"envelope version must be an int, got {type(version).__name__}")
        type_name = envelope["t"]
        if type(type_name) is not str:
            raise MalformedMessage(f"envelope type must be a str, got {type(type_name).__name__}")
        cls = message_class(type_name)
        if expected is not None and cls not in expected:
            names = ", ".join(getattr(c, "TYPE", repr(c)) for c in expected)
            raise UnknownMessageType(f"got message type {type_name!r}, expected one of: {names}")
        spec = message_spec(cls)
        return spec.unpack(envelope["b"], options, spec.describe, 0)
    except ProtocolError:
        raise
    except Exception as error:  # RecursionError, a validate() hook's bug...: still the peer's bad bytes
        logger.debug("unexpected %s while decoding", type(error).__name__, exc_info=True)
        raise MalformedMessage(f"undecodable message ({type(error).__name__}: {str(error)[:_QUOTE_LIMIT]})") from None


def pack_value(value: object) -> bytes:
    """Encode one dataclass instance (registered or not) as a bare msgpack map, without envelope.

    Meant for payloads that travel inside another framing, e.g. a tensor streamed on its own.
    """
    spec = spec_for_dataclass(type(value))
    out = Writer()
    try:
        spec.pack(value, out, spec.describe, 0)
    except ProtocolError:
        raise
    except Exception as error:
        raise MalformedMessage(f"cannot encode {spec.describe}: {type(error).__name__}: {error}") from error
    return out.getvalue()


def unpack_value(
    cls: type[_T],
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    require_finite: bool = False,
) -> _T:
    """Decode bytes from :func:`pack_value` as an instance of ``cls``, with :func:`decode`'s guarantees."""
    spec = spec_for_dataclass(cls)
    options = _options(max_bytes, require_finite)
    try:
        return spec.unpack(_unpack(data, options.max_bytes), options, spec.describe, 0)
    except ProtocolError:
        raise
    except Exception as error:
        raise MalformedMessage(f"undecodable {spec.describe} ({type(error).__name__}: {str(error)[:_QUOTE_LIMIT]})") from None
