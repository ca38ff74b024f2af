"""NeMo-RL's import path for get_tokenizer works on envloop."""

from envloop.models import tokenizers


def test_get_tokenizer_imports_from_nemo_rls_path(tmp_path):
    from envloop.algorithms.utils import TokenizerConfig, get_tokenizer

    assert get_tokenizer is tokenizers.get_tokenizer
    assert TokenizerConfig is tokenizers.TokenizerConfig
    tokenizer = get_tokenizer({"name": "bundled:policy", "chat_template": None})
    text = tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False)
    assert text == "2+2?"
