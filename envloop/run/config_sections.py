"""The sections of the ``envloop run`` config (see :mod:`envloop.run.config`).

Each field's help text is what ``envloop``'s config reference (README) shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from envloop.config.schema import at_least, meta, option

GROUND_TRUTH_ENVS = ("math", "vlm")
"""Registered environments that score against each sample's ground truth."""


@dataclass(kw_only=True)
class PolicyConfig:
    """The policy that generates responses."""

    backend: Literal["hf"] = option("hf", "generation backend: hf (transformers, CPU or GPU)")
    model: str = option(
        "bundled:policy",
        "local folder, hub id (e.g. Qwen/Qwen3-0.6B) or bundled:policy (the tiny demo policy)",
    )
    tokenizer: str | None = option(None, "tokenizer folder or hub id; null: the model's")
    device: Literal["cpu", "cuda", "auto"] = option("cpu", "auto: cuda when available")
    dtype: Literal["float32", "bfloat16", "float16"] = option("float32", "weights dtype")
    temperature: float = option(1.0, "sampling temperature", check=at_least(0, above=True))
    top_p: float = option(1.0, "nucleus sampling mass in (0, 1]", check=at_least(0, above=True))
    top_k: int | None = option(None, "keep the k most likely tokens; null: all", check=at_least(1))
    max_new_tokens: int = option(64, "most tokens generated per turn", check=at_least(1))
    seed: int = option(0, "sampling seed (worker i uses seed + i)", check=at_least(0))
    num_workers: int = option(1, "1: generate in this process; N: N Ray actors", check=at_least(1))
    micro_batch_size: int = option(32, "rows decoded together per forward pass", check=at_least(1))
    cpu_threads: int | None = option(
        1,
        "torch threads of each process that generates on CPU; null: one per core "
        "(slower when other processes share the cores)",
        check=at_least(1),
    )


@dataclass(kw_only=True)
class EnvConfig:
    """One task's environment, started as a Ray actor."""

    name: str = option(help="registered environment name (envloop envs) or module:Class path")
    config: dict[str, Any] | None = field(
        default=None, metadata=meta("the environment's config; null: its defaults")
    )
    num_cpus: float | None = option(
        None, "CPUs Ray reserves for the actor; null: 0", check=at_least(0)
    )
    stop_strings: list[str] | None = field(
        default=None,
        metadata=meta("stop strings of the first turn; later turns use the environment's"),
    )
    requires_ground_truth: bool | None = option(
        None, f"every row needs a ground truth; null: true for {', '.join(GROUND_TRUTH_ENVS)}"
    )

    def needs_ground_truth(self) -> bool:
        """Whether this task's rows must carry a ground truth."""
        if self.requires_ground_truth is not None:
            return self.requires_ground_truth
        return self.name in GROUND_TRUTH_ENVS


@dataclass(kw_only=True)
class RolloutConfig:
    """The rollout loop (``run_multi_turn_rollout``)."""

    max_seq_len: int = option(512, "no sample exceeds this many tokens", check=at_least(1))
    max_turns: int = option(
        4, "turns (generation + environment step) per sample", check=at_least(1)
    )
    generations_per_prompt: int = option(1, "samples per prompt (GRPO groups)", check=at_least(1))
    batch_size: int = option(64, "samples rolled out together", check=at_least(1))
    mode: Literal["sync", "async"] = option("sync", "sync: batch by batch; async: not yet")
    observation_format: Literal["raw", "chat_template"] = option(
        "chat_template", "chat_template: observations rendered as chat messages; raw: as is"
    )
    on_env_error: Literal["record", "raise"] = option(
        "record", "record: a failing step ends only its samples; raise: stop the run"
    )
    env_step_timeout_s: float | None = option(
        None, "seconds one environment step may take; null: no limit", check=at_least(0, above=True)
    )
    greedy: bool = option(False, "greedy decoding instead of sampling")


@dataclass(kw_only=True)
class RayConfig:
    """The Ray session environments (and policy workers) run in."""

    address: str | None = option(None, "cluster to join; null: $RAY_ADDRESS or a local session")
    num_cpus: int | None = option(2, "CPUs of a local session; null: all", check=at_least(1))
    log_to_driver: bool = option(False, "show actors' output on this terminal")


@dataclass(kw_only=True)
class OutputConfig:
    """Where the run directory goes."""

    dir: str = option("runs/latest", "run directory (created; files in it are replaced)")
