"""Tiny tokenizers and models built locally from configs, with no downloads.

For tests, demos and benchmarks on machines without a model hub: a byte-level BPE tokenizer
trained in milliseconds with a ChatML template, and a 2-layer Qwen3 causal LM (hidden size
64, random weights). ``save_tiny_policy`` writes both to a folder, so the code that uses
them goes through the real ``from_pretrained`` loading path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

TRAINING_CORPUS = [
    "What is 2 + 3? The answer is 5.",
    "Use the calculator: <call>12 * 7</call> <result>84</result>",
    "Guess the number between 1 and 100. <guess>50</guess> higher lower correct",
    "system user assistant environment tool: Environment says correct, incorrect.",
    "The quick brown fox jumps over the lazy dog 0123456789 + - * / = ( ) < > [ ]",
    "<action>up</action> <action>down</action> <action>left</action> <action>right</action>",
    "\\boxed{42} think answer </think> <answer> result call guess",
]


def build_tiny_tokenizer(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained in milliseconds, with a ChatML chat template.

    EOS is ``<|im_end|>`` (as in ChatML chat models) and the pad token ``<|endoftext|>``.
    """
    return train_chatml_tokenizer(TRAINING_CORPUS * 4, vocab_size)


def train_chatml_tokenizer(
    texts: list[str], vocab_size: int, digits_apart: bool = False
) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on ``texts``, with the ChatML template, EOS ``<|im_end|>`` and
    pad ``<|endoftext|>``. ``digits_apart``: every digit is a token of its own (with the
    space before it, if any), so a model reads and writes numbers digit by digit.

    >>> train_chatml_tokenizer(["12 + 345 = 357"] * 4, 300, digits_apart=True).tokenize("1234")
    ['1', '2', '3', '4']
    """
    backend = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.pre_tokenizer = (
        pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r" ?\p{N}"), behavior="isolated"), byte_level]
        )
        if digits_apart
        else byte_level
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tiny_model(vocab_size: int, seed: int = 0) -> Any:
    """A 2-layer Qwen3 causal LM with hidden size 64 (random weights, deterministic)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model: Any = Qwen3ForCausalLM(config)
    # Random init with std 0.02 gives a near-uniform next-token distribution; scaling the
    # (tied) embeddings makes it peaked, so sampled and greedy outputs are not pure noise.
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(5.0)
    return model.eval()


def save_tiny_policy(folder: Path) -> Path:
    """Save a tiny tokenizer and model to ``folder``; returns ``folder``."""
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(len(tokenizer))
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    tokenizer.save_pretrained(folder)
    model.save_pretrained(folder)
    return folder
