"""``judge``: an LLM judge scores each response (or each prompt's group of responses).

The judge is any generation backend (``judge`` section: ``backend: hf`` loads the model in
the environment's actor, ``backend: server`` asks inference servers), prompted with a Jinja
template (:mod:`~envloop.environments.judge.templates`: built-in ``reference_equivalence``,
``rubric`` and ``group_comparison``, or a file) rendered with the conversation, the response
and the sample's metadata (``reference``/``ground_truth``, ``rubric``). Its reply is read by
a verdict parser (:mod:`~envloop.environments.judge.verdicts`: yes/no, a number in a range,
a JSON field, a label) as a score in [0, 1]; with ``num_judgements`` > 1 (sampled, not
greedy) the usable judgements' ``mean`` or ``majority`` is the score. The default judge is
``bundled:judge``, which judges the demo's arithmetic with ``reference_equivalence``.

**Modes.** ``sample``: one judge call per sample; the reward is its score. ``group``: the
samples of one prompt (the same messages before the first response) in one step are judged
in one call (``group_comparison``: every reply, one verdict line each); the reward is each
member's score, or (``group_reward: rank``) the share of the other members it beats (ties
count half). In the async engine the group's samples reach this environment together: it
answers ``scores_groups()`` True, and the engine holds each member until the group's last
one has finished generating (:mod:`envloop.experience.group_scoring`).

**Failures are per sample.** A judgement that the backend could not give (a server down
after its retries), that stopped at its token budget, or that no parser can read, is
unusable; a sample with no usable judgement (or a response over ``max_parse_chars``, or a
judge prompt over ``max_prompt_tokens``, or a template that fails on its data) fails: with
``on_failure: error`` (default) it comes back in ``errors`` (the engine ends it with
``loss_multiplier`` 0 and keeps the text), with ``on_failure: zero`` it scores 0 and its
metadata's ``judge.error`` says why. The other samples are judged as usual.

**What a step returns.** Reward: the score (or group reward) as float32; observation
``Environment: judge score 0.75``; metadata: the sample's, with ``judge`` (score, reward,
each judgement's text and score, error). The episode ends at ``pass_score`` or after
``max_attempts`` answers. Steps stream (``step_stream``/``astep_stream``): each sample (or
group) is handed back when judged, and concurrent steps share the backend's batching.
Metrics (``judge_env/``): judge calls and judgements, prompt and generated tokens, mean and
max latency, failed, truncated and unparseable judgements, failed samples, mean score and
agreement (share of equal pairs among a sample's repeated judgements).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator, Iterator
from typing import Any

from envloop.config.errors import ConfigError
from envloop.data.interfaces import LLMMessageLogType
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.distributed.loop_thread import LoopThread
from envloop.environments.groups import prompt_key
from envloop.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from envloop.environments.judge.calls import JudgeClient, make_backend
from envloop.environments.judge.config import (
    DEFAULTS,
    JudgeEnvConfig,
    config_problems,
    validate_config,
)
from envloop.environments.judge.metrics import JudgeMetrics
from envloop.environments.judge.outcomes import Judged, judged_return, score_replies
from envloop.environments.judge.templates import load_template, template_variables
from envloop.environments.judge.verdicts import aggregate, group_verdicts
from envloop.environments.utils import last_assistant_text, parse_cap_reason

__all__ = ["DEFAULTS", "JudgeEnvConfig", "JudgeEnvironment"]
Item = tuple[list[int], EnvironmentReturn]


class JudgeEnvironment(EnvironmentInterface):
    """Scores responses with an LLM judge; see the module docstring."""

    def __init__(self, config: JudgeEnvConfig | None = None) -> None:
        problems = config_problems(config)
        if problems:
            raise ConfigError("JudgeEnvConfig", problems)
        self.config = validate_config(config)
        self.template = load_template(self.config["template"])
        backend = make_backend(self.config["judge"])
        self.client = JudgeClient(backend, self.config["greedy"], self.config["max_prompt_tokens"])
        self.metrics = JudgeMetrics()
        self._loop: LoopThread | None = None

    @classmethod
    def config_problems(cls, config: Any) -> list[str]:
        return config_problems(config)

    @classmethod
    def actor_options(cls, config: Any) -> dict[str, Any]:
        """``num_cpus`` of the config as the actor's CPUs."""
        return {"num_cpus": validate_config(config)["num_cpus"]}

    def scores_groups(self) -> bool:
        """Whether this environment judges a prompt's samples together (``mode: group``):
        the async engine then steps a group's members in one call."""
        return self.config["mode"] == "group"

    def step(
        self, message_log_batch: list[LLMMessageLogType], metadata: list[Any], *args: Any, **kw: Any
    ) -> EnvironmentReturn:
        """Judge every sample (see the module docstring); rewards [B] float32, terminateds
        [B] bool, errors for the samples that failed (``on_failure: error``)."""
        results: dict[int, Judged] = {}
        for rows, judged in self._judged_sync(message_log_batch, metadata):
            results.update(zip(rows, judged))
        ordered = [results[i] for i in range(len(metadata))]
        return self._return(ordered, message_log_batch, metadata)

    def step_stream(
        self, message_log_batch: list[LLMMessageLogType], metadata: list[Any]
    ) -> Iterator[Item]:
        """``(rows, their return)`` as each sample (or group) is judged."""
        for rows, judged in self._judged_sync(message_log_batch, metadata):
            yield rows, self._return(judged, *_rows_of(message_log_batch, metadata, rows))

    async def astep_stream(
        self, message_log_batch: list[LLMMessageLogType], metadata: list[Any]
    ) -> AsyncIterator[Item]:
        """:meth:`step_stream` on the caller's event loop (a Ray actor's), so that the
        steps of concurrent calls overlap."""
        async for rows, judged in self._judged(message_log_batch, metadata):
            yield rows, self._return(judged, *_rows_of(message_log_batch, metadata, rows))

    def _judged_sync(self, logs: list[Any], metadata: list[Any]) -> Iterator[Any]:
        """:meth:`_judged`'s items, run on this environment's own event loop thread."""
        if self._loop is None:
            self._loop = LoopThread("envloop-judge")
        units = self._units(list(logs), list(metadata))
        futures = [self._loop.submit(_tagged(rows, coro)) for rows, coro in units]
        for future in concurrent.futures.as_completed(futures):
            yield future.result()

    async def _judged(self, logs: list[Any], metadata: list[Any]) -> AsyncIterator[Any]:
        """``(rows, their Judged)`` as each sample (or group) is judged."""
        units = self._units(list(logs), list(metadata))
        for future in asyncio.as_completed([_tagged(rows, coro) for rows, coro in units]):
            yield await future

    def _units(self, logs: list[Any], metadata: list[Any]) -> list[tuple[list[int], Any]]:
        """``(rows, coroutine judging them)``: one per sample, or one per prompt's group."""
        if self.config["mode"] == "sample":
            return [([i], self._judge_samples([log], [md])) for i, (log, md) in
                    enumerate(zip(logs, metadata))]  # fmt: skip
        groups: dict[str, list[int]] = {}
        for i, log in enumerate(logs):
            groups.setdefault(prompt_key(log), []).append(i)
        return [
            (rows, self._judge_group([logs[i] for i in rows], [metadata[i] for i in rows]))
            for rows in groups.values()
        ]

    async def _judge_samples(self, logs: list[Any], metadata: list[Any]) -> list[Judged]:
        log, md = logs[0], metadata[0]
        refused = self._refusal(log)
        if refused:
            return [self.metrics.count(Judged(None, f"judge: {refused}"))]
        try:
            prompt = self.template.render(template_variables(log, md))
        except ValueError as exc:
            return [self.metrics.count(Judged(None, f"judge: {exc}"))]
        replies = await self.client.judge(prompt, self.config["num_judgements"])
        cfg = self.config
        judged = score_replies(replies, cfg["verdict"], cfg["aggregate"], cfg["max_verdict_chars"])
        return [self.metrics.count(judged)]

    async def _judge_group(self, logs: list[Any], metadata: list[Any]) -> list[Judged]:
        """Every member judged in one call; members refused beforehand fail alone."""
        out: list[Judged | None] = [None] * len(logs)
        for k, log in enumerate(logs):
            refused = self._refusal(log)
            if refused:
                out[k] = Judged(None, f"judge: {refused}")
        members = [k for k, j in enumerate(out) if j is None]
        if members:
            texts = [last_assistant_text(logs[k]) for k in members]
            try:
                prompt = self.template.render(
                    template_variables(logs[members[0]], metadata[members[0]], texts)
                )
            except ValueError as exc:
                for k in members:
                    out[k] = Judged(None, f"judge: {exc}")
            else:
                for k, judged in zip(members, await self._group_judgements(prompt, len(texts))):
                    out[k] = judged
        members_judged = [j for j in out if j is not None]
        _set_group_rewards(members_judged, self.config["group_reward"])
        return [self.metrics.count(j) for j in members_judged]

    async def _group_judgements(self, prompt: str, size: int) -> list[Judged]:
        """Each of ``size`` members' :class:`Judged` from the judgements of one group prompt."""
        cfg = self.config
        replies = await self.client.judge(prompt, cfg["num_judgements"])
        per_member: list[list[Any]] = [[] for _ in range(size)]
        failures = [0] * size
        for reply in replies:
            if reply.error is not None or reply.truncated:
                why = reply.error or "judge reply cut at its token budget (max_new_tokens)"
                verdicts: list[Any] = [ValueError(why)] * size
            else:
                verdicts = group_verdicts(
                    reply.text, size, cfg["verdict"], cfg["max_verdict_chars"]
                )
                for k, v in enumerate(verdicts):
                    failures[k] += isinstance(v, Exception)
            for k, v in enumerate(verdicts):
                per_member[k].append(v)
        texts = [r.text for r in replies]
        out = []
        for k, verdicts in enumerate(per_member):
            scores = [None if isinstance(v, Exception) else v for v in verdicts]
            usable = [s for s in scores if s is not None]
            error = None if usable else "judge: " + "; ".join(dict.fromkeys(map(str, verdicts)))
            score = aggregate(usable, cfg["aggregate"]) if usable else None
            out.append(Judged(score, error, texts, scores, failures[k]))
        return out

    def _refusal(self, log: Any) -> str | None:
        return parse_cap_reason(
            "response", len(last_assistant_text(log)), self.config["max_parse_chars"]
        )

    def _return(self, judged: list[Judged], logs: list[Any], metadata: list[Any]) -> Any:
        attempts = [sum(m.get("role") == "assistant" for m in log) for log in logs]
        return judged_return(judged, metadata, attempts, self.config)

    def global_post_process_and_metrics(
        self, batch: BatchedDataDict[Any]
    ) -> tuple[BatchedDataDict[Any], dict[str, Any]]:
        """The batch unchanged, and the ``judge_env/`` metrics since the last call."""
        return batch, self.metrics.take(self.client.take_counts())

    def shutdown(self) -> None:
        """Stop the judge backend and the event loop thread."""
        client = getattr(self, "client", None)
        if client is not None:
            client.shutdown()
            self.client = None  # type: ignore[assignment]
        if getattr(self, "_loop", None) is not None:
            self._loop.close(wait=True)  # type: ignore[union-attr]
            self._loop = None


def _set_group_rewards(judged: list[Judged], how: str) -> None:
    """Each member's reward: its score, or (``rank``) the share of the other scored members
    it beats, ties counting half (its score when it is the only one scored)."""
    scored = [(j, j.score) for j in judged if j.score is not None]
    for j, score in scored:
        others = [s for o, s in scored if o is not j]
        if how == "score" or not others:
            j.reward = score
        else:
            wins = sum(1.0 if score > s else 0.5 if score == s else 0.0 for s in others)
            j.reward = wins / len(others)


async def _tagged(rows: list[int], judging: Any) -> tuple[list[int], list[Judged]]:
    return rows, await judging


def _rows_of(logs: list[Any], metadata: list[Any], rows: list[int]) -> tuple[list, list]:
    return [logs[i] for i in rows], [metadata[i] for i in rows]
