"""The local HTTP RPC refuses deeply nested and oversized JSON with a 400 and one line (no 500, no traceback)."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.request

import pytest

from node.net.rpc import MAX_HTTP_BODY_BYTES, MAX_JSON_DEPTH, RpcServer, load_json_bounded


def _post(port: int, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/rpc", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
async def server():
    rpc = RpcServer()

    async def echo(params):
        return params

    rpc.register("echo", echo)
    port = await rpc.start_http("127.0.0.1", 0)
    yield rpc, port
    await rpc.stop()


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 5000, 200_000])
async def test_deeply_nested_json_is_a_400(server, depth, caplog):
    rpc, port = server
    body = b'{"method": "echo", "params": {"x": ' + b"[" * depth + b"]" * depth + b"}}"
    with caplog.at_level(logging.WARNING):
        status, payload = await asyncio.to_thread(_post, port, body)
    assert status == 400, payload
    assert payload["ok"] is False and "nested deeper" in payload["error"] and "\n" not in payload["error"]
    assert not any(r.exc_info for r in caplog.records)  # no traceback in the log either


async def test_oversized_body_is_a_400(server):
    rpc, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST /rpc HTTP/1.1\r\nContent-Length: {MAX_HTTP_BODY_BYTES + 1}\r\n\r\n".encode() + b"{" * 1000)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 30)  # answered without waiting for the 1 MiB body
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400")
    assert "content-length" in json.loads(body)["error"]


async def test_reasonable_json_still_works(server):
    rpc, port = server
    nested = {"a": [[{"b": 1}]]}
    status, payload = await asyncio.to_thread(_post, port, json.dumps({"method": "echo", "params": nested}).encode())
    assert status == 200 and payload["result"] == nested


def test_depth_check_counts_containers_only():
    assert load_json_bounded("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH) is not None
    with pytest.raises(ValueError):
        load_json_bounded("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1))
    assert load_json_bounded('{"a": "' + "[" * 1000 + '"}')["a"].startswith("[")  # brackets inside strings
