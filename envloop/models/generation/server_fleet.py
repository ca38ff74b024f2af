"""Which of a backend's servers take requests: start-up with the servers that answer, and
the others joining the routing whenever they answer.

Every server gets its dialect's start-up questions and a probe request with one token id,
all at once. Start-up ends once at least one server has answered and every server has
answered or failed a first attempt (a refused connection fails at once): the backend
starts with the servers that answered, and the caller warns about the others. A server
that answers wrongly (a probe without usable token ids, a token id outside the tokenizer,
a 4xx answer) is a misconfiguration and stops start-up with the reason; when no server
answers within ``startup_timeout_s``, start-up fails naming each server and its last error.

Servers that have not answered keep being probed in the background (after 0.25 s, the wait
doubling up to 5 s) for as long as the backend lives, and join the routing when they
answer (:meth:`~envloop.models.generation.server_client.ServerClient.admit`: after a weight
update, a joining server first reloads the current checkpoint). Each join is logged; a
server that answers wrongly later is logged and never joins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from envloop.models.generation.server_client import ServerClient
from envloop.models.generation.server_dialects import (
    GenerationFailed,
    MalformedReply,
    RetryableFailure,
)
from envloop.models.generation.server_routing import ServerSlot

__all__ = ["FIRST_RETRY_S", "MAX_RETRY_S", "ServerFleet"]

FIRST_RETRY_S = 0.25
"""Wait before probing a server that did not answer again; it doubles with each failure."""
MAX_RETRY_S = 5.0

logger = logging.getLogger(__name__)


class ProbeRefused(Exception):
    """A server answered its probe request in a way that rules it out; the text says why."""


class ServerFleet:
    """Probes the servers of ``client``'s router and lets each join once it answers.

    ``token_id``: the probe request's prompt; ``vision``: the served model takes images;
    ``tokenizer``: its name, for errors. Lives on the client's event loop.

    Attributes:
        waiting: each server that has not joined, by URL, with its last error.
        refused: each server ruled out by its answer, by URL, with the reason.
    """

    def __init__(self, client: ServerClient, token_id: int, vision: bool, tokenizer: str) -> None:
        self.client, self.token_id = client, token_id
        self.vision, self.tokenizer = vision, tokenizer
        self.waiting: dict[str, str] = {}
        self.refused: dict[str, str] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._tried: set[str] = set()
        self._changed: asyncio.Event | None = None
        self._started = False

    async def start(self, timeout_s: float) -> list[str]:
        """Probe every server; return once at least one joined and every one answered or
        failed once (see the module docstring). Returns ``"URL (last error)"`` of each
        server still waiting, which keeps being probed. Raises ``RuntimeError`` when a
        server answered wrongly or none answered within ``timeout_s``."""
        router, dialect = self.client.router, self.client.dialect.name
        deadline = time.monotonic() + timeout_s
        self._changed = asyncio.Event()
        for server in router.servers:
            router.leave(server)
            self.waiting[server.url] = f"no answer within {timeout_s:g} s"
        attempt_s = min(timeout_s, self.client.config.request_timeout_s)
        self._tasks = [
            asyncio.create_task(self._join(server, attempt_s), name=f"join {server.url}")
            for server in router.servers
        ]
        while True:
            if self.refused:
                await self.close()
                raise RuntimeError(next(iter(self.refused.values())))
            if router.joined and len(self._tried) == len(router.servers):
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if router.joined:
                    break
                await self.close()
                lines = [f"  - {url} did not answer (last: {e})" for url, e in self.waiting.items()]
                raise RuntimeError(
                    f"No server answered a {dialect} probe request within "
                    f"startup_timeout_s={timeout_s:g} s:\n" + "\n".join(lines) + "\n"
                    "Start the servers, fix base_urls, or raise startup_timeout_s."
                )
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        self._started = True
        return [f"{url} ({error})" for url, error in self.waiting.items()]

    async def close(self) -> None:
        """Stop probing the servers still waiting."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _join(self, server: ServerSlot, attempt_s: float) -> None:
        """Probe ``server`` until it answers, then let it join; or until it is refused."""
        wait = FIRST_RETRY_S
        while True:
            try:
                await asyncio.wait_for(self._probe(server), attempt_s)
                await self.client.admit(server)
            except RetryableFailure as exc:  # not up (yet): refused, 503 while loading
                self.waiting[server.url] = str(exc)
            except asyncio.TimeoutError:
                self.waiting[server.url] = f"no answer within {attempt_s:g} s"
            except ProbeRefused as exc:
                del self.waiting[server.url]
                self.refused[server.url] = str(exc)
                if self._started:
                    logger.warning("%s will not take requests: %s", server.url, exc)
                return
            else:
                del self.waiting[server.url]
                if self._started:
                    logger.info("%s answered its probe request and joined", server.url)
                return
            finally:
                self._tried.add(server.url)
                if self._changed is not None:
                    self._changed.set()
            await asyncio.sleep(wait)
            wait = min(2 * wait, MAX_RETRY_S)

    async def _probe(self, server: ServerSlot) -> None:
        """The dialect's start-up questions and one probe request to ``server``; raises
        :class:`ProbeRefused` for an answer that rules the server out."""
        client, dialect = self.client, self.client.dialect.name
        try:
            await client.start(server, vision=self.vision)
            reply = await client.probe(server, self.token_id)
        except GenerationFailed as exc:
            raise ProbeRefused(f"The probe request failed: {exc}") from None
        except MalformedReply as exc:
            raise ProbeRefused(
                f"{server.url} ({dialect!r} dialect) answered the probe request without "
                f"usable token ids: {exc}. Token-in/token-out needs them; check that the "
                "server speaks that dialect (policy.dialect) and is recent enough."
            ) from None
        too_big = [t for t in reply.tokens if t >= client.vocab_size]
        if too_big:
            raise ProbeRefused(
                f"{server.url} generated token id {too_big[0]}, outside the tokenizer "
                f"{self.tokenizer!r} ({client.vocab_size} tokens): set tokenizer to the "
                "served model's."
            )
