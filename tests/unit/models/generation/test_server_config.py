"""ServerGenerationConfig: its defaults, and every problem of a mapping reported at once."""

from __future__ import annotations

import pytest

from envloop.config.errors import ConfigError
from envloop.models.generation.server_config import ServerGenerationConfig
from tests.fixtures.dialect_requests import MODEL

URL = "http://127.0.0.1:8000"


def test_config_defaults():
    config = ServerGenerationConfig(base_urls=[URL], tokenizer=MODEL)
    assert config.model_dump() == {
        "base_urls": [URL],
        "dialect": "vllm",
        "tokenizer": MODEL,
        "chat_template": "default",
        "chat_template_kwargs": None,
        "model": None,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "seed": 0,
        "max_new_tokens": 512,
        "max_concurrent_requests": 1024,
        "max_requests_per_server": None,
        "request_timeout_s": 600.0,
        "max_retries": 5,
        "retry_backoff_s": 0.5,
        "startup_timeout_s": 120.0,
    }


def test_config_from_a_mapping():
    options = {"base_urls": [URL], "tokenizer": MODEL, "dialect": "llamacpp", "top_k": 20}
    config = ServerGenerationConfig.from_mapping(options)
    assert config == ServerGenerationConfig(**options)
    assert (config.dialect, config.top_k) == ("llamacpp", 20)


def test_config_mapping_reports_every_problem():
    options = {"base_urls": [], "tokenizer": MODEL, "dialect": "tgi", "max_retires": 2}
    with pytest.raises(ConfigError) as error:
        ServerGenerationConfig.from_mapping(options)
    assert error.value.problems == [
        "base_urls: must have at least 1 item, got []",
        "dialect: 'tgi' is not one of vllm, sglang, llamacpp",
        "max_retires: unknown option. Did you mean 'max_retries'?",
    ]


SGLANG_REFUSAL = (
    "dialect 'sglang' reports log-probabilities with the temperature applied but not "
    "top-k/top-p filtering, so they would not be those of the distribution tokens are drawn "
    "from; set top_k: null and top_p: 1, or serve with vLLM (--logprobs-mode "
    "processed_logprobs) or llama.cpp"
)


@pytest.mark.parametrize("filtering", [{"top_p": 0.9}, {"top_k": 20}], ids=["top_p", "top_k"])
def test_config_refuses_filtered_sampling_on_sglang(filtering):
    options = {"base_urls": [URL], "tokenizer": MODEL, "dialect": "sglang", **filtering}
    with pytest.raises(ConfigError) as error:
        ServerGenerationConfig.from_mapping(options)
    assert error.value.problems == [SGLANG_REFUSAL]


def test_config_accepts_unfiltered_sampling_on_sglang():
    config = ServerGenerationConfig(
        base_urls=[URL], tokenizer=MODEL, dialect="sglang", temperature=0.7
    )
    assert (config.top_p, config.top_k, config.temperature) == (1.0, None, 0.7)
