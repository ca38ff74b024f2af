"""check_env reports every contract violation of an environment in one error."""

from __future__ import annotations

import pytest
import torch

from envloop.environments import EnvironmentContractError, check_env
from envloop.environments.checker import MissingMetadataError
from envloop.environments.interfaces import EnvironmentReturn
from tests.fixtures.envs import BadContractEnv, CalculatorEnv, EchoEnv, FailingEnv, _NoMetrics

LOGS = [
    [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "<answer>4</answer>"},
    ],
    [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "<call>2 + 3</call>"},
    ],
]
METADATA = [{"target": 4}, {"target": 5}]


class EverythingWrong(_NoMetrics):
    def step(self, message_log_batch, metadata, *args, **kwargs):
        return EnvironmentReturn(
            observations=[{"content": 1}, {"role": "user", "content": "x"}],
            metadata=[None],
            next_stop_strings=["</a>", None],
            rewards={"format": torch.zeros(2), "reward/x": torch.zeros(3)},
            terminateds=torch.zeros(2),
        )


def test_a_valid_environment_passes_and_returns_its_result():
    ret = check_env(CalculatorEnv(), LOGS, METADATA)
    assert ret.rewards.tolist() == [1.0, 0.0]
    assert [o["content"] for o in ret.observations] == ["correct", "<result>5</result>"]


def test_every_violation_is_listed():
    with pytest.raises(EnvironmentContractError) as info:
        check_env(EverythingWrong(), LOGS, METADATA)
    assert info.value.problems == [
        "metadata: expected 2 entries (one per sample), got 1",
        "observations[0]: expected {'role': str, 'content': str or a list of text/image "
        "parts}, got {'content': 1}",
        "next_stop_strings[0]: expected None or a list of non-empty str, got '</a>'",
        "rewards: dict key 'format' must look like 'reward/<name>'",
        "rewards['reward/x']: expected shape [2], got [3]",
        "terminateds: expected a bool tensor, got torch.float32",
    ]
    assert str(info.value).startswith("EverythingWrong breaks the environment contract:\n  - ")


def test_wrong_counts_and_dtypes():
    with pytest.raises(EnvironmentContractError) as info:
        check_env(BadContractEnv(), LOGS, METADATA)
    assert info.value.problems == [
        "observations: expected 2 entries (one per sample), got 1",
        "rewards: expected a float tensor, got torch.int64",
    ]


def test_a_raising_step_is_reported():
    with pytest.raises(EnvironmentContractError, match="step raised: RuntimeError: boom"):
        check_env(FailingEnv(), LOGS, METADATA)


class NeedsWord(EchoEnv):
    def step(self, message_log_batch, metadata, *args, **kwargs):
        [md["word"] for md in metadata]
        return super().step(message_log_batch, metadata)


def test_a_key_error_for_metadata_the_samples_lack_names_the_key():
    with pytest.raises(MissingMetadataError) as info:
        check_env(NeedsWord(), LOGS, METADATA)
    assert (info.value.key, info.value.present) == ("word", ["target"])
    assert info.value.problems == ["step raised: KeyError: 'word'"]
    assert str(info.value) == (
        "NeedsWord.step needs sample metadata key 'word', which none of the samples has "
        "(their metadata keys: target); step raised: KeyError: 'word'. Give samples whose "
        "metadata has 'word'."
    )
    assert check_env(NeedsWord(), LOGS, [{"word": "w"}, {"word": "v"}]).rewards.tolist() == [
        0.5,
        0.5,
    ]


def test_a_key_error_for_a_key_the_samples_have_is_the_environments_fault():
    class LooksElsewhere(EchoEnv):
        def step(self, message_log_batch, metadata, *args, **kwargs):
            return {}["target"]

    with pytest.raises(EnvironmentContractError) as info:
        check_env(LooksElsewhere(), LOGS, METADATA)
    assert type(info.value) is EnvironmentContractError
    assert info.value.problems == ["step raised: KeyError: 'target'"]


def test_bad_metrics_are_reported():
    class BadMetrics(EchoEnv):
        def global_post_process_and_metrics(self, batch):
            return batch, {"ok": 1.0, "bad": "text"}

    with pytest.raises(EnvironmentContractError, match="metrics: 'bad' is not a str -> number"):
        check_env(BadMetrics(), LOGS, METADATA)


def test_mismatched_samples_are_a_usage_error():
    with pytest.raises(ValueError, match="2 message logs but 1 metadata entries"):
        check_env(EchoEnv(), LOGS, METADATA[:1])


@pytest.mark.ray
def test_ray_actor_environments_are_checked_too(ray_session):
    from envloop.environments import create_env, register_env

    register_env("check_calc", "tests.fixtures.envs:CalculatorEnv", overwrite=True)
    register_env("check_bad", "tests.fixtures.envs:BadContractEnv", overwrite=True)
    assert check_env(create_env("check_calc", num_cpus=0), LOGS, METADATA).rewards.tolist() == [
        1.0,
        0.0,
    ]
    with pytest.raises(EnvironmentContractError, match="actor BadContractEnv breaks"):
        check_env(create_env("check_bad", num_cpus=0), LOGS, METADATA)

    class NeedsWordActor(EchoEnv):  # defined here, so Ray ships the class by value
        def step(self, message_log_batch, metadata, *args, **kwargs):
            return [md["word"] for md in metadata]

    register_env("check_needs_word", NeedsWordActor, overwrite=True)
    with pytest.raises(
        MissingMetadataError, match=r"^actor .*NeedsWordActor.step needs sample "
    ) as info:
        check_env(create_env("check_needs_word", num_cpus=0), LOGS, METADATA)
    assert info.value.problems == ["step raised: KeyError: 'word'"]
