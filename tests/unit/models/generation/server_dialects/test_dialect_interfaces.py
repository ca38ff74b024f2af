"""What a dialect does where it adds nothing of its own (SGLang adds least: it is used to
show the base class's defaults)."""

from __future__ import annotations

import asyncio

import pytest

from envloop.models.generation.server_dialects import (
    GenerationFailed,
    GenerationRequest,
    Reply,
    ServerMedia,
    SglangDialect,
)
from envloop.models.generation.server_routing import ServerSlot
from tests.fixtures.dialect_requests import SAMPLED


async def _never_called(*args: object) -> None:
    raise AssertionError(f"no request expected, got {args}")


def test_by_default_a_dialect_asks_a_server_nothing_at_start_up():
    server = ServerSlot("http://s")
    asyncio.run(SglangDialect().start(server, _never_called, vision=True))
    assert server.media is None


def test_by_default_a_reply_with_a_gap_fails_its_row():
    reply = Reply([5, 6], [-0.5, None], "eos")
    request = GenerationRequest([1, 2], 4, None, 0)
    fill = SglangDialect().fill_logprobs(request, SAMPLED, reply, _never_called, 100)
    with pytest.raises(GenerationFailed, match="no log-probability for some tokens"):
        asyncio.run(fill)


def test_by_default_servers_take_images_and_any_sampling():
    assert SglangDialect().images_refused_by(ServerMedia(False)) is None
    assert SglangDialect.sampling_refused(None, 1.0) is None


@pytest.mark.parametrize(
    ("status", "text", "failed"),
    [
        (200, '{"status": "paused"}', False),
        (200, "not json", False),
        (200, '{"success": false, "message": "shape mismatch"}', True),
        (500, '{"results": null}', True),
        (404, "Not Found", True),
    ],
)
def test_a_weight_update_answer_fails_on_any_status_but_200_or_success_false(status, text, failed):
    assert SglangDialect().control_failed(status, text) is failed
