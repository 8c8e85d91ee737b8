"""Field specs: how each annotated type is validated, packed and unpacked.

Message classes are plain frozen dataclasses; this module turns their type annotations into a
tree of small ``Spec`` objects once, at registration time, so that encoding and decoding validate
every field generically instead of each message hand-writing its own checks. Supported
annotations: ``int``, ``float``, ``str``, ``bool``, ``bytes``, ``None``, unions (``X | None``),
``tuple[X, ...]``, fixed ``tuple[X, Y]``, ``dict[str, X]``, bare ``dict``/``tuple``, nested
dataclasses, and ``object``/``Any`` for any msgpack-plain value (None, bool, int, float, str,
bytes, lists and string-keyed maps of those).

A dataclass may define ``validate(self, options: DecodeOptions) -> None`` for checks that span
fields (e.g. a tensor's shape against its data); it runs after the field types are verified, on
both encode and decode, and must raise :class:`~protocol.errors.ProtocolError` subclasses.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

import msgpack

from .errors import MalformedMessage, NonFiniteTensor, ProtocolError
from .limits import LARGE_BYTES_THRESHOLD, MAX_NESTING_DEPTH
from .options import ENCODE_OPTIONS, DecodeOptions

__all__ = ["Spec", "Writer", "DataclassSpec", "spec_for_dataclass", "spec_for_annotation"]

#: msgpack integers span int64 (negative side) to uint64 (positive side).
MSGPACK_INT_MIN: int = -(2**63)
MSGPACK_INT_MAX: int = 2**64 - 1

#: msgpack bin 8/16/32 headers: type byte, then the length in 1, 2 or 4 big-endian bytes.
_BIN_HEADERS: tuple[tuple[int, int, int], ...] = ((2**8, 0xC4, 1), (2**16, 0xC5, 2), (2**32, 0xC6, 4))


def _type_name(value: object) -> str:
    return type(value).__name__


def _wrong_type(path: str, expected: str, value: object) -> MalformedMessage:
    return MalformedMessage(f"{path}: expected {expected}, got {_type_name(value)}")


#: Longest prefix of a peer-supplied map key quoted in an error path: keeps paths (built for every
#: nested value) short however long the keys a hostile peer sends.
_KEY_QUOTE_LIMIT: int = 32
#: Most unexpected/missing field names listed in one error message.
_NAMES_LISTED: int = 5


def _key_path(path: str, key: object) -> str:
    return f"{path}[{str(key)[:_KEY_QUOTE_LIMIT]!r}]"


def _check_depth(path: str, depth: int) -> None:
    if depth > MAX_NESTING_DEPTH:
        raise MalformedMessage(f"{path}: nested deeper than {MAX_NESTING_DEPTH} levels")


class Writer:
    """Accumulates msgpack output for one encode call.

    Small values go through one msgpack ``Packer``; byte strings of at least
    ``LARGE_BYTES_THRESHOLD`` are kept by reference and joined once at the end, so a 32 MiB
    tensor is copied exactly once into the output instead of twice through the packer's buffer.
    """

    __slots__ = ("packer", "chunks")

    def __init__(self) -> None:
        self.packer = msgpack.Packer(autoreset=False, use_bin_type=True, datetime=False)
        self.chunks: list[bytes] = []

    def bin(self, data: bytes) -> None:
        """Write ``data`` as a msgpack ``bin``, by reference when it is large."""
        size = len(data)
        if size < LARGE_BYTES_THRESHOLD:
            self.packer.pack(data)
            return
        for limit, type_byte, width in _BIN_HEADERS:
            if size < limit:
                header = bytes((type_byte,)) + size.to_bytes(width, "big")
                break
        else:
            raise MalformedMessage(f"byte string of {size} bytes exceeds msgpack's 4 GiB bin limit")
        self.chunks.append(self.packer.bytes())
        self.packer.reset()
        self.chunks.append(header)
        self.chunks.append(data)

    def getvalue(self) -> bytes:
        """Return everything written so far as one ``bytes`` object."""
        if not self.chunks:
            return self.packer.bytes()
        return b"".join([*self.chunks, self.packer.bytes()])


class Spec:
    """Validator and (de)serializer for one annotated type."""

    #: Human-readable name of the accepted type, used in error messages.
    describe: str = "?"

    def accepts(self, value: object) -> bool:
        """Cheap type test used to pick a union member when encoding."""
        raise NotImplementedError

    def pack(self, value: Any, out: Writer, path: str, depth: int) -> None:
        """Validate a Python value and append its msgpack encoding to ``out``."""
        raise NotImplementedError

    def unpack(self, value: Any, options: DecodeOptions, path: str, depth: int) -> Any:
        """Validate a value produced by msgpack and return the Python value for the field."""
        raise NotImplementedError


class IntSpec(Spec):
    """``int``: exact integers in msgpack's range; ``bool`` is rejected although it subclasses int."""

    describe = "int"

    def accepts(self, value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def pack(self, value: Any, out: Writer, path: str, depth: int) -> None:
        if not self.accepts(value):
            raise _wrong_type(path, self.describe, value)
        if not MSGPACK_INT_MIN <= value <= MSGPACK_INT_MAX:
            raise MalformedMessage(f"{path}: integer {value} outside msgpack's 64-bit range")
        out.packer.pack(int(value))

    def unpack(self, value: Any, options: DecodeOptions, path: str, depth: int) -> Any:
        if type(value) is not int:
            raise _wrong_type(path, self.describe, value)
        return value


class FloatSpec(Spec):
    """``float``: floats, or ints (not bools) widened to float as in Python's numeric tower."""

    describe = "float"

    def accepts(self, value: object) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    def pack(self, value: Any, out: Writer, path: str, depth: int) -> None:
        if not self.accepts(value):
            raise _wrong_type(path, self.describe, value)
        try:
            as_float = float(value)
        except OverflowError:
            raise MalformedMessage(f"{path}: integer too large for a float") from None
        out.packer.pack(as_float)

    def unpack(self, value: Any, options: DecodeOptions, path: str, depth: int) -> Any:
        kind = type(value)
        if kind is int:
            value = float(value)  # msgpack ints are at most 2**64, always representable
        elif kind is not float:
            raise _wrong_type(path, self.describe, value)
        if options.require_finite and not math.isfinite(value):
            raise NonFiniteTensor(f"{path}: non-finite float {value!r}")
        return value


class _ExactTypeSpec(Spec):
    """Scalar types that must match exactly: ``str``, ``bool``, ``bytes``."""

    def __init__(self, kind: type) -> None:
        self.kind = kind
        self.describe = kind.__name__

    def accepts(self, value: object) -> bool:
        return isinstance(value, self.kind)

    def pack(self, value: Any, out: Writer, path: str, depth: int) -> None:
        if not isinstance(value, self.kind):
            raise _wrong_type(path, self.describe, value)
        if self.kind is bytes:
            out.bin(value)
        elif self.kind is str:
            try:
                out.packer.pack(value)
            except UnicodeEncodeError:
                raise MalformedMessage(f"{path}: string is not encodable as UTF-8") from None
        else:
            out.packer.pack(value)

    def unpack(self, value: Any, options: DecodeOptions, path: str, depth: int) -> Any:
        if type(value) is not self.kind:
            raise _wrong_type(path, self.describe, value)
        return value


class NoneSpec(Spec):
    """``None``: only the nil value."""

    describe = "None"

    def accepts(self, value: object) -> bool:
        return value is None

    def pack(self, value: Any, out: Writer, path: str, depth: int) -> None:
        if value is not None:
            raise _wrong_type(path, self.describe, value)
        out.packer.pack(None)

    def unpack(self, value: Any, options: DecodeOptions, path: str, depth: int) -> Any:
        if value is not None:
            raise _wrong_type(path, self.describe, value)
        return None


class UnionSpec(Spec):
    """``X | Y``: the first member that accepts the value wins."""

    def __init__(self, members: tuple[Spec, ...]) -> None:
        self.members = members
        self.describe = " | ".join(member.describe for member in members)

    def accepts(self, value: object) -> bool:
        return any(member.accepts(value) for member in self.members)

    def pack(self, value: Any, out: Writer, path: str, depth: int) -> None:
        for member in self.members:
            if member.accepts(value):
                member.pack(value, out, path, depth)
                return
        raise _wrong_type(path, self.describe, value)

    def unpack(self, value: Any, options: DecodeOptions, path: str, depth: int) -> Any:
        errors: list[ProtocolError] = []
        for member in self.members:
            try:
                return member.unpack(value, options, path, depth)
            except ProtocolError as error:
                errors.append(error)
        for error in errors:
            if not isinstance(error, MalformedMessage):
                raise error  # the type matched but the value broke a rule, e.g. NonFiniteTensor
        raise _wrong_type(path, self.describe, value)


class TupleSpec(Spec):
    """``tuple[X, ...]``: a msgpack array decoded to a tuple; lists are refused when encoding."""

    def __init__(self, item: Spec) -> None:
        self.item = item
        self.describe = f"tuple[{item.describe}, ...]"

    def accepts(self, value: object) -> bool:
        return isinstance(value, tuple)

    def pack(self, value: Any, out: Writer, path: str, depth: int) -> None:
        if not isinstance(value, tuple):
            raise _wrong_type(path, self.describe, value)
        _check_depth(path, depth)
        out.packer.pack_array_header(len(value))
        for index, item in enumerate(value):
            self.item.pack(item, out, f"{path}[{index}]", depth + 1)

    def unpack(self, value: Any, options: DecodeOptions, path: str, depth: int) -> Any:
        if type(value) is not list:
            raise _wrong_type(path, self.describe, value)
        _check_depth(path, depth)
        item = self.item
        return tuple(item.unpack(v, options, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))


class FixedTupleSpec(Spec):
    """``tuple[X, Y]``: an array of exactly these item types."""

    def __init__(self, items: tuple[Spec, ...]) -> None:
        self.items = items
        self.describe = f"tuple[{', '.join(item.describe for item in items) or '()'}]"

    def accepts(self, value: object) -> bool:
        return isinstance(value, tuple)

    def pack(self, value: Any, out: Writer, path: str, depth: int) -> None:
        if not isinstance(value, tuple) or len(value) != len(self.items):
            raise _wrong_type(path, self.describe, value)
        _check_depth(path, depth)
        out.packer.pack_array_header(len(value))
        for index, (spec, item) in enumerate(zip(self.items, value)):
            spec.pack(item, out, f"{path}[{index}]", depth + 1)

    def unpack(self, value: Any, options: DecodeOptions, path: str, depth: int) -> Any:
        if type(value) is not list:
            raise _wrong_type(path, self.describe, value)
        if len(value) != len(self.items):
            raise MalformedMessage(f"{path}: expected {len(self.items)} items, got {len(value)}")
        _check_depth(path, depth)
        return tuple(
            spec.unpack(v, options, f"{path}[{i}]", depth + 1) for i, (spec, v) in enumerate(zip(self.items, value))
        )


class DictSpec(Spec):
    """``dict[str, X]``: a msgpack map with string keys."""

    def __init__(self, value: Spec) -> None:
        self.value = value
        self.describe = f"dict[str, {value.describe}]"

    def accepts(self, value: object) -> bool:
        return isinstance(value, dict)

    def pack(self, value: Any, out: Writer, path: str, depth: int) -> None:
        if not isinstance(value, dict):
            raise _wrong_type(path, self.describe, value)
        _check_depth(path, depth)
        out.packer.pack_map_header(len(value))
        for key, item in value.items():
            if not isinstance(key, str):
                raise MalformedMessage(f"{path}: map key {str(key)[:_KEY_QUOTE_LIMIT]!r} is not a str")
            _STR.pack(key, out, path, depth)
            self.value.pack(item, out, _key_path(path, key), depth + 1)

    def unpack(self, value: Any, options: DecodeOptions, path: str, depth: int) -> Any:
        if type(value) is not dict:
            raise _wrong_type(path, self.describe, value)
        _check_depth(path, depth)
        spec = self.value
        result = {}
        for key, item in value.items():
            if type(key) is not str:
                raise MalformedMessage(f"{path}: map key of type {_type_name(key)} is not a str")
            result[key] = spec.unpack(item, options, _key_path(path, key), depth + 1)
        return result


class AnySpec(Spec):
    """``object``/``Any``: any msgpack-plain value (JSON-like, plus bytes).

    Tuples are accepted when encoding and come back as lists, like JSON arrays.
    """

    describe = "plain value"

    def accepts(self, value: object) -> bool:
        return True

    def pack(self, value: Any, out: Writer, path: str, depth: int) -> None:
        self._check_encodable(value, path, depth)
        try:
            out.packer.pack(value)
        except UnicodeEncodeError:
            raise MalformedMessage(f"{path}: string is not encodable as UTF-8") from None

    def _check_encodable(self, value: Any, path: str, depth: int) -> None:
        if value is None or isinstance(value, (bool, float, str, bytes)):
            return
        if isinstance(value, int):
            if not MSGPACK_INT_MIN <= value <= MSGPACK_INT_MAX:
                raise MalformedMessage(f"{path}: integer {value} outside msgpack's 64-bit range")
            return
        _check_depth(path, depth)
        if isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                self._check_encodable(item, f"{path}[{index}]", depth + 1)
        elif isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise MalformedMessage(f"{path}: map key {str(key)[:_KEY_QUOTE_LIMIT]!r} is not a str")
                self._check_encodable(item, _key_path(path, key), depth + 1)
        else:
            raise _wrong_type(path, self.describe, value)

    def unpack(self, value: Any, options: DecodeOptions, path: str, depth: int) -> Any:
        kind = type(value)
        if value is None or kind in (bool, int, str, bytes):
            return value
        if kind is float:
            if options.require_finite and not math.isfinite(value):
                raise NonFiniteTensor(f"{path}: non-finite float {value!r}")
            return value
        _check_depth(path, depth)
        if kind is list:
            for index, item in enumerate(value):
                self.unpack(item, options, f"{path}[{index}]", depth + 1)
        elif kind is dict:
            for key, item in value.items():
                if type(key) is not str:
                    raise MalformedMessage(f"{path}: map key of type {_type_name(key)} is not a str")
                self.unpack(item, options, _key_path(path, key), depth + 1)
        else:
            raise _wrong_type(path, self.describe, value)
        return value


class DataclassSpec(Spec):
    """A nested dataclass: a msgpack map from field name to value, with exactly its fields.

    Fields that have a default may be omitted on the wire (they take the default), so a field
    added later with a default stays readable from older senders.
    """

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.describe = cls.__name__
        self.fields: tuple[tuple[str, Spec], ...] = ()
        self.names: frozenset[str] = frozenset()
        self.required: frozenset[str] = frozenset()
        self.validate_hook = getattr(cls, "validate", None)

    def accepts(self, value: object) -> bool:
        return type(value) is self.cls

    def pack(self, value: Any, out: Writer, path: str, depth: int) -> None:
        if type(value) is not self.cls:
            raise _wrong_type(path, self.describe, value)
        _check_depth(path, depth)
        packer = out.packer
        packer.pack_map_header(len(self.fields))
        for name, spec in self.fields:
            packer.pack(name)
            spec.pack(getattr(value, name), out, f"{path}.{name}", depth + 1)
        if self.validate_hook is not None:
            value.validate(ENCODE_OPTIONS)

    def unpack(self, value: Any, options: DecodeOptions, path: str, depth: int) -> Any:
        if type(value) is not dict:
            raise _wrong_type(path, f"map for {self.describe}", value)
        _check_depth(path, depth)
        keys = value.keys()
        if keys - self.names or self.required - keys:
            extra = sorted(str(key)[:_KEY_QUOTE_LIMIT] for key in keys - self.names)[:_NAMES_LISTED]
            missing = sorted(self.required - keys)[:_NAMES_LISTED]
            problems = [f"unexpected field(s) {extra}"] if extra else []
            problems += [f"missing field(s) {missing}"] if missing else []
            raise MalformedMessage(f"{path} ({self.describe}): {'; '.join(problems)}")
        kwargs = {
            name: spec.unpack(value[name], options, f"{path}.{name}", depth + 1)
            for name, spec in self.fields
            if name in value
        }
        result = self.cls(**kwargs)
        if self.validate_hook is not None:
            result.validate(options)
        return result


_STR = _ExactTypeSpec(str)
_SCALARS: dict[object, Spec] = {
    int: IntSpec(),
    float: FloatSpec(),
    str: _STR,
    bool: _ExactTypeSpec(bool),
    bytes: _ExactTypeSpec(bytes),
    None: NoneSpec(),
    type(None): NoneSpec(),
    object: AnySpec(),
    Any: AnySpec(),
}
_DATACLASS_SPECS: dict[type, DataclassSpec] = {}


def spec_for_annotation(annotation: object, owner: str) -> Spec:
    """Build the spec of one (resolved) annotation; ``TypeError`` names unsupported ones."""
    try:
        scalar = _SCALARS.get(annotation)  # type: ignore[call-overload]
    except TypeError:  # unhashable annotation objects
        scalar = None
    if scalar is not None:
        return scalar
    if annotation is dict:
        return DictSpec(_SCALARS[object])
    if annotation is tuple:
        return TupleSpec(_SCALARS[object])
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return UnionSpec(tuple(spec_for_annotation(arg, owner) for arg in args))
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return TupleSpec(spec_for_annotation(args[0], owner))
        if args == ((),):
            return FixedTupleSpec(())
        return FixedTupleSpec(tuple(spec_for_annotation(arg, owner) for arg in args))
    if origin is dict:
        if args[0] is not str:
            raise TypeError(f"{owner}: dict keys must be str, got {args[0]!r}")
        return DictSpec(spec_for_annotation(args[1], owner))
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return spec_for_dataclass(annotation)
    raise TypeError(f"{owner}: unsupported field annotation {annotation!r}")


def spec_for_dataclass(cls: type) -> DataclassSpec:
    """Return the (cached) spec of a dataclass, resolving its annotations on first use."""
    cached = _DATACLASS_SPECS.get(cls)
    if cached is not None:
        return cached
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"{cls!r} is not a dataclass")
    spec = DataclassSpec(cls)
    _DATACLASS_SPECS[cls] = spec  # before resolving fields, so self-referencing types terminate
    try:
        hints = typing.get_type_hints(cls)
        fields = []
        required = set()
        for field in dataclasses.fields(cls):
            if not field.init:
                raise TypeError(f"{cls.__name__}.{field.name}: init=False fields cannot travel on the wire")
            fields.append((field.name, spec_for_annotation(hints[field.name], f"{cls.__name__}.{field.name}")))
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                required.add(field.name)
    except BaseException:
        del _DATACLASS_SPECS[cls]
        raise
    spec.fields = tuple(fields)
    spec.names = frozenset(name for name, _ in fields)
    spec.required = frozenset(required)
    return spec
