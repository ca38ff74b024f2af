"""message_token_ids: the torch-free per-message token ids get_formatted_message_log wraps."""

from __future__ import annotations

import subprocess
import sys

from envloop.data.interfaces import TaskDataSpec
from envloop.data.llm_message_utils import get_formatted_message_log
from envloop.data.message_tokens import message_token_ids

LOG = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


def test_the_lists_are_the_formatted_logs_token_ids(chat_tokenizer, tmp_path):
    (tmp_path / "prompt.txt").write_text("Q: {}")
    spec = TaskDataSpec(task_name="t", prompt_file=tmp_path / "prompt.txt")
    for kwargs in ({}, {"add_generation_prompt": True}, {"task_data_spec": spec}):
        log, ids = message_token_ids(LOG, chat_tokenizer, **kwargs)
        formatted = get_formatted_message_log(LOG, chat_tokenizer, **kwargs)
        assert ids == [m["token_ids"].tolist() for m in formatted]
        assert log == [{k: v for k, v in m.items() if k != "token_ids"} for m in formatted]
    assert log[1]["content"] == "Q: What is 2+2?" and LOG[1]["content"] == "What is 2+2?"


def test_it_imports_no_torch():
    script = (
        "import sys; import envloop.data.message_tokens, envloop.data.datasets; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr
