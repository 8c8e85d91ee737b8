"""The guard every peer-facing stream handler runs its body in (ping, dial-back): whatever a peer sends, the
handler returns, counts a broken limit as a refusal, and closes the stream. Pure units over in-memory
streams (the real handlers on a real p2pd: tests/node/test_handler_limits.py)."""

import asyncio
from types import SimpleNamespace

import msgpack
import pytest

from node.net.framing import FrameTooLarge, peer_stream_guard, read_frame, stream_caller
from node.net.ping import PingHandler
from node.net.reachability import MAX_DIALBACK_FRAME_BYTES, DialbackHandler


class _Writer:
    def __init__(self):
        self.data, self.closed = bytearray(), False

    def write(self, b):
        self.data += b

    async def drain(self):
        pass

    def close(self):
        self.closed = True


def _reader(payload: bytes, eof: bool = True) -> asyncio.StreamReader:
    r = asyncio.StreamReader()
    r.feed_data(payload)
    if eof:
        r.feed_eof()
    return r


def _frame(body: bytes, claimed: int | None = None) -> bytes:
    return (len(body) if claimed is None else claimed).to_bytes(8, "big") + body


INFO = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "12D3KooWpeer"), addrs=[])


def test_the_caller_of_a_stream_without_a_peer_is_a_question_mark():
    assert stream_caller(INFO) == "12D3KooWpeer" and stream_caller(object()) == "?"


async def test_refusals_count_hangups_do_not_and_the_stream_is_closed():
    refused = []
    for exc, counted in ((FrameTooLarge(10, 1), 1), (asyncio.TimeoutError(), 1), (asyncio.IncompleteReadError(b"", 8), 0),
                         (ConnectionResetError(), 0), (RuntimeError("bug"), 0)):
        w = _Writer()
        before = len(refused)
        async with peer_stream_guard("test", "peer", w, lambda: refused.append(1)):
            raise exc
        assert w.closed and len(refused) - before == counted, exc


async def test_cancellation_goes_through_the_guard():
    w = _Writer()
    with pytest.raises(asyncio.CancelledError):
        async with peer_stream_guard("test", "peer", w, lambda: None):
            raise asyncio.CancelledError()
    assert w.closed


async def test_ping_echoes_and_refuses_a_huge_frame_or_a_stranger():
    h, w = PingHandler(), _Writer()
    await h(INFO, _reader(_frame(b"hi")), w)
    assert await read_frame(_reader(bytes(w.data)), 64, 1) == b"hi" and w.closed and h.refused == 0
    await h(INFO, _reader(_frame(b"x", claimed=2 << 30)), _Writer())
    assert h.refused == 1
    await PingHandler(allow=lambda peer: False)(INFO, _reader(_frame(b"hi")), w2 := _Writer())
    assert w2.closed and not w2.data


@pytest.mark.parametrize("request_bytes", [
    _frame(b"x", claimed=MAX_DIALBACK_FRAME_BYTES + 1),  # too large
    _frame(b"\xc1"),  # not msgpack
    _frame(msgpack.packb({"ports": ["80"]})),  # not a port list
])
async def test_a_bad_dialback_request_is_refused_without_an_answer(request_bytes):
    h, w = DialbackHandler(), _Writer()
    await h(INFO, _reader(request_bytes), w)
    assert h.refused == 1 and h.answered == 0 and w.closed and not w.data


async def test_a_dialback_request_cut_short_is_no_refusal():
    h, w = DialbackHandler(), _Writer()
    await h(INFO, _reader(b"\x00\x00"), w)
    assert h.refused == 0 and h.answered == 0 and w.closed
