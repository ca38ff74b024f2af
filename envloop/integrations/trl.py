"""envloop's multi-turn rollouts as a TRL ``GRPOTrainer(rollout_func=...)``, and its rewards
as a TRL reward function, so a ``GRPOTrainer`` trains on envloop environments with no
generation or reward code of its own::

    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=envloop_reward,
        rollout_func=envloop_rollout_func(
            policy, {"math": env}, max_seq_len=512, max_rollout_turns=4,
            sample_for_prompt=lambda prompt: ("math", {"ground_truth": answers[prompt]}),
            observation_format="chat_template",
        ),
        args=GRPOConfig(...),
        train_dataset=dataset,
    )

Needs the ``trl`` extra (``pip install 'envloop[trl]'``); this module itself imports no trl.
Tested with TRL 1.16.0 (transformers 5.24, torch 2.13, CPU).

**The contract, as TRL 1.16.0's ``trl/trainer/grpo_trainer.py`` reads it** (``RolloutFunc``,
``GRPOTrainer._generate``, ``_generate_and_score_completions``, ``_calculate_rewards``):

- TRL calls ``rollout_func(prompts, trainer)``. ``prompts`` holds one row per completion it
  expects: its ``RepeatSampler`` repeats every dataset prompt ``num_generations`` times in a
  row (``[p0, p0, p1, p1, ...]``), and TRL groups rewards as ``view(-1, num_generations)``. A
  prompt is a string or a list of ``{role, content}`` messages; no other dataset column comes
  with it (reward functions get those columns, the rollout does not).
- It must return ``prompt_ids``, ``completion_ids`` and ``logprobs`` (lists of per-row lists);
  ``env_mask`` (1 = the model's token, 0 = an external one) is popped and used as the tool
  mask: the loss, the token count that normalizes it and the logged completion lengths count
  only ``completion_mask * env_mask``. Every other key is an extra field: a list is handed
  out row by row (anything else goes to every row) as a column that reward functions
  receive as a keyword argument.
- A completion whose last token is not EOS or pad counts as truncated
  (``completions/clipped_ratio``, and ``mask_truncated_completions`` drops it). So the
  completion ends with the last assistant turn: an environment reply after it (the math
  environment's final verdict, which the chat template closes with the next assistant
  prefix) is left out, or every episode would read as truncated. A last turn that ended
  at a stop string (``</action>``) or at ``max_seq_len`` does read as truncated: with such
  tasks, leave ``mask_truncated_completions`` off.
- ``logprobs`` are the sampling log-probabilities; TRL reads them only with vLLM
  (``vllm_importance_sampling_correction``) or ``off_policy_mask_threshold``, always under the
  same ``completion_mask * env_mask``, so the 0 at environment tokens is never used.
  ``HfGeneration`` reports the log-probability under the distribution it sampled from
  (temperature, top-k and top-p applied).
- A reward function that returns ``None`` for a row makes it unscorable: it is left out of its
  group's mean and its advantage is 0. TRL's ``max_completion_length`` does not bound a
  ``rollout_func``'s completions: ``max_seq_len`` does (prompt plus completion).

**Weights.** Before each rollout, when ``trainer.state.global_step`` has moved since the last
one (and before the first), the trainer's weights are copied into the policy with
``policy.update_weights(state_dict, version=global_step)``, so ``policy.policy_version`` is
the trainer's step and envloop's ``min/max_policy_version`` say which step generated a
sample. They are copied, never shared, even for an ``HfGeneration`` on the trainer's device:
its decode loop runs on a thread of its own, and expects its weights to change only between
two decode steps, through ``update_weights`` (which also stamps every token with its
version); a module shared with the trainer would be changed by the optimizer under any row
still in flight (the async engine, an abandoned row), and would generate in training mode
(dropout) with whatever wrapping the trainer added. A copy costs one model's memory and one
copy per step. A trainer whose model *is* the policy's model is refused. PEFT models are not
supported (their state dict holds adapter keys, which ``update_weights`` rejects, listing
them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch

from envloop.config.errors import ConfigError
from envloop.data.datasets import PromptSample, build_rollout_batch, prompt_message_logs
from envloop.data.message_tokens import text_only_tokenizer
from envloop.data.tokenization import tokenize_texts
from envloop.environments.registry import unknown_name_message
from envloop.experience.rollout_options import AsyncRolloutOptions, RolloutOptions
from envloop.experience.rollout_state import check_limits
from envloop.experience.rollouts import run_async_multi_turn_rollout, run_multi_turn_rollout

if TYPE_CHECKING:
    from envloop.data.interfaces import LLMMessageLogType
    from envloop.distributed.batched_data_dict import BatchedDataDict
    from envloop.models.generation.interfaces import GenerationInterface

Prompt = Any
"""What TRL hands over per row: a string, or a list of ``{role, content}`` messages."""

Engine = Literal["sync", "async"]
TextPrompts = Literal["chat_template", "raw"]

TOTAL_REWARD = "envloop_total_reward"
"""Extra field: each sample's ``total_reward`` (float), what :func:`envloop_reward` returns."""
TURNS = "envloop_turns"
"""Extra field: each sample's ``num_turns`` (int)."""
ERROR = "envloop_error"
"""Extra field: each sample's environment or generation error text, or None."""
TRUNCATED = "envloop_truncated"
"""Extra field: whether the sample reached ``max_seq_len`` (bool)."""
MIN_POLICY_VERSION = "envloop_min_policy_version"
"""Extra field: the oldest policy version among the sample's generated tokens (-1: none)."""
MAX_POLICY_VERSION = "envloop_max_policy_version"
"""Extra field: the newest policy version among the sample's generated tokens (-1: none)."""
ROLLOUT_METRICS = "envloop_rollout_metrics"
"""Extra field (one dict for every row): the rollout's metrics, which :func:`envloop_reward`
logs as ``envloop/<name>``."""


class PromptTask(NamedTuple):
    """What a prompt alone does not say: the task that scores it and its environment's
    per-sample metadata (``extra_env_info``, e.g. ``{"ground_truth": "42"}``)."""

    task_name: str
    extra_env_info: Mapping[str, Any]


class TrlSample(NamedTuple):
    """One rollout as TRL's ``rollout_func`` returns it; the last three have one entry per
    completion token."""

    prompt_ids: list[int]
    completion_ids: list[int]
    """The tokens after the prompt up to the end of the last assistant turn."""
    logprobs: list[float]
    """Generation log-probabilities; 0.0 at environment tokens."""
    env_mask: list[int]
    """1 at tokens the policy generated, 0 at environment tokens."""


class EnvloopRolloutFunc:
    """A TRL ``rollout_func``: made by :func:`envloop_rollout_func`, which documents it.

    Attributes:
        last_batch: the final batch of the latest rollout (envloop's columns: message logs,
            rewards, turns, errors, policy versions), or None before the first.
        last_metrics: that rollout's metrics.
    """

    def __init__(
        self,
        policy: GenerationInterface,
        task_to_env: Mapping[str, Any],
        *,
        max_seq_len: int,
        max_rollout_turns: int,
        sample_for_prompt: Callable[[Prompt], tuple[str, Mapping[str, Any]]] | None,
        engine: Engine,
        tokenizer: Any,
        stop_strings: Mapping[str, list[str] | None] | None,
        text_prompts: TextPrompts,
        greedy: bool,
        rollout_options: Mapping[str, Any],
    ) -> None:
        tokenizer = tokenizer if tokenizer is not None else _policy_tokenizer(policy)
        problems = _argument_problems(task_to_env, sample_for_prompt, engine, text_prompts)
        problems += _limit_problems(max_seq_len, max_rollout_turns)
        problems += _option_problems(engine, rollout_options)
        if tokenizer is None:
            problems.append("the policy has no tokenizer attribute: pass tokenizer=")
        if problems:
            raise ConfigError("envloop_rollout_func arguments", problems)
        self.policy = policy
        self.task_to_env = dict(task_to_env)
        self.max_seq_len, self.max_rollout_turns = max_seq_len, max_rollout_turns
        self.sample_for_prompt = sample_for_prompt
        self.engine, self.tokenizer, self.greedy = engine, tokenizer, greedy
        self.stop_strings = dict(stop_strings or {})
        self.text_prompts = text_prompts
        self.rollout_options = dict(rollout_options)
        self.last_batch: BatchedDataDict[Any] | None = None
        self.last_metrics: dict[str, Any] = {}
        self._synced_step: int | None = None

    def __call__(self, prompts: list[Prompt], trainer: Any) -> dict[str, Any]:
        """Sync the trainer's weights if its step moved, roll out one sample per prompt and
        return TRL's columns (see :func:`envloop_rollout_func`)."""
        self.sync_weights(trainer)
        batch = self.input_batch(prompts)
        prompt_messages = [len(log) for log in batch["message_log"]]
        final, metrics = self._roll_out(batch)
        self.last_batch, self.last_metrics = final, metrics
        return trl_columns(final, prompt_messages, self._pad_id(), metrics)

    def sync_weights(self, trainer: Any) -> None:
        """Copy the trainer's weights into the policy as version ``global_step``, unless
        that step's weights are already there."""
        step = int(trainer.state.global_step)
        if step == self._synced_step:
            return
        model = trainer.accelerator.unwrap_model(trainer.model)
        _refuse_shared_module(self.policy, model)
        self.policy.update_weights(model.state_dict(), version=step)
        self._synced_step = step

    def input_batch(self, prompts: Sequence[Prompt]) -> BatchedDataDict[Any]:
        """The rollout input: one ``DatumSpec`` row per prompt, tokenized by envloop (a
        conversation, or a string as the user's message, with the chat template and the
        generation prompt; a string as is with ``text_prompts="raw"``)."""
        samples = [self._sample(i, prompt) for i, prompt in enumerate(prompts)]
        raw = [self.text_prompts == "raw" and isinstance(p, str) for p in prompts]
        templated = iter(
            prompt_message_logs([s for s, r in zip(samples, raw) if not r], self.tokenizer)
        )
        logs = [self._raw_log(s) if r else next(templated) for s, r in zip(samples, raw)]
        return build_rollout_batch(
            samples, self.tokenizer, stop_strings=self.stop_strings, message_logs=logs
        )

    def _sample(self, idx: int, prompt: Prompt) -> PromptSample:
        task = self._task_of(prompt)
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = [dict(message) for message in prompt]
        info = dict(task.extra_env_info)
        return PromptSample(idx, task.task_name, messages, info.get("ground_truth"), info)

    def _task_of(self, prompt: Prompt) -> PromptTask:
        if self.sample_for_prompt is None:
            return PromptTask(next(iter(self.task_to_env)), {})
        task = PromptTask(*self.sample_for_prompt(prompt))
        if task.task_name not in self.task_to_env:
            message = unknown_name_message("task", task.task_name, list(self.task_to_env))
            raise ValueError(f"sample_for_prompt({prompt!r}): {message}")
        return task

    def _raw_log(self, sample: PromptSample) -> LLMMessageLogType:
        text = sample.messages[0]["content"]
        ids = tokenize_texts(text_only_tokenizer(self.tokenizer), [text])[0]
        return [{"role": "user", "content": text, "token_ids": torch.tensor(ids, dtype=torch.long)}]

    def _roll_out(self, batch: BatchedDataDict[Any]) -> tuple[BatchedDataDict[Any], dict]:
        args = (self.policy, batch, self.tokenizer, self.task_to_env, self.max_seq_len)
        kwargs = {
            "max_rollout_turns": self.max_rollout_turns,
            "greedy": self.greedy,
            **self.rollout_options,
        }
        if self.engine == "async":
            return asyncio.run(run_async_multi_turn_rollout(*args, **kwargs))
        return run_multi_turn_rollout(*args, **kwargs)

    def _pad_id(self) -> int:
        tokenizer = text_only_tokenizer(self.tokenizer)
        pad = tokenizer.pad_token_id
        return int(pad if pad is not None else tokenizer.eos_token_id)


def envloop_rollout_func(
    policy: GenerationInterface,
    task_to_env: Mapping[str, Any],
    *,
    max_seq_len: int,
    max_rollout_turns: int = 999999,
    sample_for_prompt: Callable[[Prompt], tuple[str, Mapping[str, Any]]] | None = None,
    engine: Engine = "sync",
    tokenizer: Any = None,
    stop_strings: Mapping[str, list[str] | None] | None = None,
    text_prompts: TextPrompts = "chat_template",
    greedy: bool = False,
    **rollout_options: Any,
) -> EnvloopRolloutFunc:
    """A ``rollout_func`` for ``trl.GRPOTrainer`` that runs envloop's multi-turn rollouts.

    Given the prompts TRL hands it (one row per completion), it syncs the trainer's weights
    into ``policy`` when the trainer's step has moved (see the module docstring), runs one
    rollout per row and returns, per row (lists of lists of ints or floats):

    - ``prompt_ids``: the prompt's tokens as the policy saw them.
    - ``completion_ids``: the tokens after the prompt up to the end of the last assistant
      turn, assistant and environment tokens in order (an environment reply after the last
      assistant turn is not part of it). A sample that generated nothing gets one pad token.
    - ``logprobs``: generation log-probabilities, 0.0 at environment tokens.
    - ``env_mask``: 1 at the policy's tokens, 0 at environment tokens (TRL trains on the
      1s only); all 0 for a failed sample (envloop's ``loss_multiplier`` 0).
    - the extra fields :data:`TOTAL_REWARD`, :data:`TURNS`, :data:`ERROR`,
      :data:`TRUNCATED`, :data:`MIN_POLICY_VERSION`, :data:`MAX_POLICY_VERSION` (one value
      per row) and :data:`ROLLOUT_METRICS`, which :func:`envloop_reward` reads.

    Args:
        policy: the generation backend; it must implement ``update_weights``
            (``HfGeneration``) and have ``tokenizer`` unless ``tokenizer`` is given.
        task_to_env: task name -> environment (a Ray actor handle or an in-process one).
        max_seq_len: no sample ever exceeds this many tokens, prompt included.
        max_rollout_turns: turns (generation + environment step) per sample at most.
        sample_for_prompt: prompt -> ``(task_name, extra_env_info)`` (a :class:`PromptTask`
            or any pair), e.g. its ground truth: TRL gives the rollout only the prompt. None:
            every prompt goes to the only task of ``task_to_env`` with empty metadata.
        engine: ``sync`` runs ``run_multi_turn_rollout``; ``async`` runs
            ``run_async_multi_turn_rollout`` (every sample's turns on their own, with
            ``asyncio.run``: call it from a thread with no running event loop).
        tokenizer: what envloop tokenizes prompts and observations with; None: the policy's
            processor if it has one, else its tokenizer.
        stop_strings: task name -> its first turn's stop strings (the environment sets the
            later turns'); tasks not named stop only at EOS.
        text_prompts: ``chat_template``: a string prompt is the user's message, rendered
            with the chat template and generation prompt (as ``envloop run`` does);
            ``raw``: a string is tokenized as is (as TRL's own generation does).
            Conversational prompts always go through the chat template.
        greedy: greedy decoding instead of sampling.
        **rollout_options: the engine's options (``observation_format``,
            ``env_step_timeout_s``, ``on_env_error``, ...; with ``async`` also
            ``max_concurrent_samples``, ...), validated here.

    >>> envloop_rollout_func(None, {"math": None, "code": None}, max_seq_len=0, tokenizer="t")
    Traceback (most recent call last):
    ...
    envloop.config.errors.ConfigError: Invalid envloop_rollout_func arguments:
      - task_to_env has 2 tasks (math, code): pass sample_for_prompt, which names each prompt's task
      - max_seq_len must be a positive int, got 0
    """
    return EnvloopRolloutFunc(
        policy,
        task_to_env,
        max_seq_len=max_seq_len,
        max_rollout_turns=max_rollout_turns,
        sample_for_prompt=sample_for_prompt,
        engine=engine,
        tokenizer=tokenizer,
        stop_strings=stop_strings,
        text_prompts=text_prompts,
        greedy=greedy,
        rollout_options=rollout_options,
    )


def envloop_reward(completions: list[Any], **kwargs: Any) -> list[float | None]:
    """A TRL reward function: envloop's total reward of each sample, from the extra fields of
    :func:`envloop_rollout_func`. A failed sample gets None (TRL leaves it out of its group's
    baseline and gives it advantage 0). With TRL's ``log_metric``, the rollout's numeric
    metrics are logged as ``envloop/<name>``.

    >>> envloop_reward(
    ...     ["a", "b"], envloop_total_reward=[1.0, 0.0], envloop_error=[None, "env math: boom"]
    ... )
    [1.0, None]
    """
    totals = kwargs.get(TOTAL_REWARD)
    if totals is None:
        raise ValueError(
            f"envloop_reward reads the {TOTAL_REWARD!r} field that envloop_rollout_func "
            "returns; pass GRPOTrainer(rollout_func=envloop_rollout_func(...)) as well."
        )
    errors = kwargs.get(ERROR) or [None] * len(totals)
    log_metric, metrics = kwargs.get("log_metric"), kwargs.get(ROLLOUT_METRICS)
    if log_metric is not None and metrics:
        for name, value in numeric_metrics(metrics[0]).items():
            log_metric(f"envloop/{name}", value)
    return [None if error else float(total) for total, error in zip(totals, errors)]


def trl_columns(
    final: BatchedDataDict[Any],
    prompt_messages: Sequence[int],
    pad_id: int,
    metrics: Mapping[str, Any],
) -> dict[str, Any]:
    """What the rollout func returns to TRL, from a rollout's final batch; ``prompt_messages``:
    how many messages of each sample's log are its prompt."""
    samples = [
        trl_sample(log, n, pad_id, trained=float(multiplier) > 0)
        for log, n, multiplier in zip(
            final["message_log"], prompt_messages, final["loss_multiplier"]
        )
    ]
    errors = [env or gen for env, gen in zip(final["env_error"], final["generation_error"])]
    return {
        "prompt_ids": [s.prompt_ids for s in samples],
        "completion_ids": [s.completion_ids for s in samples],
        "logprobs": [s.logprobs for s in samples],
        "env_mask": [s.env_mask for s in samples],
        TOTAL_REWARD: final["total_reward"].tolist(),
        TURNS: final["num_turns"].tolist(),
        ERROR: errors,
        TRUNCATED: final["truncated"].tolist(),
        MIN_POLICY_VERSION: final["min_policy_version"].tolist(),
        MAX_POLICY_VERSION: final["max_policy_version"].tolist(),
        ROLLOUT_METRICS: dict(metrics),
    }


def trl_sample(
    message_log: LLMMessageLogType, prompt_messages: int, pad_id: int, trained: bool = True
) -> TrlSample:
    """One sample's TRL columns: the first ``prompt_messages`` messages are the prompt, the
    completion runs to the end of the last assistant message. ``trained`` False (a failed
    sample) masks every token.

    >>> ids = lambda *t: torch.tensor(t)
    >>> log = [
    ...     {"role": "user", "token_ids": ids(1, 2)},
    ...     {"role": "assistant", "token_ids": ids(3, 4), "generation_logprobs": ids(-0.5, -1.0)},
    ...     {"role": "environment", "token_ids": ids(5)},
    ...     {"role": "assistant", "token_ids": ids(6), "generation_logprobs": ids(-0.25)},
    ...     {"role": "environment", "token_ids": ids(7, 8)},
    ... ]
    >>> sample = trl_sample(log, prompt_messages=1, pad_id=0)
    >>> sample.prompt_ids, sample.completion_ids, sample.env_mask
    ([1, 2], [3, 4, 5, 6], [1, 1, 0, 1])
    >>> sample.logprobs
    [-0.5, -1.0, 0.0, -0.25]
    """
    prompt = [int(t) for m in message_log[:prompt_messages] for t in m["token_ids"].tolist()]
    turns = message_log[prompt_messages:]
    last = max((i for i, m in enumerate(turns) if m["role"] == "assistant"), default=-1)
    ids: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    for message in turns[: last + 1]:
        tokens = [int(t) for t in message["token_ids"].tolist()]
        generated = message["role"] == "assistant"
        ids += tokens
        if generated:
            logprobs += [float(x) for x in message["generation_logprobs"].tolist()]
        else:
            logprobs += [0.0] * len(tokens)
        mask += [int(generated and trained)] * len(tokens)
    if not ids:
        return TrlSample(prompt, [pad_id], [0.0], [0])
    return TrlSample(prompt, ids, logprobs, mask)


def numeric_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The metrics that are plain numbers (bools and nested values left out).

    >>> numeric_metrics({"total_turns": 6, "rate": 0.5, "flag": True, "per_task": {}})
    {'total_turns': 6.0, 'rate': 0.5}
    """
    return {
        name: float(value)
        for name, value in metrics.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def _policy_tokenizer(policy: Any) -> Any:
    """The policy's processor if it has one (so prompts may hold images), else its tokenizer."""
    processor = getattr(policy, "processor", None)
    return processor if processor is not None else getattr(policy, "tokenizer", None)


def _argument_problems(
    task_to_env: Mapping[str, Any],
    sample_for_prompt: Callable[..., Any] | None,
    engine: str,
    text_prompts: str,
) -> list[str]:
    """What is wrong with these arguments of :func:`envloop_rollout_func`."""
    problems = []
    if not task_to_env:
        problems.append("task_to_env is empty: give at least one task -> environment")
    elif sample_for_prompt is None and len(task_to_env) > 1:
        problems.append(
            f"task_to_env has {len(task_to_env)} tasks ({', '.join(task_to_env)}): pass "
            "sample_for_prompt, which names each prompt's task"
        )
    if engine not in ("sync", "async"):
        problems.append(f"engine must be 'sync' or 'async', got {engine!r}")
    if text_prompts not in ("chat_template", "raw"):
        problems.append(f"text_prompts must be 'chat_template' or 'raw', got {text_prompts!r}")
    return problems


def _limit_problems(max_seq_len: int, max_rollout_turns: int) -> list[str]:
    """The engine's own complaints about these limits (see ``check_limits``)."""
    try:
        check_limits(max_seq_len, max_rollout_turns)
    except ValueError as exc:
        return str(exc).split("; ")
    return []


def _option_problems(engine: str, rollout_options: Mapping[str, Any]) -> list[str]:
    """The engine's own complaints about its keyword options."""
    options = AsyncRolloutOptions if engine == "async" else RolloutOptions
    try:
        options.from_mapping(rollout_options)
    except ConfigError as exc:
        return exc.problems
    return []


def _refuse_shared_module(policy: Any, model: torch.nn.Module) -> None:
    """Raise if the trainer trains the very tensors the policy generates with."""
    served = getattr(policy, "model", None)
    if not isinstance(served, torch.nn.Module):
        return
    pointers = {p.data_ptr() for p in served.parameters()}
    if any(p.data_ptr() in pointers for p in model.parameters()):
        raise ValueError(
            "The trainer's model shares its weights with the policy's model: the optimizer "
            "would change them under the policy's decode loop. Give GRPOTrainer its own copy "
            "(e.g. the model's folder); envloop_rollout_func copies its weights into the policy."
        )
