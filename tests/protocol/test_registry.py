"""Other packages can register their own message types; the generic codec handles their annotations."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import PROTOCOL_VERSION, decode, encode, register_message
from protocol.errors import MalformedMessage
from protocol.registry import message_class, registered_messages
from protocol.tensor import TensorFrame


@dataclass(frozen=True)
class Inner:
    name: str
    weights: dict[str, float]


@register_message
@dataclass(frozen=True)
class Custom:
    """A message using every supported annotation form."""

    TYPE: ClassVar[str] = "tests.custom"

    pair: tuple[int, str]
    inners: tuple[Inner, ...]
    by_name: dict[str, Inner]
    either: int | str
    maybe: Optional[bytes]
    anything: Any
    frames: tuple[TensorFrame, ...]
    flag: bool = False
    tags: tuple[str, ...] = field(default_factory=tuple)


@register_message
@dataclass(frozen=True)
class Tree:
    """A self-referencing type: nesting depth is bounded by the decoder, not by the schema."""

    TYPE: ClassVar[str] = "tests.tree"

    children: tuple[Tree, ...]


inners = st.builds(Inner, name=st.text(max_size=5), weights=st.dictionaries(st.text(max_size=3), st.floats(allow_nan=False), max_size=3))
customs = st.builds(
    Custom,
    pair=st.tuples(st.integers(-5, 5), st.text(max_size=3)),
    inners=st.lists(inners, max_size=3).map(tuple),
    by_name=st.dictionaries(st.text(max_size=3), inners, max_size=3),
    either=st.integers(-(2**63), 2**64 - 1) | st.text(max_size=4),
    maybe=st.none() | st.binary(max_size=4),
    anything=st.none() | st.integers(0, 9) | st.lists(st.text(max_size=2), max_size=2),
    frames=st.lists(st.just(TensorFrame("int32", (1,), b"\x01\x00\x00\x00")), max_size=2).map(tuple),
    flag=st.booleans(),
    tags=st.lists(st.text(max_size=3), max_size=3).map(tuple),
)


@settings(max_examples=60, deadline=None)
@given(msg=customs)
def test_custom_message_roundtrip(msg):
    assert message_class("tests.custom") is Custom
    assert decode(encode(msg), expect=Custom) == msg


def test_defaults_may_be_omitted_on_the_wire():
    msg = Custom((1, "a"), (), {}, 1, None, None, (), flag=True, tags=("x",))
    envelope = msgpack.unpackb(encode(msg), raw=False)
    del envelope["b"]["flag"], envelope["b"]["tags"]
    back = decode(msgpack.packb(envelope))
    assert back.flag is False and back.tags == ()


def test_union_and_fixed_tuple_rejections():
    msg = Custom((1, "a"), (), {}, 1, None, None, ())
    envelope = msgpack.unpackb(encode(msg), raw=False)
    for key, value in [("either", 1.5), ("either", None), ("pair", [1]), ("pair", [1, 2]), ("maybe", "s")]:
        bad = {**envelope, "b": {**envelope["b"], key: value}}
        with pytest.raises(MalformedMessage, match=key):
            decode(msgpack.packb(bad))


def test_recursive_type_depth_is_bounded():
    tree = Tree(())
    for _ in range(5):
        tree = Tree((tree, Tree(())))
    assert decode(encode(tree)) == tree
    body: dict = {"children": []}
    for _ in range(200):
        body = {"children": [body]}
    with pytest.raises(MalformedMessage, match="nested"):
        decode(msgpack.packb({"v": PROTOCOL_VERSION, "t": "tests.tree", "b": body}))


def test_registration_errors():
    with pytest.raises(ValueError, match="already registered"):

        @register_message
        @dataclass(frozen=True)
        class Clash:
            TYPE: ClassVar[str] = "activation"

    with pytest.raises(TypeError, match="frozen"):

        @register_message
        @dataclass
        class Mutable:
            TYPE: ClassVar[str] = "tests.mutable"

    with pytest.raises(TypeError, match="TYPE"):

        @register_message
        @dataclass(frozen=True)
        class NoType:
            x: int

    with pytest.raises(TypeError, match="unsupported"):

        @register_message
        @dataclass(frozen=True)
        class ListField:
            TYPE: ClassVar[str] = "tests.list_field"
            xs: list[int]

    with pytest.raises(TypeError, match="dict keys"):

        @register_message
        @dataclass(frozen=True)
        class IntKeys:
            TYPE: ClassVar[str] = "tests.int_keys"
            xs: dict[int, int]

    with pytest.raises(TypeError, match="dataclass"):
        register_message(int)
    for name in ("tests.mutable", "tests.list_field", "tests.int_keys"):
        assert name not in registered_messages()


def test_registering_the_same_class_twice_is_harmless():
    assert register_message(Custom) is Custom
    assert registered_messages()["tests.custom"] is Custom
