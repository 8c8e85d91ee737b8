"""The registry of message types, keyed by the ``TYPE`` string carried in every envelope.

Message classes live wherever they are needed (this package defines the core ones in
:mod:`protocol.messages`; other packages may add their own in their own modules) and make
themselves decodable by decorating the class with :func:`register_message`.
"""

from __future__ import annotations

import dataclasses
import logging
import types
from typing import TypeVar

from .errors import UnknownMessageType
from .schema import DataclassSpec, spec_for_dataclass

__all__ = ["register_message", "message_class", "message_spec", "registered_messages"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T", bound=type)

_BY_TYPE: dict[str, type] = {}
_SPECS: dict[type, DataclassSpec] = {}


def register_message(cls: _T) -> _T:
    """Class decorator: make a frozen dataclass with a ``TYPE: ClassVar[str]`` a wire message.

    Its field annotations are resolved now, so an unsupported annotation fails at import time
    with ``TypeError`` rather than at the first send (annotations naming classes that do not
    exist yet, such as the class itself, are resolved on first use instead). Registering a second class under a ``TYPE``
    that is already taken raises ``ValueError`` (two meanings for one name would corrupt peers).
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"@register_message needs a dataclass, got {cls!r}")
    if not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"{cls.__name__} must be a frozen dataclass: messages are immutable values")
    type_name = cls.__dict__.get("TYPE")
    if not isinstance(type_name, str) or not type_name:
        raise TypeError(f"{cls.__name__} needs a class attribute TYPE: ClassVar[str] (non-empty)")
    existing = _BY_TYPE.get(type_name)
    if existing is not None and existing is not cls:
        raise ValueError(
            f"message type {type_name!r} is already registered by {existing.__module__}.{existing.__qualname__}"
        )
    try:
        _SPECS[cls] = spec_for_dataclass(cls)
    except NameError:
        logger.debug("%s has forward references; resolving its fields on first use", cls.__qualname__)
    _BY_TYPE[type_name] = cls
    logger.debug("registered message type %r -> %s.%s", type_name, cls.__module__, cls.__qualname__)
    return cls


def message_class(type_name: str) -> type:
    """Return the class registered under ``type_name``; raise :class:`UnknownMessageType` if none."""
    cls = _BY_TYPE.get(type_name)
    if cls is None:
        raise UnknownMessageType(f"unknown message type {type_name[:100]!r}")
    return cls


def message_spec(cls: type) -> DataclassSpec:
    """Return the spec of a registered message class; raise :class:`UnknownMessageType` if not registered."""
    spec = _SPECS.get(cls)
    if spec is None:
        type_name = getattr(cls, "TYPE", None)
        if not isinstance(type_name, str) or _BY_TYPE.get(type_name) is not cls:
            raise UnknownMessageType(f"{getattr(cls, '__qualname__', cls)!r} is not a registered message class")
        spec = _SPECS[cls] = spec_for_dataclass(cls)
    return spec


def registered_messages() -> types.MappingProxyType[str, type]:
    """A read-only view of ``TYPE -> class`` for every registered message."""
    return types.MappingProxyType(_BY_TYPE)
