"""``code``: the model runs Python in ``<code>...</code>``; tests in the metadata score the episode.

Each turn the last ``<code>...</code>`` block of the response runs in a sandbox
(:mod:`envloop.environments.code.sandbox`: its own process, time/CPU/memory/output limits, no
network, no host files; read its threat model) and the reply is ``<result>\\n...</result>``:
what the code printed (stdout and stderr), the repr of its final expression's value when not
None (as in a notebook), then the error as the traceback's last line(s) or why the run was
stopped. Generation stops after ``</code>`` (``stop_strings``).

State persists by replay: ``metadata["cells"]`` lists the episode's cells and every turn
re-runs them, quietly, in a fresh sandbox before the new one. This keeps the environment
stateless (a restarted Ray actor, or another one, continues any episode; nothing to clean
up) and honest (the state is exactly what the listed cells produce). The cost: turn T
re-executes T - 1 cells (quadratic in the turns; the time limits cover the replay), side
effects such as file writes repeat, and time-dependent values can differ (``random`` and
string hashing are seeded, so those repeat). A cell that raised stays in the list (it raises
again on replay, keeping what it did before the error, as in a notebook); a cell that was
stopped (a limit, a crash) is dropped, as a notebook kernel would have died.

The episode ends when a response holds no complete ``<code>`` block (the model's "done"), or
after the code of turn ``max_turns`` (``metadata["max_turns"]``, else the config's). Then the
tests run on the episode's state: ``metadata["tests"]`` is a list of Python statements,
usually ``assert`` lines, and the reward is the fraction that raise nothing (0 with no tests
or no cells; other turns get 0). A first response without code thus gets reward 0 and an
observation that explains the format.

A response longer than ``max_parse_chars`` is not parsed at all: the episode ends with
reward 0, no code runs, and the reason is in the observation and ``metadata["code_error"]``
(``"response has 1,200,000 characters, over max_parse_chars=1,000,000; raise
max_parse_chars to score it"``; counted in ``code_env/over_max_parse_chars``). Metadata that
is not a mapping, or whose keys above have the wrong types (``tests`` not a list of str,
say), is a dataset bug: it raises before any code runs, which fails that sample alone
through ``EnvironmentReturn.errors``
(:class:`~envloop.environments.sample_environment.SampleEnvironment`): the rollout records
the error on it and does not train on it, and the other samples go on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

import torch

from envloop.config import validation
from envloop.config.errors import ConfigError
from envloop.data.interfaces import LLMMessageLogType
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.environments.code.config import (
    DEFAULTS,
    CodeEnvConfig,
    config_problems,
    with_defaults,
)
from envloop.environments.code.sandbox import run_cells, sandbox_limits
from envloop.environments.common.answer_extraction import extract_tag
from envloop.environments.sample_environment import SampleEnvironment, SampleStep
from envloop.environments.utils import last_assistant_text, parse_cap_reason

__all__ = ["DEFAULTS", "CodeEnvConfig", "CodeEnvMetadata", "CodeEnvironment"]

_NO_CODE = "No complete <code>...</code> block in the response, so the episode ends"


class CodeEnvMetadata(TypedDict, total=False):
    """Per-sample metadata: ``tests`` and ``max_turns`` from the data; the rest kept here."""

    tests: list[str]  # Python statements run on the final state; reward = fraction passed
    max_turns: int  # overrides the config's max_turns for this sample
    cells: list[str]  # the episode's cells so far (replayed each turn)
    turns: int  # code turns taken so far


class CodeEnvironment(SampleEnvironment[CodeEnvMetadata]):
    """Runs each response's code in a sandbox and scores finished episodes by their tests;
    a batch's sandboxes run ``num_workers`` at a time."""

    def __init__(self, cfg: CodeEnvConfig | None = None) -> None:
        problems = self.config_problems(cfg)
        if problems:
            raise ConfigError("CodeEnvConfig", problems)
        options = with_defaults(cfg)
        self.limits = sandbox_limits(options)
        self.max_turns: int = options["max_turns"]
        self.stop_strings: list[str] = list(options["stop_strings"])
        self.max_concurrent_samples = options["num_workers"]
        self.max_parse_chars: int = options["max_parse_chars"]

    @classmethod
    def config_problems(cls, config: Any) -> list[str]:
        """Every problem of ``config`` (:func:`.code.config.config_problems`)."""
        return config_problems(config)

    def global_post_process_and_metrics(
        self, batch: BatchedDataDict[Any]
    ) -> tuple[BatchedDataDict[Any], dict[str, float]]:
        """Metrics: mean reward, rate of episodes passing every test, mean code turns, and
        the count of final responses over ``max_parse_chars``."""
        rewards = torch.as_tensor(batch["total_reward"], dtype=torch.float32)
        infos = [md if isinstance(md, Mapping) else {} for md in batch.get("extra_env_info") or []]
        turns = [md["turns"] if isinstance(md.get("turns"), int) else 0 for md in infos]
        responses = [last_assistant_text(log) for log in batch.get("message_log") or []]
        n = max(len(rewards), 1)
        return batch, {
            "code_env/mean_reward": float(rewards.sum()) / n,
            "code_env/all_tests_passed_rate": float((rewards == 1.0).sum()) / n,
            "code_env/mean_code_turns": sum(turns) / max(len(turns), 1),
            "code_env/over_max_parse_chars": sum(len(r) > self.max_parse_chars for r in responses),
        }

    def step_sample(
        self, messages: LLMMessageLogType, metadata: CodeEnvMetadata | None
    ) -> SampleStep:
        """One turn: run the response's code, or end the episode and score it; a response
        over ``max_parse_chars`` ends it unscored. Bad metadata raises ValueError (failing
        this sample only)."""
        response = last_assistant_text(messages)
        problem = _metadata_problem(metadata)
        if problem:
            raise ValueError(problem)
        too_long = parse_cap_reason("response", len(response), self.max_parse_chars)
        if too_long:
            return _unscored(metadata, too_long)
        md: CodeEnvMetadata = {**(metadata or {})}
        code, cells = extract_tag(response, "code"), list(md.get("cells", []))
        if code is None:
            reward, score = self._score(cells, _tests(md))
            if not cells:
                text = f"{_NO_CODE} with reward 0. Write Python between <code> and </code>."
            else:
                text = f"{_NO_CODE}: {score}."
            return SampleStep(text, reward, True, metadata=md)
        result = run_cells([*cells, code], (), self.limits)
        md["cells"] = [*cells, code][: result.cells_finished]
        md["turns"] = md.get("turns", 0) + 1
        content = f"<result>\n{result.report()}</result>"
        if md["turns"] < md.get("max_turns", self.max_turns):
            observation = {"role": "tool", "content": content}
            stops = list(self.stop_strings)
            return SampleStep(
                observation, 0.0, False, metadata=md, next_stop_strings=stops, answer=code
            )
        reward, score = self._score(md["cells"], _tests(md))
        content += f"\nTurn limit reached, so the episode ends: {score}."
        return SampleStep(
            {"role": "tool", "content": content}, reward, True, metadata=md, answer=code
        )

    def _score(self, cells: list[str], tests: list[str]) -> tuple[float, str]:
        """The reward (fraction of tests passed on the cells' state) and its description."""
        if not tests:
            return 0.0, "no tests to score (reward 0)"
        passed = run_cells(cells, tests, self.limits).tests_passed if cells else 0
        return passed / len(tests), f"{passed}/{len(tests)} tests passed"


def _tests(md: CodeEnvMetadata) -> list[str]:
    return md.get("tests") or []


def _metadata_problem(metadata: Any) -> str | None:
    """Why a sample's metadata cannot run an episode, or None (None is a fresh episode
    without tests; keys other than :class:`CodeEnvMetadata`'s are the data's own).

    >>> _metadata_problem({"tests": "assert f(1) == 2", "id": 3})
    "metadata: tests: expected list[str], got str ('assert f(1) == 2')"
    >>> _metadata_problem([1, 2]), _metadata_problem({"max_turns": 2}) is None
    ('metadata: expected a mapping, got list', True)
    """
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        return f"metadata: expected a mapping, got {type(metadata).__name__}"
    own = {k: v for k, v in metadata.items() if k in CodeEnvMetadata.__annotations__}
    problems = validation.config_problems(CodeEnvMetadata, own)
    return "metadata: " + "; ".join(problems) if problems else None


def _unscored(metadata: CodeEnvMetadata | None, why: str) -> SampleStep:
    """The episode ends, unscored: reward 0, ``why`` in the observation and metadata."""
    text = f"Not scored, so the episode ends with reward 0: {why}."
    return SampleStep(text, 0.0, True, metadata={**(metadata or {}), "code_error": why})
