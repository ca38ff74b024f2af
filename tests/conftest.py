"""Shared fixtures: a tiny tokenizer and policy built locally, and one Ray session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.fixtures.chat_templates import build_llama3_tokenizer
from tests.fixtures.generation import save_untied_policy
from tests.fixtures.tiny_models import build_tiny_tokenizer, save_tiny_policy

REPO_ROOT = Path(__file__).resolve().parents[1]

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray workers import test modules (toy environments) by reference.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
)


@pytest.fixture(scope="session", autouse=True)
def envloop_cache_dir(tmp_path_factory) -> Path:
    """envloop's cache (remembered tokenizer classes) in the session's temp dir, not ~/.cache;
    command-line runs started by tests inherit it."""
    from envloop.models.tokenizer_classes import CACHE_DIR_VARIABLE

    path = tmp_path_factory.mktemp("envloop_cache")
    os.environ[CACHE_DIR_VARIABLE] = str(path)
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """Byte-level BPE tokenizer, ChatML template; EOS ``<|im_end|>``, pad ``<|endoftext|>``."""
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def llama3_tokenizer():
    """Llama-3-style headers, BOS rendered by the template, EOS ``<|eot_id|>``."""
    return build_llama3_tokenizer()


@pytest.fixture(params=["chatml", "llama3"])
def chat_tokenizer(request, tiny_tokenizer, llama3_tokenizer):
    """Each of the ChatML and Llama-3-style tokenizers in turn."""
    return {"chatml": tiny_tokenizer, "llama3": llama3_tokenizer}[request.param]


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory) -> Path:
    """A folder holding a tiny Qwen3 causal LM and its tokenizer (``from_pretrained`` loadable)."""
    return save_tiny_policy(tmp_path_factory.mktemp("tiny_policy"))


@pytest.fixture(scope="session")
def untied_policy_dir(tiny_policy_dir: Path, tmp_path_factory) -> Path:
    """The tiny policy with an untied random LM head: greedy output varies and reaches EOS."""
    return save_untied_policy(tiny_policy_dir, tmp_path_factory.mktemp("untied_policy"))


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray session shared by every test that needs it."""
    import ray

    from envloop.distributed.ray_utils import init_ray

    init_ray(num_cpus=2, log_to_driver=False)
    yield ray
    ray.shutdown()
