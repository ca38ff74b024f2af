"""ServerGeneration with images against a real llama-server serving the tiny Qwen2.5-VL
(``save_tiny_vlm``) converted to an f32 GGUF and an f32 vision projector (``--mmproj``).

The server gets each row's images beside its prompt (``images`` column): the tokens it
returns are its own, its greedy tokens are HfGeneration's, and every reported logprob is
that of a teacher-forced pass of the same weights with the row's own images, and not with
another row's. llama.cpp re-tokenizes the text of an image prompt, so the server's count of
prompt tokens is checked against the processor's: a server whose image token limits differ
from the processor's fails those rows with the fix.

Tolerance: measured on these prompts the server's logprobs differ from torch's by at most
1.3e-3, with the same offset on prompts without images (llama.cpp's f32 text kernels on
this model's large embeddings); images that differ move the logprobs of the sampled tokens
by more than 1e-2 (1.6e-2 for row 0 of the sampled test).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from envloop.data.llm_message_utils import (
    batched_message_log_to_flat_message,
    get_formatted_message_log,
)
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.models.generation.hf_generation import HfGeneration
from envloop.models.generation.server_generation import ServerGeneration
from envloop.models.processors import load_processor
from envloop.models.tiny_vlm import save_tiny_vlm
from tests.fixtures.images import noise_image
from tests.fixtures.llama_server import LlamaServer, converted_gguf

pytestmark = [pytest.mark.server, pytest.mark.slow]
TOLERANCE = 5e-3
MAX_NEW_TOKENS = 8
IMAGE_TOKEN_LIMITS = ("--image-min-tokens", "1", "--image-max-tokens", "16")
"""The tiny processor's min_pixels and max_pixels, in merged 28x28 patches."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-vlm")


@pytest.fixture(scope="module")
def ggufs(folder) -> tuple[Path, Path]:
    return converted_gguf(folder), converted_gguf(folder, mmproj=True)


def start(ggufs, *extra: str) -> LlamaServer:
    text, projector = ggufs
    return LlamaServer(text, extra=("--mmproj", str(projector), *extra)).start()


@pytest.fixture(scope="module")
def server(ggufs):
    running = start(ggufs, *IMAGE_TOKEN_LIMITS)
    yield running
    running.stop()


def server_policy(url: str, folder: Path, **settings) -> ServerGeneration:
    return ServerGeneration(
        {"base_urls": [url], "dialect": "llamacpp", "tokenizer": str(folder),
         "max_new_tokens": MAX_NEW_TOKENS, **settings}
    )  # fmt: skip


@pytest.fixture(scope="module")
def policy(server, folder):
    backend = server_policy(server.url, folder)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def model(folder):
    return AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()


ROW_IMAGES = [
    [noise_image(0, 56, 84)],  # at the processor's size already
    [],
    [noise_image(1, 70, 100), noise_image(2, 40, 30)],  # resized by the processor
    [noise_image(3, 28, 28)],  # one merged patch: below llama.cpp's default minimum
]


def image_batch(processor, images: list[list[Image.Image]]) -> BatchedDataDict:
    """Generation input for one user turn per row: its images, then a question."""
    logs = []
    for row_images in images:
        parts = [{"type": "image", "image": image} for image in row_images]
        content = [*parts, {"type": "text", "text": "What colour is the square?"}]
        logs.append(
            get_formatted_message_log(
                [{"role": "user", "content": content}], processor, add_generation_prompt=True
            )
        )
    pad = processor.tokenizer.pad_token_id
    flat, lengths = batched_message_log_to_flat_message(logs, pad_value_dict={"token_ids": pad})
    data = BatchedDataDict(input_ids=flat["token_ids"], input_lengths=lengths)
    for key in ("pixel_values", "image_grid_thw"):
        if key in flat:
            data[key] = flat[key]
    data["images"] = [list(row) or None for row in images]
    return data


def teacher_forced(model, data, row: int, tokens: list[int], temperature: float = 1.0):
    """Logprobs of ``tokens`` after row ``row``'s prompt, with that row's images."""
    n = int(data["input_lengths"][row])
    ids = torch.cat([data["input_ids"][row, :n], torch.tensor(tokens, dtype=torch.long)])[None]
    vision = {
        k: data[k][row] for k in ("pixel_values", "image_grid_thw") if data[k][row] is not None
    }
    if vision:
        vision["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    with torch.no_grad():
        logits = model(input_ids=ids, **vision).logits[0, n - 1 : -1] / temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]


def generated(out, data, row: int) -> tuple[list[int], torch.Tensor]:
    n, k = int(data["input_lengths"][row]), int(out["generation_lengths"][row])
    return out["output_ids"][row, n : n + k].tolist(), out["logprobs"][row, n : n + k]


@pytest.fixture(scope="module")
def processor(folder):
    return load_processor(str(folder))


def test_greedy_tokens_equal_hf_generation_with_the_images(policy, processor, model, folder):
    assert type(policy.processor) is type(processor)  # the engine tokenizes with it
    data = image_batch(policy.processor, ROW_IMAGES)
    out = policy.generate(data, greedy=True)
    hf = HfGeneration({"model_name": str(folder), "max_new_tokens": MAX_NEW_TOKENS})
    expected = hf.generate(data, greedy=True)
    assert out["generation_error"] == [None] * 4
    for row in range(4):
        tokens, logprobs = generated(out, data, row)
        assert tokens == generated(expected, data, row)[0] and len(tokens) == MAX_NEW_TOKENS
        torch.testing.assert_close(
            logprobs, teacher_forced(model, data, row, tokens), atol=TOLERANCE, rtol=0
        )


def test_sampled_logprobs_are_those_of_the_rows_own_images(server, folder, processor, model):
    backend = server_policy(server.url, folder, seed=5, temperature=1.5)
    try:
        data = image_batch(processor, ROW_IMAGES)
        out = backend.generate(data)
        assert backend.request_stats()["score_requests"] > 0  # gaps scored through text
    finally:
        backend.shutdown()
    assert out["generation_error"] == [None] * 4
    swapped = image_batch(processor, [[noise_image(9, 56, 84)]])  # row 0's size, other pixels
    tokens, logprobs = generated(out, data, 0)
    own = teacher_forced(model, data, 0, tokens, 1.5)
    other = teacher_forced(model, swapped, 0, tokens, 1.5)
    assert float((logprobs - own).abs().max()) < TOLERANCE
    assert float((logprobs - other).abs().max()) > 2 * TOLERANCE  # the images reached it
    for row in range(1, 4):
        tokens, logprobs = generated(out, data, row)
        expected = teacher_forced(model, data, row, tokens, 1.5)
        assert float((logprobs - expected).abs().max()) < TOLERANCE


def test_a_gap_that_text_cannot_reach_fails_its_row_with_the_reason(server, folder, processor):
    """llama.cpp leaves out the probability of a token that ends mid-way through a
    character; on an image prompt it is scored with the reply's tokens as text, and when
    those do not read back as the same number of tokens the row fails (seeded: rows 2 and
    3 of this batch sample such tokens)."""
    backend = server_policy(server.url, folder, seed=3, temperature=1.5)
    try:
        out = backend.generate(image_batch(processor, ROW_IMAGES))
    finally:
        backend.shutdown()
    errors = out["generation_error"]
    assert errors[:2] == [None, None]
    for row in (2, 3):
        assert errors[row].startswith("llama.cpp reported no probability for token")
        assert "reaches it only as text" in errors[row]


def test_a_server_that_counts_image_tokens_differently_fails_only_those_rows(
    ggufs, folder, processor
):
    running = start(ggufs)  # llama.cpp's own limits for Qwen-VL: 8 to 4096 merged patches
    backend = server_policy(running.url, folder)
    try:
        out = backend.generate(image_batch(processor, ROW_IMAGES), greedy=True)
    finally:
        backend.shutdown()
        running.stop()
    errors = out["generation_error"]
    assert errors[1] is None  # no images
    for row in (0, 2, 3):  # 6, 8 + 1, and 1 merged patches: llama.cpp scales them up
        assert "--image-min-tokens" in errors[row] and "image(s) as" in errors[row]
        assert out["generation_lengths"][row] == 0


def test_a_server_without_a_vision_projector_is_refused_before_sending(ggufs, folder, processor):
    running = LlamaServer(ggufs[0]).start()
    backend = server_policy(running.url, folder)
    try:
        with pytest.raises(ValueError, match=r"serves no vision projector; start llama-server"):
            backend.generate(image_batch(processor, ROW_IMAGES[:1]))
        text_only = image_batch(processor, [[]])
        assert backend.generate(text_only, greedy=True)["generation_error"] == [None]
        assert backend.request_stats()["requests"] == 1  # the text row's
    finally:
        backend.shutdown()
        running.stop()


@pytest.mark.ray
def test_a_multi_turn_rollout_with_pictures_equals_hf_generation(ray_session, server, folder):
    """The engine hands the server each sample's images (prompt and observations) with
    every turn: greedy trajectories equal HfGeneration's, token for token. (llama.cpp
    re-tokenizes an image prompt's text with the GGUF's Qwen2 pre-tokenizer, which splits
    digits where the tiny tokenizer's byte-level one does not, so the observations here
    hold no digits; a row whose text comes back as other tokens fails with the count
    check's message, as the test above shows.)"""
    from envloop.environments.registry import create_env, register_env
    from envloop.experience.rollouts import run_multi_turn_rollout

    register_env("test_picture_board", "tests.fixtures.vlm_envs:PictureBoardEnv", overwrite=True)
    env = create_env("test_picture_board", num_cpus=0)
    remote = server_policy(server.url, folder)
    local = HfGeneration({"model_name": str(folder), "max_new_tokens": MAX_NEW_TOKENS})
    logs = []
    for backend in (remote, local):
        processor = backend.processor
        prompts = [
            get_formatted_message_log(
                [{"role": "user", "content": [{"type": "image", "image": images[0]},
                                              {"type": "text", "text": "What now?"}]}],
                processor, add_generation_prompt=True,
            )
            for images in (ROW_IMAGES[0], ROW_IMAGES[2])
        ]  # fmt: skip
        batch = BatchedDataDict(
            message_log=prompts,
            extra_env_info=[
                {"turns": 3, "size": 28, "text": "And now?"},
                {"turns": 2, "size": 56, "text": "And now?"},
            ],
            loss_multiplier=[1.0, 1.0],
            idx=[0, 1],
            task_name=["board", "board"],
        )
        final, _ = run_multi_turn_rollout(
            backend, batch, processor, {"board": env}, max_seq_len=300, max_rollout_turns=3,
            greedy=True, observation_format="chat_template",
        )  # fmt: skip
        assert final["generation_error"] == [None, None]
        assert final["num_turns"].tolist() == [3, 2]
        logs.append([[m["token_ids"].tolist() for m in log] for log in final["message_log"]])
    remote.shutdown()
    assert logs[0] == logs[1]


class SeenColumns(ServerGeneration):
    """A server backend recording the columns of every generation input it is handed."""

    def generate(self, data, greedy=False):
        self.seen = getattr(self, "seen", set()) | set(data)
        return super().generate(data, greedy=greedy)


def test_deduplicated_multimodal_data_hands_the_server_only_images_and_grids(server, folder):
    """With deduplicate_multimodal_data the engine hands a server backend (which reads
    images) each sample's images and image_grid_thw but no pixel_values, as NeMo-RL hands a
    vLLM backend only native media; the greedy trajectories are the same."""
    from envloop.experience.rollouts import run_multi_turn_rollout
    from tests.fixtures.vlm_envs import PictureBoardEnv

    logs, seen = [], []
    for flag in (False, True):
        backend = SeenColumns(
            {"base_urls": [server.url], "dialect": "llamacpp", "tokenizer": str(folder),
             "max_new_tokens": MAX_NEW_TOKENS}
        )  # fmt: skip
        prompt = [{"type": "image", "image": ROW_IMAGES[0][0]}, {"type": "text", "text": "Go."}]
        log = get_formatted_message_log(
            [{"role": "user", "content": prompt}], backend.processor, add_generation_prompt=True
        )
        batch = BatchedDataDict(
            message_log=[log], extra_env_info=[{"turns": 2, "size": 28, "text": "And now?"}],
            loss_multiplier=[1.0], idx=[0], task_name=["board"],
        )  # fmt: skip
        final, _ = run_multi_turn_rollout(
            backend, batch, backend.processor, {"board": PictureBoardEnv()}, max_seq_len=300,
            max_rollout_turns=2, greedy=True, observation_format="chat_template",
            deduplicate_multimodal_data=flag,
        )  # fmt: skip
        backend.shutdown()
        assert final["generation_error"] == [None] and final["num_turns"].tolist() == [2]
        logs.append([m["token_ids"].tolist() for m in final["message_log"][0]])
        seen.append(backend.seen)
    assert logs[0] == logs[1]
    assert {"images", "pixel_values", "image_grid_thw"} <= seen[0]
    assert {"images", "image_grid_thw"} <= seen[1] and "pixel_values" not in seen[1]
