"""HttpConnections against real servers on 127.0.0.1: an aiohttp application (keep-alive,
``Content-Length`` and ``chunked`` answers) and raw socket servers scripted to answer with
exact bytes (an answer that ends at the connection's close, ``Connection: close``, a server
that closes a kept-alive connection, no answer, broken answers)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web

from envloop.models.generation.http_connections import (
    MAX_HEAD_BYTES,
    BrokenAnswer,
    HttpConnections,
)

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], "asyncio.Future[None] | None"]


@contextlib.asynccontextmanager
async def aiohttp_server() -> AsyncIterator[tuple[str, list[int]]]:
    """An aiohttp server: ``POST /echo`` answers its JSON body back with a Content-Length,
    ``GET /chunked`` a JSON body in three chunks; yields its URL and the peer ports of the
    requests (one port per connection)."""
    ports: list[int] = []

    async def echo(request: web.Request) -> web.Response:
        ports.append(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        return web.json_response({"got": await request.json(), "path": request.path})

    async def chunked(request: web.Request) -> web.StreamResponse:
        ports.append(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for part in (b'{"parts": ', b"[1, 2, ", b"3]}"):
            await response.write(part)
        await response.write_eof()
        return response

    app = web.Application()
    app.add_routes([web.post("/v1/echo", echo), web.get("/v1/chunked", chunked)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", ports
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def raw_server(
    answers: list[bytes | None], close_after: bool
) -> AsyncIterator[tuple[str, list[int]]]:
    """A server that reads one request per answer and writes the next of ``answers``
    (None: closes without answering), closing the connection after each answer when
    ``close_after``; yields its URL and the number of connections it accepted."""
    accepted = [0]
    pending = list(answers)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted[0] += 1
        try:
            while pending:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (int(line.split(b":")[1]) for line in head.split(b"\r\n")
                     if line.lower().startswith(b"content-length:")), 0,
                )  # fmt: skip
                await reader.readexactly(length)
                answer = pending.pop(0)
                if answer is None:
                    break
                writer.write(answer)
                await writer.drain()
                if close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", accepted
    finally:
        server.close()


def ok(body: bytes, *headers: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n" + body


def test_requests_share_one_kept_alive_connection_and_read_both_body_framings() -> None:
    async def main() -> None:
        async with aiohttp_server() as (url, ports):
            connections = HttpConnections(url + "/v1")
            answers = [
                await connections.request("POST", "/echo", json.dumps({"n": n}).encode(), 5.0)
                for n in range(3)
            ]
            chunked = await connections.request("GET", "/chunked", None, 5.0)
            connections.close()
        assert [(status, json.loads(body)) for status, body in answers] == [
            (200, {"got": {"n": n}, "path": "/v1/echo"}) for n in range(3)
        ]
        assert chunked == (200, b'{"parts": [1, 2, 3]}')
        assert len(set(ports)) == 1  # one connection carried all four

    asyncio.run(main())


def test_requests_at_once_open_a_connection_each_then_reuse_them() -> None:
    async def main() -> None:
        async with aiohttp_server() as (url, ports):
            connections = HttpConnections(url + "/v1/")
            for _ in range(2):
                replies = await asyncio.gather(
                    *(connections.request("POST", "/echo", b"[1]", 5.0) for _ in range(4))
                )
                assert all(reply == (200, b'{"got": [1], "path": "/v1/echo"}') for reply in replies)
            connections.close()
        assert len(ports) == 8 and len(set(ports)) == 4

    asyncio.run(main())


def test_an_answer_that_ends_with_the_connection_and_connection_close() -> None:
    until_close = b'HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{"a": 1}'
    closing = ok(b"{}", b"Content-Length: 2", b"Connection: close")

    async def main() -> None:
        async with raw_server([until_close, closing, ok(b"[]", b"Content-Length: 2")], True) as (
            url,
            accepted,
        ):
            connections = HttpConnections(url)
            assert await connections.request("POST", "/x", b"{}", 5.0) == (200, b'{"a": 1}')
            assert await connections.request("GET", "/x", None, 5.0) == (200, b"{}")
            assert await connections.request("GET", "/x", None, 5.0) == (200, b"[]")
            assert accepted == [3]  # neither connection was kept for the next request

    asyncio.run(main())


def test_a_kept_alive_connection_the_server_closed_is_replaced_once() -> None:
    """The server answers with keep-alive and then closes the connection (servers close idle
    ones): the next request goes over a new connection, unnoticed by the caller."""

    async def main() -> None:
        answers = [ok(b"1", b"Content-Length: 1"), ok(b"2", b"Content-Length: 1")]
        async with raw_server(answers, close_after=True) as (url, accepted):
            connections = HttpConnections(url)
            assert await connections.request("GET", "/", None, 5.0) == (200, b"1")
            await asyncio.sleep(0.05)  # the close reaches the client while the connection idles
            assert await connections.request("GET", "/", None, 5.0) == (200, b"2")
            assert accepted == [2]

    asyncio.run(main())


def test_a_request_a_kept_alive_connection_drops_unanswered_is_sent_again_once() -> None:
    """The server reads the second request on the kept-alive connection and closes it
    without answering (as one closing an idle connection does when the request crosses
    the close): the request goes once more, over a new connection."""

    async def main() -> None:
        answers = [ok(b"1", b"Content-Length: 1"), None, ok(b"2", b"Content-Length: 1")]
        async with raw_server(answers, close_after=False) as (url, accepted):
            connections = HttpConnections(url)
            assert await connections.request("GET", "/", None, 5.0) == (200, b"1")
            assert await connections.request("GET", "/", None, 5.0) == (200, b"2")
            assert accepted == [2]

    asyncio.run(main())


def test_a_new_connection_closed_without_an_answer_is_a_reset() -> None:
    async def main() -> None:
        async with raw_server([None], close_after=True) as (url, _):
            with pytest.raises(
                ConnectionResetError, match="closed the connection without answering"
            ):
                await HttpConnections(url).request("POST", "/", b"{}", 5.0)

    asyncio.run(main())


def test_an_answer_cut_short_is_a_reset() -> None:
    async def main() -> None:
        cut = b'HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{"a"'
        async with raw_server([cut], close_after=True) as (url, _):
            with pytest.raises(ConnectionResetError, match="in the middle of its answer"):
                await HttpConnections(url).request("POST", "/", b"{}", 5.0)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "not an HTTP/1.x status line: b'SSH-2.0-OpenSSH_9.6'"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n", "bad Content-Length: b'ten'"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size: b'zz'"),
        (
            b"HTTP/1.1 200 OK\r\nX: " + b"a" * MAX_HEAD_BYTES,
            f"headers exceed {MAX_HEAD_BYTES} bytes",
        ),
    ],
)
def test_a_broken_answer_names_what_is_wrong(answer: bytes, message: str) -> None:
    async def main() -> None:
        async with raw_server([answer], close_after=False) as (url, _):
            with pytest.raises(BrokenAnswer, match=message.replace("(", r"\(")):
                await HttpConnections(url).request("POST", "/", b"{}", 5.0)

    asyncio.run(main())


def test_no_answer_in_time_is_a_timeout_and_the_connection_is_not_reused() -> None:
    async def main() -> None:
        never = asyncio.get_running_loop().create_future()

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await never

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        connections = HttpConnections(url)
        with pytest.raises(asyncio.TimeoutError, match="no answer within 0.2 s"):
            await connections.request("POST", "/", b"{}", 0.2)
        assert connections._take() is None
        never.set_result(None)
        server.close()

    asyncio.run(main())


def test_a_refused_connection_names_the_server() -> None:
    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        with pytest.raises(
            ConnectionRefusedError, match=f"cannot connect to 127.0.0.1:{port}: Connection refused"
        ):
            await HttpConnections(f"http://127.0.0.1:{port}").request("GET", "/", None, 5.0)

    asyncio.run(main())


def test_a_base_url_without_scheme_is_refused_with_the_fix() -> None:
    with pytest.raises(
        ValueError,
        match="'127.0.0.1:8080' is not an http:// or https:// URL .* like http://127.0.0.1:8080",
    ):
        HttpConnections("127.0.0.1:8080")
