"""The tokenizer class AutoTokenizer picks is remembered per folder, and a later load of the
folder gives the same tokenizer without importing torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from envloop.models.tiny import build_tiny_tokenizer
from envloop.models.tokenizer_classes import cache_file, remember_class, remembered_class
from envloop.models.tokenizers import get_tokenizer

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What's 12*7?"}]


def save_folder(folder: Path, declared: str | None, model_type: str | None) -> str:
    """The tiny tokenizer saved to ``folder``, its config declaring class ``declared`` and
    a model config of ``model_type`` (None: no config.json)."""
    build_tiny_tokenizer().save_pretrained(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if declared is not None:
        config["tokenizer_class"] = declared
    config_path.write_text(json.dumps(config))
    if model_type is not None:
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return str(folder)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("ENVLOOP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize(
    ("declared", "model_type"),
    [
        ("TokenizersBackend", "qwen3"),  # the bundled models' files
        ("Qwen2Tokenizer", "qwen3"),  # a class with its own pipeline
        ("Qwen2Tokenizer", "phi3"),  # AutoTokenizer loads TokenizersBackend instead
        (None, None),  # no declared class, no model config
    ],
)
def test_a_remembered_folder_loads_as_autotokenizer_loads_it(tmp_path, cache, declared, model_type):
    folder = save_folder(tmp_path / "tok", declared, model_type)
    auto = AutoTokenizer.from_pretrained(folder)
    assert remembered_class(folder) is None
    first = get_tokenizer({"name": folder})  # through AutoTokenizer, then remembered
    assert remembered_class(folder) is type(auto)
    again = get_tokenizer({"name": folder})
    assert type(first) is type(again) is type(auto)
    text = again.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text == auto.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert again(text)["input_ids"] == auto(text)["input_ids"]
    assert again.pad_token == first.pad_token and again.eos_token_id == auto.eos_token_id


def test_a_remembered_folder_loads_without_importing_torch(tmp_path, cache):
    folder = save_folder(tmp_path / "tok", "Qwen2Tokenizer", "qwen3")
    get_tokenizer({"name": folder})
    script = (
        "import sys; from envloop.models.tokenizers import get_tokenizer; "
        f"t = get_tokenizer({{'name': {folder!r}}}); "
        "print(type(t).__name__, 'torch' in sys.modules)"
    )
    env = {**os.environ, "ENVLOOP_CACHE_DIR": str(cache)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["Qwen2Tokenizer", "False"]


def test_a_changed_file_is_loaded_through_autotokenizer_again(tmp_path, cache):
    folder = save_folder(tmp_path / "tok", "Qwen2Tokenizer", "qwen3")
    get_tokenizer({"name": folder})
    config = Path(folder) / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"Qwen2Tokenizer"', '"TokenizersBackend"'))
    assert remembered_class(folder) is None
    assert type(get_tokenizer({"name": folder})).__name__ == "TokenizersBackend"


def test_an_unreadable_memory_is_ignored_and_rewritten(tmp_path, cache):
    folder = save_folder(tmp_path / "tok", None, None)
    cache.mkdir()
    cache_file().write_text("{not json")
    assert remembered_class(folder) is None
    tokenizer = get_tokenizer({"name": folder})
    assert remembered_class(folder) is type(tokenizer)


def test_only_transformers_classes_are_remembered_or_imported(tmp_path, cache):
    folder = save_folder(tmp_path / "tok", None, None)

    class Custom:
        pass

    remember_class(folder, Custom)
    assert not cache_file().exists()
    remember_class(folder, type(AutoTokenizer.from_pretrained(folder)))
    entries = json.loads(cache_file().read_text())
    (key,) = entries
    cache_file().write_text(json.dumps({key: "os:system"}))
    assert remembered_class(folder) is None
