"""Vision-language rollouts end to end: a tiny Qwen2.5-VL through HfGeneration, images in
prompts and in observations of a Ray-actor environment, both engines."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForImageTextToText

from envloop.data.llm_message_utils import get_formatted_message_log
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.environments.registry import create_env, register_env
from envloop.experience.rollouts import (
    ExperienceStream,
    run_async_multi_turn_rollout,
    run_async_multi_turn_rollout_groups,
    run_multi_turn_rollout,
)
from envloop.models.generation.hf_generation import HfGeneration
from envloop.models.generation.interfaces import GenerationInterface
from envloop.models.tiny_vlm import save_tiny_vlm
from tests.fixtures.images import noise_image
from tests.fixtures.vlm_envs import PictureBoardEnv

pytestmark = [pytest.mark.ray, pytest.mark.slow]

register_env("test_picture_board", "tests.fixtures.vlm_envs:PictureBoardEnv", overwrite=True)

TEMPERATURE = 1.3


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm"))


@pytest.fixture(scope="module")
def policy(vlm_dir):
    return HfGeneration(
        {
            "model_name": str(vlm_dir),
            "max_new_tokens": 6,
            "temperature": TEMPERATURE,
            "seed": 3,
            "micro_batch_size": 2,  # the third sample joins a running batch
        }
    )


def picture_batch(processor, metadata: list[dict]) -> BatchedDataDict:
    prompts = [
        [{"type": "image", "image": noise_image(0, 60, 90)}, {"type": "text", "text": "Look."}],
        "No picture here.",
        [
            {"type": "text", "text": "Two:"},
            {"type": "image", "image": noise_image(1, 28, 56)},
            {"type": "image", "image": noise_image(2, 70, 40)},
        ],
    ]
    logs = [
        get_formatted_message_log(
            [{"role": "user", "content": content}], processor, add_generation_prompt=True
        )
        for content in prompts
    ]
    return BatchedDataDict(
        message_log=logs,
        length=[sum(len(m["token_ids"]) for m in log) for log in logs],
        extra_env_info=metadata,
        loss_multiplier=[1.0] * len(logs),
        idx=list(range(len(logs))),
        task_name=["board"] * len(logs),
    )


def board_metadata(extra: dict[int, dict] | None = None) -> list[dict]:
    extra = extra or {}
    return [{"turns": 3, "size": 28 * (i + 1), **extra.get(i, {})} for i in range(3)]


def teacher_forced_logprobs(model, log: list[dict]) -> torch.Tensor:
    """Log-probabilities of every token after the first, the whole conversation with all
    its images in one forward pass (the model computes its own positions)."""
    ids = torch.cat([m["token_ids"] for m in log])[None]
    vision = {}
    for key in ("pixel_values", "image_grid_thw"):
        parts = [m[key].as_tensor() for m in log if key in m]
        if parts:
            vision[key] = torch.cat(parts)
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            mm_token_type_ids=(ids == model.config.image_token_id).int(),
            **vision,
        ).logits[0]
    reference = torch.log_softmax(logits[:-1].float() / TEMPERATURE, dim=-1)
    return reference.gather(-1, ids[0, 1:, None]).squeeze(-1)


def test_multi_turn_rollout_with_images_is_token_exact(ray_session, policy, vlm_dir):
    processor = policy.processor
    batch = picture_batch(processor, board_metadata())
    env = create_env("test_picture_board", num_cpus=0)
    final, metrics = run_multi_turn_rollout(
        policy, batch, processor, {"board": env}, max_seq_len=400, max_rollout_turns=3,
        observation_format="chat_template",
    )  # fmt: skip
    assert final["num_turns"].tolist() == [3, 3, 3]
    assert final["total_reward"].tolist() == [3.0, 3.0, 3.0]
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    merge = model.config.vision_config.spatial_merge_size
    for i, log in enumerate(final["message_log"]):
        assert [m["role"] for m in log] == ["user", "assistant"] * 3 + ["user"]
        # Every observation's picture went to the policy: its own size, its placeholders.
        for turn, message in enumerate(log[2::2], start=1):
            assert message["content"][1]["text"] == f"Turn {turn}: what now?"
            grid = message["image_grid_thw"].as_tensor()
            side = 2 * (i + 1)  # 14-pixel patches
            assert grid.tolist() == [[1, side, side]]
            placeholders = int((message["token_ids"] == model.config.image_token_id).sum())
            assert placeholders == int(grid.prod()) // merge**2
        # Each generated token's logprob equals a teacher-forced pass over the whole
        # conversation with every image: nothing re-tokenized, every image in its place.
        reference = teacher_forced_logprobs(model, log)
        position = 0
        for message in log:
            n = len(message["token_ids"])
            if message["role"] == "assistant":
                torch.testing.assert_close(
                    message["generation_logprobs"],
                    reference[position - 1 : position + n - 1],
                    atol=1e-4,
                    rtol=0,
                )
            position += n
    assert metrics["total_turns"] == 9


def test_async_engine_gives_the_sync_logs_with_images(ray_session, policy):
    processor = policy.processor
    env = create_env("test_picture_board", num_cpus=0)
    logs = []
    for rollout in (run_multi_turn_rollout, run_async_multi_turn_rollout):
        result = rollout(
            policy, picture_batch(processor, board_metadata()), processor, {"board": env},
            max_seq_len=400, max_rollout_turns=3, greedy=True,
            observation_format="chat_template",
        )  # fmt: skip
        final, _ = asyncio.run(result) if asyncio.iscoroutine(result) else result
        logs.append(final["message_log"])
    for sync_log, async_log in zip(*logs):
        assert [m["token_ids"].tolist() for m in sync_log] == [
            m["token_ids"].tolist() for m in async_log
        ]
        torch.testing.assert_close(
            torch.cat([m["generation_logprobs"] for m in sync_log if m["role"] == "assistant"]),
            torch.cat([m["generation_logprobs"] for m in async_log if m["role"] == "assistant"]),
            atol=1e-5,
            rtol=0,
        )


def test_an_unreadable_observation_image_fails_only_its_sample(ray_session, policy):
    processor = policy.processor
    batch = picture_batch(processor, board_metadata({1: {"bad_image": True}}))
    env = create_env("test_picture_board", num_cpus=0)
    final, metrics = run_multi_turn_rollout(
        policy, batch, processor, {"board": env}, max_seq_len=400, max_rollout_turns=3,
        observation_format="chat_template",
    )  # fmt: skip
    assert final["num_turns"].tolist() == [3, 1, 3]
    assert list(final["loss_multiplier"]) == [1.0, 0.0, 1.0]
    assert "is not a readable image" in final["env_error"][1]
    assert final["env_error"][0] is None and final["env_error"][2] is None
    assert metrics["env_error_rate"] == pytest.approx(1 / 3)


def test_images_in_observations_need_a_processor_and_a_template(ray_session, policy):
    processor = policy.processor
    env = create_env("test_picture_board", num_cpus=0)
    final, _ = run_multi_turn_rollout(
        policy, picture_batch(processor, board_metadata()), processor, {"board": env},
        max_seq_len=400, max_rollout_turns=3, observation_format="raw",
    )  # fmt: skip
    assert final["num_turns"].tolist() == [1, 1, 1]
    assert all("need observation_format='chat_template'" in e for e in final["env_error"])


def test_worker_actors_generate_with_the_images(ray_session, policy, vlm_dir):
    """With num_workers > 1 each row's vision inputs travel to the worker that decodes it."""
    workers = HfGeneration(
        {"model_name": str(vlm_dir), "max_new_tokens": 6, "num_workers": 2, "worker_num_cpus": 0}
    )
    try:
        assert workers.processor is not None
        batch = picture_batch(policy.processor, board_metadata())
        final, _ = run_multi_turn_rollout(
            workers, batch, workers.processor, {"board": PictureBoardEnv()}, max_seq_len=400,
            max_rollout_turns=2, greedy=True, observation_format="chat_template",
        )  # fmt: skip
        local, _ = run_multi_turn_rollout(
            policy, picture_batch(policy.processor, board_metadata()), policy.processor,
            {"board": PictureBoardEnv()}, max_seq_len=400, max_rollout_turns=2, greedy=True,
            observation_format="chat_template",
        )  # fmt: skip
    finally:
        workers.shutdown()
    assert final["num_turns"].tolist() == [2, 2, 2]
    for remote_log, local_log in zip(final["message_log"], local["message_log"]):
        assert [m["token_ids"].tolist() for m in remote_log] == [
            m["token_ids"].tolist() for m in local_log
        ]


class SeenColumns(GenerationInterface):
    """The module's policy, recording the columns of every generation input it is handed."""

    def __init__(self, inner: HfGeneration) -> None:
        self.inner, self.columns = inner, set()

    def generate(self, data, greedy=False):
        self.columns.update(data)
        return self.inner.generate(data, greedy=greedy)


def test_deduplicated_multimodal_data_hands_the_policy_only_its_vision_inputs(policy):
    """deduplicate_multimodal_data, passed where NeMo-RL's signatures take it (positionally
    after greedy): HfGeneration reads the vision input columns, so the images column is
    left out of its inputs; the trajectories are the same."""
    processor = policy.processor

    def run(engine, *flag: bool):
        seen = SeenColumns(policy)
        batch = picture_batch(processor, board_metadata())
        envs = {"board": PictureBoardEnv()}
        if engine == "groups":

            async def collect():
                groups = run_async_multi_turn_rollout_groups(
                    seen, batch, processor, envs, 400, 3, 2, True, *flag,
                    observation_format="chat_template",
                )  # fmt: skip
                return [group.final_batch async for group in groups]

            [final] = asyncio.run(collect())
        elif engine == "stream":
            rows = [{key: batch[key][i] for key in batch} for i in range(batch.size)]

            async def stream_rows():
                stream = ExperienceStream(
                    seen, rows, processor, envs, 400, 2, True, group_size=1,
                    deduplicate_multimodal_data=bool(flag and flag[0]),
                    observation_format="chat_template",
                )  # fmt: skip
                groups = sorted([g async for g in stream], key=lambda g: g.indices)
                return BatchedDataDict.from_batches([g.batch for g in groups])

            final = asyncio.run(stream_rows())
        else:
            final, _ = engine(
                seen, batch, processor, envs, 400, 2, True, *flag,
                observation_format="chat_template",
            )  # fmt: skip
        assert final["num_turns"].tolist() == [2, 2, 2]
        return [[m["token_ids"].tolist() for m in log] for log in final["message_log"]], seen

    reference, seen = run(run_multi_turn_rollout)
    assert {"images", "pixel_values", "image_grid_thw"} <= seen.columns
    for engine in (run_multi_turn_rollout, run_async_multi_turn_rollout, "groups", "stream"):
        logs, seen = run(engine, True)
        assert logs == reference
        assert {"pixel_values", "image_grid_thw"} <= seen.columns and "images" not in seen.columns


def test_a_stream_groups_members_share_their_prompts_vision_inputs(policy):
    """ExperienceStream repeats a prompt for its group with share_immutable_media=True: the
    members' prompt messages are their own dicts, their vision inputs the same tensors."""
    processor = policy.processor
    batch = picture_batch(processor, board_metadata())
    row = {key: batch[key][0] for key in batch}  # the prompt with one image

    async def first_group():
        async with ExperienceStream(
            policy, [row], processor, {"board": PictureBoardEnv()}, 400, 1, True,
            group_size=2, observation_format="chat_template",
        ) as stream:  # fmt: skip
            return await anext(stream)

    group = asyncio.run(first_group())
    first, second = (log[0] for log in group.batch["message_log"])
    assert first is not second and first["token_ids"] is not second["token_ids"]
    assert torch.equal(first["token_ids"], second["token_ids"])
    # PackedTensors of their own, holding the same tensor objects.
    assert [
        t is u for t, u in zip(first["pixel_values"].tensors, second["pixel_values"].tensors)
    ] == [True]
    assert group.batch["num_turns"].tolist() == [1, 1]
