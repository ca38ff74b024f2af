"""HTTP/1.1 requests to one server over connections kept alive between requests.

:class:`ServerClient` sends thousands of small JSON requests at once and reads a small JSON
answer for each; a general HTTP client's request and response objects, tasks and timers
cost more CPU per request than the request itself (``benchmarks/server_fleet.py client``
measures both). :class:`HttpConnections` does only what those requests need: a request is
written in one call, its answer parsed where the bytes arrive (``Content-Length``,
``chunked``, or up to the connection's close), and its connection handed to the next
request unless the server asked to close it. A request that finds its kept-alive
connection closed by the server before any byte of an answer (servers close idle
connections after a few seconds) is sent once more on a new connection.

Failures are exceptions the caller can tell apart: :class:`OSError` (refused, reset, a
broken or oversized answer: :class:`BrokenAnswer`), :class:`asyncio.TimeoutError` (no whole
answer within ``timeout_s`` of the request's start, connecting included).
"""

from __future__ import annotations

import asyncio
import os
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 64 * 1024
"""The most bytes a status line and headers may take."""
MAX_ANSWER_BYTES = 512 * 1024 * 1024
"""The most bytes an answer's body may take (a server that sends more is broken)."""


_JSON_LENGTH = b"Content-Type: application/json\r\nContent-Length: %d\r\n"


class BrokenAnswer(ConnectionError):
    """The server's answer is not HTTP/1.x this client can read, or is over its limits."""


class HttpConnections:
    """Requests to the server at ``base_url`` (``http://`` or ``https://``, with or without
    a path prefix), over kept-alive connections; lives on one event loop.

    >>> HttpConnections("http://127.0.0.1:8080/v1").target("/models")
    '/v1/models'
    """

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"base URL {base_url!r} is not an http:// or https:// URL with a host; "
                "write it like http://127.0.0.1:8080"
            )
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        self._host_header = parts.netloc.rsplit("@", 1)[-1].encode()
        self._idle: list[_Connection] = []
        self._closed = False

    def target(self, path: str) -> str:
        """The request target of ``path`` on this server."""
        return self.prefix + path

    async def request(
        self, method: str, path: str, body: bytes | None, timeout_s: float
    ) -> tuple[int, bytes]:
        """``method`` ``path`` with a JSON ``body`` (or none); returns the answer's status
        and body."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        head = self._head(method, path, body)
        connection = self._take()
        while True:
            fresh = connection is None
            if connection is None:
                connection = await self._connect(loop, deadline - loop.time(), timeout_s)
            try:
                status, answer, keep = await connection.exchange(
                    loop, head, body, deadline, timeout_s
                )
            except _SilentClose:
                if fresh:
                    raise ConnectionResetError(
                        "the server closed the connection without answering"
                    ) from None
                connection = None  # closed by the server while idle: once more, on a new one
                continue
            if keep and not self._closed:
                self._idle.append(connection)
            else:
                connection.close()
            return status, answer

    def close(self) -> None:
        """Close the idle connections; connections in use close when their request ends."""
        self._closed = True
        for connection in self._idle:
            connection.close()
        self._idle.clear()

    def _take(self) -> _Connection | None:
        while self._idle:
            connection = self._idle.pop()
            if connection.open:
                return connection
        return None

    async def _connect(
        self, loop: asyncio.AbstractEventLoop, remaining_s: float, timeout_s: float
    ) -> _Connection:
        connecting = loop.create_connection(
            _Connection, self.host, self.port, ssl=self.ssl,
            server_hostname=self.host if self.ssl else None,
        )  # fmt: skip
        try:
            _, connection = await asyncio.wait_for(connecting, max(remaining_s, 0.0))
        except asyncio.TimeoutError:
            raise asyncio.TimeoutError(f"no connection within {timeout_s:g} s") from None
        except OSError as exc:
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise type(exc)(f"cannot connect to {self.host}:{self.port}: {reason}") from None
        return connection

    def _head(self, method: str, path: str, body: bytes | None) -> bytes:
        length = b"" if body is None else _JSON_LENGTH % len(body)
        return b"%s %s HTTP/1.1\r\nHost: %s\r\n%s\r\n" % (
            method.encode(), self.target(path).encode(), self._host_header, length,
        )  # fmt: skip


class _SilentClose(Exception):
    """The connection closed before any byte of an answer arrived."""


class _Connection(asyncio.Protocol):
    """One connection: one request at a time, its answer parsed as its bytes arrive."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.open = False
        self._buffer = bytearray()
        self._waiter: asyncio.Future[tuple[int, bytes, bool]] | None = None
        self._head: _Head | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.open = True

    async def exchange(
        self, loop: asyncio.AbstractEventLoop, head: bytes, body: bytes | None,
        deadline: float, timeout_s: float,
    ) -> tuple[int, bytes, bool]:  # fmt: skip
        """Send one request; returns the answer's status, body and whether the connection
        may carry another request."""
        assert self.transport is not None
        self._buffer.clear()
        self._head = None
        waiter = self._waiter = loop.create_future()
        self.transport.write(head if body is None else head + body)
        timer = loop.call_at(deadline, self._time_out, timeout_s)
        try:
            return await waiter
        except BaseException:
            self.close()  # timed out, cancelled or broken: its answer would be out of step
            raise
        finally:
            timer.cancel()
            self._waiter = None

    def close(self) -> None:
        self.open = False
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # bytes nobody asked for: the connection is not reused (exchange)
        try:
            answer = self._parse(closed=False)
        except BrokenAnswer as exc:
            waiter.set_exception(exc)
            return
        if answer is not None:
            waiter.set_result(answer)

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if not self._buffer:
            waiter.set_exception(_SilentClose())
            return
        try:
            answer = self._parse(closed=True)
        except BrokenAnswer as error:
            waiter.set_exception(error)
            return
        if answer is None:
            waiter.set_exception(
                ConnectionResetError("the server closed the connection in the middle of its answer")
            )
        else:
            waiter.set_result(answer)

    def _time_out(self, timeout_s: float) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(asyncio.TimeoutError(f"no answer within {timeout_s:g} s"))

    def _parse(self, closed: bool) -> tuple[int, bytes, bool] | None:
        """The whole answer in the buffer as (status, body, keep-alive), or None if more is
        to come (``closed``: nothing more will come)."""
        buffer = self._buffer
        if self._head is None:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > MAX_HEAD_BYTES:
                    raise BrokenAnswer(f"the answer's headers exceed {MAX_HEAD_BYTES} bytes")
                return None
            self._head = _Head.read(bytes(buffer[:end]))
            del buffer[: end + 4]
        head = self._head
        if head.length is not None:
            if len(buffer) < head.length:
                return None
            return head.status, bytes(buffer[: head.length]), head.keep_alive
        if head.chunked:
            body = _dechunked(buffer)
            return None if body is None else (head.status, body, head.keep_alive)
        if len(buffer) > MAX_ANSWER_BYTES:
            raise BrokenAnswer(f"the answer exceeds {MAX_ANSWER_BYTES} bytes")
        return (head.status, bytes(buffer), False) if closed else None


@dataclass(frozen=True)
class _Head:
    """An answer's status line and the headers that say where its body ends."""

    status: int
    length: int | None
    chunked: bool
    keep_alive: bool

    @classmethod
    def read(cls, raw: bytes) -> _Head:
        lines = raw.split(b"\r\n")
        status_line = lines[0].split(b" ", 2)
        if (
            len(status_line) < 2
            or not status_line[0].startswith(b"HTTP/1.")
            or not status_line[1].isdigit()
        ):
            raise BrokenAnswer(f"not an HTTP/1.x status line: {lines[0][:100]!r}")
        status = int(status_line[1])
        keep_alive = status_line[0] != b"HTTP/1.0"
        length: int | None = None
        chunked = False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"content-length":
                if not value.isdigit():
                    raise BrokenAnswer(f"bad Content-Length: {value[:40]!r}")
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = value.endswith(b"chunked")
            elif name == b"connection":
                keep_alive = value == b"keep-alive" or (keep_alive and value != b"close")
        if chunked:
            length = None
        elif length is not None and length > MAX_ANSWER_BYTES:
            raise BrokenAnswer(f"the answer's Content-Length {length} exceeds {MAX_ANSWER_BYTES}")
        if status in (204, 304) or 100 <= status < 200:
            length = 0
        if length is None and not chunked:
            keep_alive = False  # the body ends where the connection does
        return cls(status, length, chunked, keep_alive)


def _dechunked(buffer: bytearray) -> bytes | None:
    """The body of a whole ``chunked`` body in ``buffer``, or None if it is not all there."""
    body = bytearray()
    position = 0
    while True:
        end = buffer.find(b"\r\n", position)
        if end < 0:
            return None
        size_text = bytes(buffer[position:end]).split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise BrokenAnswer(f"bad chunk size: {size_text[:40]!r}") from None
        if size == 0:
            trailer_end = buffer.find(b"\r\n\r\n", end)
            if buffer[end : end + 4] == b"\r\n\r\n" or trailer_end >= 0:
                return bytes(body)
            return None
        start = end + 2
        if len(buffer) < start + size + 2:
            if start + size > MAX_ANSWER_BYTES:
                raise BrokenAnswer(f"the answer exceeds {MAX_ANSWER_BYTES} bytes")
            return None
        body += buffer[start : start + size]
        position = start + size + 2
