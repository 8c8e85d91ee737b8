"""The DHT child process, kept alive when one request's reply handle cannot be fetched.

``hivemind.DHT`` runs in a forked child that reads (method, args, kwargs) requests from a pipe. Each request
carries an ``MPFuture`` whose reply pipe travels as a file descriptor handed over by the *sender's*
``multiprocessing`` resource sharer, fetched when the child unpickles the request. A sender that ends between
sending and that fetch (an averager process stopped mid-call, when a trainer leaves or switches epochs) leaves
nothing to fetch: unpickling raises ``EOFError``, which hivemind 1.1.12's request loop does not catch, and the
DHT process dies. Every DHT call of the daemon then times out (seen once in a full suite: a re-joining
replica's DHT died 5 s after its old trainer stopped; it never trained again).

:class:`SwarmDHT` reads requests through :class:`RequestPipe`, which turns that one failure (the request's
bytes arrived whole, their unpickling failed) into a ``ConnectionError``: the loop logs it, drops the request
(its sender is gone, nobody waits for the reply) and goes on. A closed pipe (the daemon is gone) still ends
the process as before.
"""

from __future__ import annotations

from multiprocessing.reduction import ForkingPickler

import node.compat  # noqa: F401  (protobuf shim before hivemind)
from hivemind import DHT

__all__ = ["RequestPipe", "SwarmDHT"]


class RequestPipe:
    """The read end of the DHT's request pipe (a ``multiprocessing`` connection), for the request loop."""

    def __init__(self, connection) -> None:
        self._connection = connection

    def poll(self, timeout: float = 0.0) -> bool:
        return self._connection.poll(timeout)

    def recv(self):
        """The next request. ``EOFError`` while reading: the pipe closed (as a plain connection). ``ConnectionError``:
        the request arrived but one of its handles could not be fetched from its sender any more."""
        payload = self._connection.recv_bytes()
        try:
            return ForkingPickler.loads(payload)
        except EOFError as e:
            raise ConnectionError(f"dropped a DHT request whose sender is gone ({e!r})") from None

    def fileno(self) -> int:
        return self._connection.fileno()


class SwarmDHT(DHT):
    """``hivemind.DHT`` whose request loop survives a request from a sender that ended (see the module)."""

    def run(self) -> None:
        self._inner_pipe = RequestPipe(self._inner_pipe)
        super().run()
