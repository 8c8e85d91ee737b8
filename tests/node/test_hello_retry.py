"""A joiner asks its initial peer ``hello`` again when a stream closes unanswered, and never on a refusal.

Two real p2pd daemons on 127.0.0.1: the "initial peer" serves the node RPC protocol with a handler
that closes the first N streams without a reply (what a founder busy beside five starting daemons did
in CI), then answers like a node. The joiner runs the real :func:`node.swarm.handshake.handshake`.
"""

from __future__ import annotations

import asyncio

import pytest

import node.compat  # noqa: F401  (before hivemind)
from hivemind.p2p import P2P

from node.errors import UserError
from node.net.access import SwarmAccess
from node.net.rpc import RPC_PROTOCOL, _read_frame, _write_frame  # the RPC's own framing
from node.swarm.config import DaemonConfig
from node.swarm.coordinator import RunConfig
from node.swarm.handshake import handshake
from protocol.messages import RpcRequest, RpcResponse, decode, encode

pytestmark = pytest.mark.timeout(120)

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
RUN_ID = "hello-retry"
VERSION = 7


def _reply(result=None, error=None) -> bytes:
    return encode(RpcResponse(ok=error is None, result=result, error=error))


async def _serve(server: P2P, answers: list) -> list[str]:
    """Serve RPC streams: each stream takes the next entry of ``answers`` (None: close unanswered,
    bytes: send them as the reply frame); the last entry repeats. Returns the methods asked, in order."""
    asked: list[str] = []

    async def handle(_info, reader, writer):
        try:
            request = decode(await _read_frame(reader), expect=RpcRequest)
            asked.append(request.method)
            answer = answers[min(len(asked) - 1, len(answers) - 1)]
            if answer is not None:
                await _write_frame(writer, answer)
        finally:
            writer.close()

    await server.add_binary_stream_handler(RPC_PROTOCOL, handle)
    return asked


def _run(answers: list, rounds: int = 3):
    async def main():
        server = await P2P.create(host_maddrs=LOCAL)
        maddr = str((await server.get_visible_maddrs())[0])
        client = await P2P.create(host_maddrs=LOCAL, initial_peers=[maddr])
        try:
            asked = await _serve(server, answers)
            cfg = DaemonConfig(run_id=RUN_ID, initial_peers=(maddr,), hello_timeout_s=10.0)
            try:
                reply = await handshake(client, cfg, SwarmAccess(), client.peer_id.to_base58(), VERSION,
                                        [server.peer_id], rounds=rounds, round_pause_s=0.1)
            except UserError as e:
                return e, asked
            return reply, asked
        finally:
            await client.shutdown()
            await server.shutdown()

    return asyncio.run(main())


GOOD = _reply({"run_id": RUN_ID, "protocol_version": VERSION, "peer_id": "QmFounder",
               "run": RunConfig(4, 3, 2).to_json(), "training": None})


def test_a_hello_closed_unanswered_is_asked_again():
    reply, asked = _run([None, None, GOOD], rounds=3)
    assert asked == ["hello"] * 3
    assert reply.run.num_stages == 4 and reply.run.path_length == 3 and reply.peer_id == "QmFounder"


def test_a_peer_that_never_answers_ends_in_one_error_line_after_every_round():
    error, asked = _run([None], rounds=3)
    assert isinstance(error, UserError) and len(asked) == 3
    assert str(error).startswith("no initial peer answered the handshake: ") and "\n" not in str(error)


def test_a_reply_without_a_run_is_asked_again_not_a_traceback():
    no_run = _reply({"run_id": RUN_ID, "protocol_version": VERSION, "run": None})
    garbage_run = _reply({"run_id": RUN_ID, "protocol_version": VERSION, "run": {"num_stages": "x"}})
    reply, asked = _run([no_run, garbage_run, GOOD], rounds=3)
    assert len(asked) == 3 and reply.run.num_stages == 4
    error, _ = _run([garbage_run], rounds=2)
    assert isinstance(error, UserError) and "unreadable run configuration" in str(error)


@pytest.mark.parametrize("answer, words", [
    (_reply(error="access denied: not on the allow list"), "refused this node: not on the allow list"),
    (_reply({"run_id": "other", "protocol_version": VERSION, "run": RunConfig(2, 2, 1).to_json()}), "wrong run id"),
    (_reply({"run_id": RUN_ID, "protocol_version": VERSION + 1, "run": None}), "incompatible protocol version"),
])
def test_a_refusal_is_an_answer_and_is_not_retried(answer, words):
    error, asked = _run([answer], rounds=3)
    assert isinstance(error, UserError) and words in str(error)
    assert asked == ["hello"]
