"""Node RPC: one method table served over libp2p (hivemind P2P) and local HTTP JSON.

* libp2p: a binary stream handler :data:`RPC_PROTOCOL`; one request per stream, framed like
  hivemind's raw data (8-byte big-endian length + ``encode(RpcRequest)``), answered with
  ``encode(RpcResponse)``. This is how ``skippipe swarm status --peer MADDR`` and the join
  handshake reach a remote node.
* HTTP: ``asyncio.start_server`` on 127.0.0.1 speaking just enough HTTP/1.1: ``GET /<method>``
  (query string = params) or ``POST /rpc`` with ``{"method": ..., "params": {...}}``. The reply
  body is always ``{"ok": bool, "result": ..., "error": str | null}``. No extra dependency and
  loopback-only, because it is an operator's tool, not a public API. Raw routes
  (:meth:`RpcServer.register_http_route`: ``/metrics``, the dashboard) answer with their own
  content type.

Hostile input: every request first takes a token from its peer's bucket (libp2p peer id, or the
HTTP client address; :mod:`node.net.ratelimit`) and is answered "rate limited" without running a
handler when there is none; malformed requests are answered with an error and logged
(throttled, so a garbage flood cannot flood the log either); reads have a deadline so a client
that sends half a request cannot hold a handler forever. Nothing a client sends reaches the
daemon as an exception. Over libp2p the caller's peer id is passed to methods as the reserved
parameter :data:`CALLER_PARAM` (a client-supplied value is overwritten).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from node.net.ratelimit import PeerRateLimiter
from protocol.errors import ProtocolError
from protocol.messages import RpcRequest, RpcResponse, decode, encode

__all__ = [
    "RPC_PROTOCOL",
    "RpcMethod",
    "HttpReply",
    "HttpRoute",
    "CALLER_PARAM",
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
#: Largest HTTP request body (JSON) accepted on the local endpoint.
MAX_HTTP_BODY_BYTES = 1 << 20
#: Deepest nesting of arrays/objects accepted in an HTTP JSON body (deeper: 400, not a RecursionError).
MAX_JSON_DEPTH = 32
#: Methods that answer a libp2p caller that is not (yet) a member when access control is on.
PUBLIC_P2P_METHODS = frozenset({"hello"})
#: Seconds a client waits for an answer by default.
DEFAULT_RPC_TIMEOUT_S = 10.0
#: Seconds a client may take to send one whole request (slow or stalled clients are cut off).
REQUEST_READ_TIMEOUT_S = 10.0
#: Most header lines accepted in one HTTP request.
MAX_HTTP_HEADERS = 64
#: One log line per source and kind of bad input at most this often.
BAD_INPUT_LOG_EVERY_S = 10.0
#: After answering early (rate limited, malformed), read at most this much of what the client
#: still sends for at most this long: closing with unread input makes the kernel send a reset,
#: and the client would never see our answer.
DRAIN_MAX_BYTES = 256 * 1024
DRAIN_TIMEOUT_S = 0.5
#: Reserved parameter carrying the libp2p caller's peer id (base58) into a method.
CALLER_PARAM = "_caller"
_HEADER_LEN = 8
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests", 500: "Internal Server Error"}

RpcMethod = Callable[[dict], Awaitable[Any]]


@dataclass(frozen=True)
class HttpReply:
    """A raw HTTP answer (not the JSON envelope): ``/metrics`` text, the dashboard's HTML."""

    status: int
    content_type: str
    body: bytes


HttpRoute = Callable[[dict], Awaitable[HttpReply]]


class RpcCallError(Exception):
    """The remote node answered with an error, or could not be reached."""


class RpcServer:
    """Holds the method table and serves it on P2P and HTTP."""

    def __init__(
        self,
        *,
        p2p_limiter: PeerRateLimiter | None = None,
        http_limiter: PeerRateLimiter | None = None,
        on_request: Callable[[str, str], None] | None = None,
    ) -> None:
        """``on_request(transport, outcome)`` is told about every request (metrics):
        transport "p2p"/"http", outcome "ok", "error", "malformed" or "rate_limited"."""
        self.methods: dict[str, RpcMethod] = {}
        self.http_routes: dict[str, HttpRoute] = {}
        self._http: asyncio.base_events.Server | None = None
        self.http_port: int | None = None
        self.p2p_limiter = p2p_limiter
        self.http_limiter = http_limiter
        self._on_request = on_request
        #: ``allow(peer_id) -> bool`` (``Daemon.is_peer_allowed``): when set, libp2p callers it refuses
        #: get only :data:`PUBLIC_P2P_METHODS` (the join handshake); everything else is "access denied".
        self.allow_p2p: Callable[[str], bool] | None = None
        self.public_p2p_methods = PUBLIC_P2P_METHODS
        self._last_log: dict[tuple[str, str], float] = {}

    def register_http_route(self, path: str, route: HttpRoute) -> None:
        """Serve ``GET path`` with ``route(query params) -> HttpReply`` (before method lookup)."""
        self.http_routes["/" + path.strip("/")] = route

    def _count(self, transport: str, outcome: str) -> None:
        if self._on_request is not None:
            try:
                self._on_request(transport, outcome)
            except Exception:  # noqa: BLE001 - metrics must never break a request
                logger.debug("rpc request hook failed", exc_info=True)

    def _log_bad_input(self, source: str, kind: str, detail: str) -> None:
        """Warn about bad input, at most once per (source, kind) every BAD_INPUT_LOG_EVERY_S."""
        now = time.monotonic()
        key = (source, kind)
        if now - self._last_log.get(key, -BAD_INPUT_LOG_EVERY_S) >= BAD_INPUT_LOG_EVERY_S:
            if len(self._last_log) > 4096:
                self._last_log.clear()
            self._last_log[key] = now
            logger.warning("rpc: %s from %s: %s", kind, source, detail)

    def register(self, name: str, method: RpcMethod) -> None:
        """Add (or replace) a method; ``method(params) -> JSON/msgpack-able result``."""
        self.methods[name] = method

    async def dispatch(self, method: str, params: dict | None) -> RpcResponse:
        fn = self.methods.get(method)
        if fn is None:
            return RpcResponse(ok=False, result=None, error=f"unknown method {method!r}")
        try:
            return RpcResponse(ok=True, result=await fn(dict(params or {})), error=None)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - reported to the caller, not raised here
            logger.debug("rpc %s failed", method, exc_info=True)
            return RpcResponse(ok=False, result=None, error=f"{type(e).__name__}: {e}")

    # ------------------------------------------------------------------ libp2p
    async def attach_p2p(self, p2p) -> None:
        await p2p.add_binary_stream_handler(RPC_PROTOCOL, self._handle_stream)

    async def _handle_stream(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            caller = stream_info.peer_id.to_base58()
        except Exception:  # noqa: BLE001
            caller = "?"
        try:
            if self.p2p_limiter is not None and not self.p2p_limiter.allow(caller):
                self._count("p2p", "rate_limited")
                self._log_bad_input(caller, "rate limited", "too many rpc requests")
                response = RpcResponse(ok=False, result=None, error="rate limited: too many requests, slow down")
            else:
                data = await asyncio.wait_for(_read_frame(reader), REQUEST_READ_TIMEOUT_S)
                try:
                    request = decode(data, expect=RpcRequest, max_bytes=MAX_RPC_BYTES)
                except ProtocolError as e:
                    self._count("p2p", "malformed")
                    self._log_bad_input(caller, "malformed request", str(e))
                    response = RpcResponse(ok=False, result=None, error=f"bad request: {e}")
                else:
                    if self._p2p_refused(caller, request.method):
                        self._count("p2p", "error")
                        self._log_bad_input(caller, "refused", f"{request.method!r} from a non-member")
                        response = RpcResponse(ok=False, result=None, error="access denied: not a member of this swarm")
                    else:
                        params = dict(request.params or {})
                        params[CALLER_PARAM] = caller
                        response = await self.dispatch(request.method, params)
                        self._count("p2p", "ok" if response.ok else "error")
            await _write_frame(writer, encode(response))
        except asyncio.CancelledError:
            raise
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError, ValueError) as e:
            self._count("p2p", "malformed")
            self._log_bad_input(caller, "broken request stream", repr(e))
        except Exception:  # noqa: BLE001 - nothing a client sends may escape this handler
            logger.exception("rpc stream from %s failed", caller)
        finally:
            writer.close()

    def _p2p_refused(self, caller: str, method: str) -> bool:
        if self.allow_p2p is None or method in self.public_p2p_methods:
            return False
        try:
            return not self.allow_p2p(caller)
        except Exception:  # noqa: BLE001 - an access check that fails refuses
            return True

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
        peername = writer.get_extra_info("peername")
        client = str(peername[0]) if isinstance(peername, tuple) and peername else "?"
        status, content_type, body = 200, "application/json", b""
        early = False  # answered before the whole request was read: drain it before closing
        try:
            if self.http_limiter is not None and not self.http_limiter.allow(client):
                self._count("http", "rate_limited")
                self._log_bad_input(client, "rate limited", "too many http requests")
                early = True
                status, payload = 429, {"ok": False, "result": None, "error": "rate limited: too many requests, slow down"}
            else:
                try:
                    reply = await asyncio.wait_for(self._serve_http(reader), REQUEST_READ_TIMEOUT_S)
                except (ValueError, UnicodeError, json.JSONDecodeError, asyncio.IncompleteReadError,
                        asyncio.LimitOverrunError, asyncio.TimeoutError, RecursionError) as e:  # fmt: skip
                    self._count("http", "malformed")
                    self._log_bad_input(client, "malformed http request", repr(e))
                    early = True
                    reply = (400, {"ok": False, "result": None, "error": f"bad request: {_one_line(e)}"})
                if isinstance(reply, HttpReply):
                    status, content_type, body, payload = reply.status, reply.content_type, reply.body, None
                    self._count("http", "ok" if status < 400 else "error")
                else:
                    status, payload = reply
                    if status != 400:
                        self._count("http", "ok" if payload.get("ok") else "error")
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - nothing a client sends may escape this handler
            logger.exception("http request from %s failed", client)
            status, payload = 500, {"ok": False, "result": None, "error": "internal error"}
        try:
            if payload is not None:
                body = json.dumps(payload, default=_json_default).encode()
                content_type = "application/json"
            reason = _REASONS.get(status, "Error")
            writer.write(
                f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
            if early:
                await _drain_unread(reader)
        except (ConnectionError, RuntimeError):
            pass
        finally:
            writer.close()

    async def _serve_http(self, reader: asyncio.StreamReader) -> HttpReply | tuple[int, dict]:
        """Parse one request and run it: an :class:`HttpReply` or (status, JSON envelope)."""
        request_line = (await reader.readline()).decode("latin-1").strip()
        parts = request_line.split()
        if len(parts) < 2:
            raise ValueError("bad request line")
        verb, target = parts[0].upper(), parts[1]
        headers = {}
        for _ in range(MAX_HTTP_HEADERS + 1):
            line = (await reader.readline()).decode("latin-1")
            if line in ("\r\n", "\n", ""):
                break
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        else:
            raise ValueError(f"more than {MAX_HTTP_HEADERS} header lines")
        url = urllib.parse.urlsplit(target)
        if verb == "GET":
            params = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query).items()}
            route = self.http_routes.get("/" + url.path.strip("/"))
            if route is not None:
                return await route(params)
            method = url.path.strip("/")
        elif verb == "POST":
            length = int(headers.get("content-length", "0")[:20])
            if not 0 <= length <= MAX_HTTP_BODY_BYTES:
                raise ValueError(f"bad content-length or body over {MAX_HTTP_BODY_BYTES} bytes")
            body = load_json_bounded((await reader.readexactly(length)).decode() or "{}")
            if not isinstance(body, dict):
                raise ValueError("body must be {'method': str, 'params': {...}}")
            method = body.get("method") if url.path.strip("/") == "rpc" else url.path.strip("/")
            params = body.get("params") or {}
            if not isinstance(method, str) or not isinstance(params, dict):
                raise ValueError("body must be {'method': str, 'params': {...}}")
        else:
            raise ValueError(f"unsupported verb {verb}")
        params.pop(CALLER_PARAM, None)  # only the libp2p transport knows who calls
        response = await self.dispatch(method, params)
        status = 200
        if not response.ok and response.error and response.error.startswith("unknown method"):
            status = 404
        return status, {"ok": response.ok, "result": response.result, "error": response.error}


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:300]


def load_json_bounded(text: str, max_depth: int = MAX_JSON_DEPTH):
    """``json.loads`` that refuses nesting deeper than ``max_depth`` with a ValueError (never a RecursionError)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {max_depth} levels") from None
    stack = [(value, 1)]
    while stack:  # iterative: the check itself cannot recurse
        obj, depth = stack.pop()
        if isinstance(obj, (dict, list)):
            if depth > max_depth:
                raise ValueError(f"JSON nested deeper than {max_depth} levels")
            stack.extend((child, depth + 1) for child in (obj.values() if isinstance(obj, dict) else obj))
    return value


async def _drain_unread(reader: asyncio.StreamReader) -> None:
    """Swallow (bounded) input the client is still sending, so that close() does not reset."""
    if reader.at_eof():
        return
    try:
        remaining = DRAIN_MAX_BYTES
        while remaining > 0:
            chunk = await asyncio.wait_for(reader.read(min(remaining, 65536)), DRAIN_TIMEOUT_S)
            if not chunk:
                return
            remaining -= len(chunk)
    except (asyncio.TimeoutError, ConnectionError, ValueError):
        pass


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
    try:
        request = urllib.request.Request(
            url.rstrip("/") + "/rpc", data=body, headers={"Content-Type": "application/json"}, method="POST"
        )
    except ValueError as e:
        raise RpcCallError(f"cannot reach {url}: {e}") from None
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
