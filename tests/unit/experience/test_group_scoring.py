"""The async engine's group hook: an environment that scores groups gets each prompt's
samples in one call, once the group's last member has finished generating, however far apart
the members finish; members that ended early are not waited for."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from envloop.environments.groups import prompt_key
from envloop.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from envloop.experience.rollouts import run_async_multi_turn_rollout, run_multi_turn_rollout
from envloop.models.generation.scripted_generation import ScriptedGeneration
from tests.fixtures.batches import make_batch


class StaggeredPolicy(ScriptedGeneration):
    """Streams its rows back one at a time, last row first, 20 ms apart (ten coalescing
    windows): without the hook, every sample would reach its environment alone. A row
    whose script says ``fail`` comes back as a failed generation (as a server's would)."""

    async def generate_async(self, data: Any, greedy: bool = False) -> Any:
        out = self.generate(data, greedy)
        for row in reversed(range(len(out["output_ids"]))):
            await asyncio.sleep(0.02)
            one = out.slice(row, row + 1)
            start = int(data["input_lengths"][row])
            failed = self.tokenizer.decode(one["output_ids"][0, start:]).startswith("fail")
            one["generation_error"] = ["server down" if failed else None]
            yield row, one


class GroupSizeEnv(EnvironmentInterface):
    """Rewards each sample with the number of samples of its prompt in the same call."""

    def __init__(self, groups: bool) -> None:
        self.groups, self.calls = groups, []

    def scores_groups(self) -> bool:
        return self.groups

    def step(self, logs: list[Any], metadata: list[Any], *args: Any, **kw: Any) -> Any:
        keys = [prompt_key(log) for log in logs]
        self.calls.append(len(logs))
        n = len(logs)
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": "ok"}] * n,
            metadata=metadata,
            next_stop_strings=[None] * n,
            rewards=torch.tensor([float(keys.count(k)) for k in keys]),
            terminateds=torch.ones(n, dtype=torch.bool),
        )

    def global_post_process_and_metrics(self, batch: Any) -> Any:
        return batch, {}


def respond_fail_once(prompt_text: str, seen: dict[str, int]) -> str:
    """Short answers; the first generation for "Fails first." fails."""
    count = seen[prompt_text] = seen.get(prompt_text, 0) + 1
    return "fail" if "Fails first." in prompt_text and count == 1 else "short answer"


def rollout(tokenizer: Any, groups: bool, engine: Any) -> tuple[Any, GroupSizeEnv]:
    prompts = ["Alpha?", "Beta?", "Fails first."]
    samples = [{"task": "judge", "prompt": p} for p in prompts for _ in range(3)]
    seen: dict[str, int] = {}
    policy = StaggeredPolicy(tokenizer, lambda text: respond_fail_once(text, seen))
    env = GroupSizeEnv(groups)
    batch = make_batch(tokenizer, samples)
    final, _ = engine(policy, batch, tokenizer, {"judge": env}, 96)
    return final, env


def run_async(*args: Any) -> Any:
    return asyncio.run(run_async_multi_turn_rollout(*args))


def test_async_engine_steps_each_group_together(tiny_tokenizer):
    final, env = rollout(tiny_tokenizer, True, run_async)
    # "Fails first." lost a member (its generation failed): the other two went on together.
    assert final["generation_error"].count(None) == 8
    assert final["total_reward"].tolist() == [3.0] * 6 + [0.0, 2.0, 2.0]
    assert sorted(env.calls) == [2, 3, 3]


def test_sync_engine_steps_a_turn_together(tiny_tokenizer):
    """The sync engine steps a turn's samples in one call (its policy's ``generate`` never
    fails here): every group is complete in it."""
    final, env = rollout(tiny_tokenizer, True, run_multi_turn_rollout)
    assert final["total_reward"].tolist() == [3.0] * 9
    assert env.calls == [9]
