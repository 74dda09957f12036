"""The node's HTTP endpoint: ``GET /metrics``, ``/healthz`` and ``/readyz`` on the node's own event loop.

A deliberately small HTTP/1.1 server over :func:`asyncio.start_server`: no
thread (prometheus_client's ``start_http_server`` runs one and has no
readiness), no framework to start, nothing on the node's hot path. Each
connection gets one answer and is closed. It is bounded: a request head of at
most :data:`MAX_REQUEST` bytes, read within ``read_timeout`` seconds, at most
``max_connections`` connections at once (one more is answered 503 and
closed), and the answer must leave within ``read_timeout`` too. Anything it
cannot read is answered 4xx with a JSON body, or the connection is dropped;
nothing a peer sends can raise into the node.

The endpoint is unauthenticated: metrics carry counts and sizes, no keys,
tokens or namespaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

log = logging.getLogger(__name__)

MAX_REQUEST = 8192  # bytes of request line plus headers
READ_TIMEOUT = 5.0
MAX_CONNECTIONS = 32
CLOSE_TIMEOUT = 5.0
LINGER = 0.5  # after an error answer, the most time and bytes spent reading what the peer still sends
LINGER_BYTES = 1 << 20
JSON = "application/json"
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
            431: "Request Header Fields Too Large", 503: "Service Unavailable", 500: "Internal Server Error"}


class MetricsEndpoint:
    """Serves a registry and the node's health (see module docstring); :meth:`start`, then :meth:`close`."""

    def __init__(self, registry: CollectorRegistry, not_ready: Callable[[], str | None], *,
                 max_connections: int = MAX_CONNECTIONS, read_timeout: float = READ_TIMEOUT) -> None:
        """``not_ready()`` says why the node is not ready (``None``: ready); it is asked on every ``/readyz``."""
        self.registry = registry
        self.not_ready = not_ready
        self.max_connections = max_connections
        self.read_timeout = read_timeout
        self.served: dict[int, int] = {}  # answers by status
        self.refused = 0  # connections closed unanswered at the connection cap
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def address(self) -> str:
        """``host:port`` bound (port 0 resolved)."""
        assert self._server is not None, "endpoint not started"
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    async def start(self, host: str, port: int) -> None:
        """Bind and serve. ``OSError`` when the address cannot be bound."""
        self._server = await asyncio.start_server(self._connection, host, port, limit=MAX_REQUEST)

    async def close(self) -> None:
        """Stop accepting and end every connection (bounded). Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), CLOSE_TIMEOUT)

    # ---- one connection ---------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        clean = False
        try:
            if len(self._tasks) > self.max_connections:
                self.refused += 1
                return  # over the cap: closed unanswered (like a full backlog), so it cannot linger
            try:
                async with asyncio.timeout(self.read_timeout):
                    head = await reader.readuntil(b"\r\n\r\n")
            except TimeoutError:
                await self._answer(writer, 408, {"error": f"no complete request within {self.read_timeout} s"}, JSON)
                return
            except (asyncio.LimitOverrunError, ValueError):
                if await self._answer(writer, 431, {"error": f"request head over {MAX_REQUEST} bytes"}, JSON):
                    clean = await self._linger(reader)
                return
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the peer went away before finishing its request
            status, body, content_type = self._route(head)
            clean = await self._answer(writer, status, body, content_type, head_only=head.startswith(b"HEAD "))
            if clean and status >= 400:
                await self._linger(reader)
        except asyncio.CancelledError:
            pass
        except Exception:  # a bug costs this one answer, never the node
            log.exception("metrics endpoint: internal error")
        finally:
            if clean:
                writer.close()  # the answer is out of our buffer: the transport closes once the kernel has it
            else:
                writer.transport.abort()
            self._tasks.discard(task)

    def _route(self, head: bytes) -> tuple[int, Any, str]:
        """(status, body, content type) for a request head."""
        line = head.split(b"\r\n", 1)[0]
        parts = line.split(b" ")
        if len(parts) != 3 or parts[2] not in (b"HTTP/1.0", b"HTTP/1.1") or not parts[1].startswith(b"/"):
            return 400, {"error": "malformed request line: expected 'GET /path HTTP/1.1'"}, JSON
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            return 405, {"error": f"method {method[:16].decode('latin-1')!r} not allowed: only GET and HEAD"}, JSON
        if target == b"/metrics":
            return 200, generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4
        if target == b"/healthz":
            return 200, {"status": "ok"}, JSON
        if target == b"/readyz":
            reason = self.not_ready()
            if reason is None:
                return 200, {"status": "ready"}, JSON
            return 503, {"status": "not ready", "reason": reason}, JSON
        return 404, {"error": "not found: the node serves /metrics, /healthz and /readyz"}, JSON

    async def _linger(self, reader: asyncio.StreamReader) -> bool:
        """Read and drop what the peer still sends (bounded), so that closing does not reset the answer away.

        Closing a socket with unread input sends a reset, which may reach the
        peer before it has read the answer. True when the peer closed its side
        within :data:`LINGER` seconds and :data:`LINGER_BYTES` bytes.
        """
        left = LINGER_BYTES
        try:
            async with asyncio.timeout(LINGER):
                while left > 0:
                    chunk = await reader.read(min(left, 65536))
                    if not chunk:
                        return True
                    left -= len(chunk)
        except (TimeoutError, ConnectionError):
            pass
        return False

    async def _answer(self, writer: asyncio.StreamWriter, status: int, body: Any, content_type: str, *,
                      head_only: bool = False) -> bool:
        """Send one answer; True when it left this process's buffers within ``read_timeout``."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = (f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\nContent-Type: {content_type}\r\n"
                   f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
        self.served[status] = self.served.get(status, 0) + 1
        writer.write(headers if head_only else headers + data)
        try:
            async with asyncio.timeout(self.read_timeout):
                await writer.drain()
        except (TimeoutError, ConnectionError):
            return False
        return True
