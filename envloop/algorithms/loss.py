"""The clipped policy-gradient loss (PPO-clip, as GRPO and DAPO use it) on the logprobs the
sampler reported with each generated token."""

from __future__ import annotations

import torch

__all__ = ["clipped_pg_loss"]


def clipped_pg_loss(
    logprobs: torch.Tensor,
    generation_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    token_level: bool = True,
    tis_cap: float | None = None,
    old_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate loss over the trainable tokens, and its metrics.

    Per trainable token, with r the ratio below and A the advantage:
    ``loss_t = -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)``
    (``clip_high > clip_low`` is DAPO's clip-higher). ``token_level=True`` averages
    ``loss_t`` over every trainable token of the batch (DAPO's token-level loss);
    ``token_level=False`` averages each sequence over its trainable tokens, then the
    sequences that have any (GRPO's sample-level loss).

    The ratio. Without ``tis_cap`` and ``old_logprobs``, r = exp(logprobs -
    generation_logprobs): the sampler is PPO's old policy, so the ratio also corrects
    for any mismatch between the sampler and the trainer.
    With ``tis_cap`` (truncated importance sampling, for a sampler whose numbers differ
    from the trainer's: vLLM, other kernels, older weights), the mismatch is corrected by
    the weight ``w = min(exp(anchor - generation_logprobs), tis_cap)``, detached, which
    multiplies ``loss_t``, and the ratio is taken to the trainer's own logprobs,
    r = exp(logprobs - anchor), where the anchor is ``old_logprobs`` (the trainer's
    logprobs before this round of updates, NeMo-RL's ``prev_logprobs``) or, when none
    are given, ``logprobs.detach()`` (r = 1 with the policy gradient as its gradient).
    This is what NeMo-RL's ``ClippedPGLossFn`` (``nemo_rl/algorithms/loss/
    loss_functions.py``, ``truncated_importance_sampling_type="tis"``), TRL's
    ``GRPOTrainer`` (``vllm_importance_sampling_cap``) and verl's rollout correction
    (``rollout_is_threshold``) do; weighting a ratio that is itself taken to the sampler
    would count the mismatch twice (r * w ~ r**2). ``old_logprobs`` without ``tis_cap``
    is plain PPO on the trainer's old logprobs.

    Tokens where ``mask`` is 0 take no part: their values may be anything, even inf or
    nan. A batch with no trainable token returns a loss of 0 that is still connected to
    ``logprobs`` (``backward()`` works and gives zero gradients), and all metrics 0.

    Args:
        logprobs: [B, L] the trainer's logprob of each token (with grad).
        generation_logprobs: [B, L] the sampler's logprob of each token (a training
            batch's ``generation_logprobs``).
        advantages: [B] (one per sequence, broadcast over its tokens) or [B, L].
        mask: [B, L] 0/1 or bool, 1 at trainable tokens.
        clip_low: the ratio's lower clip is 1 - clip_low; in [0, 1).
        clip_high: the ratio's upper clip is 1 + clip_high; >= 0.
        token_level: average over tokens (True) or over sequences (False).
        tis_cap: the truncated importance-sampling weight's cap (> 0; e.g. 2.0); None: no
            weight.
        old_logprobs: [B, L] the trainer's logprobs before this round of updates, when it
            makes several updates per batch; None: see above.

    Returns:
        ``(loss, metrics)``: ``loss`` a scalar tensor; ``metrics`` floats (reading them
        synchronises with the device): ``clip_fraction`` (trainable tokens where the
        clipped term was the smaller), ``ratio_mean`` (of r), ``kl_sampler_trainer``
        (k3 estimate of KL(sampler || trainer): the mean of exp(d) - d - 1 with
        d = logprobs - generation_logprobs, unbiased for that direction because the tokens
        were drawn from the sampler), ``trainable_tokens``; with ``tis_cap`` also
        ``tis_weight_mean`` and ``tis_capped_fraction`` (tokens whose weight hit the cap).

    >>> logprobs = torch.tensor([[-1.0, -0.5]], requires_grad=True)
    >>> loss, metrics = clipped_pg_loss(logprobs, torch.tensor([[-1.0, -1.0]]),
    ...                                 torch.tensor([1.0]), torch.tensor([[1, 1]]))
    >>> round(loss.item(), 4), metrics["clip_fraction"]  # -(1 + 1.2) / 2: token 2 clipped
    (-1.1, 0.5)
    """
    _check_args(logprobs, generation_logprobs, advantages, mask, old_logprobs)
    _check_clips(clip_low, clip_high, tis_cap)
    trainable = mask != 0
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    anchor = generation_logprobs if tis_cap is None else logprobs.detach()
    if old_logprobs is not None:
        anchor = old_logprobs
    ratio = _masked(logprobs - anchor, trainable).exp()
    advantages = _masked(advantages, trainable)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    token_loss = -torch.minimum(unclipped, clipped)
    if tis_cap is not None:
        weight = _masked(anchor.detach() - generation_logprobs, trainable).exp().clamp(max=tis_cap)
        token_loss = token_loss * weight
    token_loss = _masked(token_loss, trainable)
    loss = _mean_loss(token_loss, trainable, token_level)
    with torch.no_grad():
        metrics = _metrics(logprobs, generation_logprobs, ratio, clipped < unclipped, trainable)
        if tis_cap is not None:
            metrics |= _tis_metrics(weight, tis_cap, trainable)
    return loss, metrics


def _mean_loss(
    token_loss: torch.Tensor, trainable: torch.Tensor, token_level: bool
) -> torch.Tensor:
    """The token-level or sequence-level mean of ``token_loss`` [B, L] (0 at untrainable
    tokens); 0, connected to the graph, when nothing is trainable."""
    if token_level:
        return token_loss.sum() / trainable.sum().clamp(min=1)
    tokens = trainable.sum(dim=1)
    per_sequence = token_loss.sum(dim=1) / tokens.clamp(min=1)
    return per_sequence.sum() / (tokens > 0).sum().clamp(min=1)


def _masked(values: torch.Tensor, trainable: torch.Tensor) -> torch.Tensor:
    """``values`` at trainable tokens, 0 elsewhere (no nan or inf leaks from padding, and
    no gradient flows there)."""
    return torch.where(trainable, values, 0.0)


def _metrics(
    logprobs: torch.Tensor,
    generation_logprobs: torch.Tensor,
    ratio: torch.Tensor,
    clipped: torch.Tensor,
    trainable: torch.Tensor,
) -> dict[str, float]:
    count = int(trainable.sum())
    denominator = max(count, 1)
    d = _masked(logprobs - generation_logprobs, trainable)
    k3 = _masked(d.exp() - d - 1, trainable)
    return {
        "clip_fraction": float((clipped & trainable).sum()) / denominator,
        "ratio_mean": float(_masked(ratio, trainable).sum()) / denominator,
        "kl_sampler_trainer": float(k3.sum()) / denominator,
        "trainable_tokens": float(count),
    }


def _tis_metrics(weight: torch.Tensor, cap: float, trainable: torch.Tensor) -> dict[str, float]:
    denominator = max(int(trainable.sum()), 1)
    return {
        "tis_weight_mean": float(_masked(weight, trainable).sum()) / denominator,
        "tis_capped_fraction": float(((weight >= cap) & trainable).sum()) / denominator,
    }


def _check_args(
    logprobs: torch.Tensor,
    generation_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor | None,
) -> None:
    """Raise ``ValueError`` naming every tensor whose shape does not fit ``logprobs`` [B, L]."""
    if logprobs.dim() != 2 or not logprobs.is_floating_point():
        raise ValueError(
            f"logprobs must be a float [B, L] tensor, got {logprobs.dtype} of shape "
            f"{tuple(logprobs.shape)}."
        )
    shape = tuple(logprobs.shape)
    tensors = {"generation_logprobs": generation_logprobs, "mask": mask}
    if old_logprobs is not None:
        tensors["old_logprobs"] = old_logprobs
    problems = [
        f"{name} has shape {tuple(t.shape)}"
        for name, t in tensors.items()
        if tuple(t.shape) != shape
    ]
    if tuple(advantages.shape) not in (shape, shape[:1]):
        problems.append(f"advantages has shape {tuple(advantages.shape)} (want [B] or [B, L])")
    if problems:
        raise ValueError(
            f"clipped_pg_loss takes [B, L] tensors like logprobs {shape}: "
            + "; ".join(problems)
            + ". Align every per-token tensor with the same tokens (training_batch's columns are)."
        )


def _check_clips(clip_low: float, clip_high: float, tis_cap: float | None) -> None:
    problems = []
    if not 0 <= clip_low < 1:
        problems.append(
            f"clip_low must be in [0, 1) (the lower clip is 1 - clip_low), got {clip_low}"
        )
    if clip_high < 0:
        problems.append(
            f"clip_high must be >= 0 (the upper clip is 1 + clip_high), got {clip_high}"
        )
    if tis_cap is not None and tis_cap <= 0:
        problems.append(f"tis_cap must be > 0 (e.g. 2.0) or None, got {tis_cap}")
    if problems:
        raise ValueError("; ".join(problems) + ".")
