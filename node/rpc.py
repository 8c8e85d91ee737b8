"""Node RPC: one method table served over libp2p (hivemind P2P) and local HTTP JSON.

* libp2p: a binary stream handler :data:`RPC_PROTOCOL`; one request per stream, framed like
  hivemind's raw data (8-byte big-endian length + ``encode(RpcRequest)``), answered with
  ``encode(RpcResponse)``. This is how ``skippipe swarm status --peer MADDR`` and the join
  handshake reach a remote node.
* HTTP: ``asyncio.start_server`` on 127.0.0.1 speaking just enough HTTP/1.1: ``GET /<method>``
  (query string = params) or ``POST /rpc`` with ``{"method": ..., "params": {...}}``. The reply
  body is always ``{"ok": bool, "result": ..., "error": str | null}``. No extra dependency and
  loopback-only, because it is an operator's tool, not a public API.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Awaitable, Callable

from protocol.errors import ProtocolError
from protocol.messages import RpcRequest, RpcResponse, decode, encode

__all__ = [
    "RPC_PROTOCOL",
    "RpcMethod",
    "RpcServer",
    "RpcCallError",
    "call_p2p",
    "call_http",
]

logger = logging.getLogger(__name__)

#: libp2p protocol id of the node RPC.
RPC_PROTOCOL = "skippipe/rpc/1"
#: Largest RPC request/response accepted over libp2p or HTTP.
MAX_RPC_BYTES = 8 * 2**20
#: Seconds a client waits for an answer by default.
DEFAULT_RPC_TIMEOUT_S = 10.0
_HEADER_LEN = 8

RpcMethod = Callable[[dict], Awaitable[Any]]


class RpcCallError(Exception):
    """The remote node answered with an error, or could not be reached."""


class RpcServer:
    """Holds the method table and serves it on P2P and HTTP."""

    def __init__(self) -> None:
        self.methods: dict[str, RpcMethod] = {}
        self._http: asyncio.base_events.Server | None = None
        self.http_port: int | None = None

    def register(self, name: str, method: RpcMethod) -> None:
        """Add (or replace) a method; ``method(params) -> JSON/msgpack-able result``."""
        self.methods[name] = method

    async def dispatch(self, method: str, params: dict | None) -> RpcResponse:
        fn = self.methods.get(method)
        if fn is None:
            return RpcResponse(ok=False, result=None, error=f"unknown method {method!r}")
        try:
            return RpcResponse(ok=True, result=await fn(dict(params or {})), error=None)
        except Exception as e:  # noqa: BLE001 - reported to the caller, not raised here
            logger.debug("rpc %s failed", method, exc_info=True)
            return RpcResponse(ok=False, result=None, error=f"{type(e).__name__}: {e}")

    # ------------------------------------------------------------------ libp2p
    async def attach_p2p(self, p2p) -> None:
        await p2p.add_binary_stream_handler(RPC_PROTOCOL, self._handle_stream)

    async def _handle_stream(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            data = await _read_frame(reader)
            try:
                request = decode(data, expect=RpcRequest)
                response = await self.dispatch(request.method, request.params)
            except ProtocolError as e:
                response = RpcResponse(ok=False, result=None, error=f"bad request: {e}")
            await _write_frame(writer, encode(response))
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as e:
            logger.debug("rpc stream failed: %r", e)
        finally:
            writer.close()

    # ------------------------------------------------------------------ HTTP
    async def start_http(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0 = ephemeral); returns the bound port. OSError if taken."""
        self._http = await asyncio.start_server(self._handle_http, host, port)
        self.http_port = self._http.sockets[0].getsockname()[1]
        return self.http_port

    async def stop(self) -> None:
        if self._http is not None:
            self._http.close()
            try:
                await asyncio.wait_for(self._http.wait_closed(), timeout=2.0)
            except asyncio.TimeoutError:
                pass
            self._http = None

    async def _handle_http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        status = 200
        try:
            request_line = (await reader.readline()).decode("latin-1").strip()
            parts = request_line.split()
            if len(parts) < 2:
                raise ValueError("bad request line")
            verb, target = parts[0].upper(), parts[1]
            headers = {}
            while True:
                line = (await reader.readline()).decode("latin-1")
                if line in ("\r\n", "\n", ""):
                    break
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            url = urllib.parse.urlsplit(target)
            if verb == "GET":
                method = url.path.strip("/")
                params = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query).items()}
            elif verb == "POST":
                length = int(headers.get("content-length", "0"))
                if length > MAX_RPC_BYTES:
                    raise ValueError("request too large")
                body = json.loads((await reader.readexactly(length)).decode() or "{}")
                method = body.get("method") if url.path.strip("/") == "rpc" else url.path.strip("/")
                params = body.get("params") or {}
                if not isinstance(method, str) or not isinstance(params, dict):
                    raise ValueError("body must be {'method': str, 'params': {...}}")
            else:
                raise ValueError(f"unsupported verb {verb}")
            response = await self.dispatch(method, params)
            if not response.ok and response.error and response.error.startswith("unknown method"):
                status = 404
            payload = {"ok": response.ok, "result": response.result, "error": response.error}
        except (ValueError, json.JSONDecodeError, asyncio.IncompleteReadError) as e:
            status, payload = 400, {"ok": False, "result": None, "error": f"bad request: {e}"}
        try:
            body = json.dumps(payload, default=_json_default).encode()
            reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}[status]
            writer.write(
                f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
            )
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (bytes, bytearray)):
        return obj.hex()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return str(obj)


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    header = await reader.readexactly(_HEADER_LEN)
    length = int.from_bytes(header, "big")
    if length > MAX_RPC_BYTES:
        raise ValueError(f"rpc frame of {length} bytes exceeds {MAX_RPC_BYTES}")
    return await reader.readexactly(length)


async def _write_frame(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(len(data).to_bytes(_HEADER_LEN, "big") + data)
    await writer.drain()


async def call_p2p(
    p2p, peer_id, method: str, params: dict | None = None, timeout: float = DEFAULT_RPC_TIMEOUT_S
) -> Any:
    """Call ``method`` on a remote node over libp2p; raises :class:`RpcCallError`."""

    async def _call() -> RpcResponse:
        _, reader, writer = await p2p.call_binary_stream_handler(peer_id, RPC_PROTOCOL)
        try:
            await _write_frame(writer, encode(RpcRequest(method=method, params=dict(params or {}))))
            return decode(await _read_frame(reader), expect=RpcResponse)
        finally:
            writer.close()

    try:
        response = await asyncio.wait_for(_call(), timeout)
    except asyncio.TimeoutError:
        raise RpcCallError(f"no answer from {peer_id} within {timeout:.0f} s") from None
    except (ProtocolError, ValueError, asyncio.IncompleteReadError) as e:
        raise RpcCallError(f"bad answer from {peer_id}: {e}") from None
    except Exception as e:  # noqa: BLE001 - p2pd control errors (peer unreachable, no handler)
        raise RpcCallError(f"cannot reach {peer_id}: {e}") from None
    if not response.ok:
        raise RpcCallError(response.error or "remote error")
    return response.result


def call_http(url: str, method: str, params: dict | None = None, timeout: float = DEFAULT_RPC_TIMEOUT_S) -> Any:
    """Blocking HTTP JSON call (for the CLI); raises :class:`RpcCallError`."""
    body = json.dumps({"method": method, "params": params or {}}).encode()
    request = urllib.request.Request(
        url.rstrip("/") + "/rpc", data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            payload = json.loads(resp.read().decode())
    except urllib.error.HTTPError as e:
        try:
            payload = json.loads(e.read().decode())
        except Exception:  # noqa: BLE001
            raise RpcCallError(f"{url}: HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise RpcCallError(f"cannot reach {url}: {reason}") from None
    if not payload.get("ok"):
        raise RpcCallError(payload.get("error") or "remote error")
    return payload.get("result")
