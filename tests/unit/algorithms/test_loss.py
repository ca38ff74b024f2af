"""clipped_pg_loss against a direct evaluation of the PPO-clip formula, token by token, and
its gradient."""

from __future__ import annotations

import math

import pytest
import torch

from envloop.algorithms.loss import clipped_pg_loss

B, L = 4, 7


def random_inputs(seed: int, per_token_advantages: bool = False):
    generator = torch.Generator().manual_seed(seed)
    generation = -torch.rand(B, L, generator=generator, dtype=torch.float64) * 3
    logprobs = generation + torch.randn(B, L, generator=generator, dtype=torch.float64) * 0.3
    shape = (B, L) if per_token_advantages else (B,)
    advantages = torch.randn(*shape, generator=generator, dtype=torch.float64)
    mask = (torch.rand(B, L, generator=generator) < 0.7).long()
    mask[0] = 0  # a sequence with no trainable token
    mask[1, 0] = 1
    return logprobs.requires_grad_(), generation, advantages, mask


def reference_terms(logprobs, generation, advantages, mask, low, high, anchor=None, cap=None):
    """Per sequence, the list of (loss term, chose-clipped) of its trainable tokens, as
    written in the PPO and TIS papers, one token at a time."""
    anchor = generation if anchor is None else anchor
    sequences = []
    for b in range(B):
        terms = []
        for t in range(L):
            if not mask[b, t]:
                continue
            a = advantages[b, t] if advantages.dim() == 2 else advantages[b]
            ratio = torch.exp(logprobs[b, t] - anchor[b, t])
            unclipped = ratio * a
            clipped = torch.clamp(ratio, 1 - low, 1 + high) * a
            term = -torch.minimum(unclipped, clipped)
            if cap is not None:
                term = term * min(math.exp(float(anchor[b, t] - generation[b, t])), cap)
            terms.append((term, bool(clipped < unclipped)))
        sequences.append(terms)
    return sequences


def token_mean(sequences):
    terms = [term for terms in sequences for term, _ in terms]
    return torch.stack(terms).sum() / len(terms)


def sequence_mean(sequences):
    means = [torch.stack([t for t, _ in terms]).mean() for terms in sequences if terms]
    return torch.stack(means).mean()


def gradient(loss, logprobs):
    (grad,) = torch.autograd.grad(loss, logprobs)
    return grad


@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("per_token_advantages", [False, True])
@pytest.mark.parametrize(("low", "high"), [(0.2, 0.2), (0.2, 0.28), (0.1, 0.5)])
def test_loss_and_gradient_equal_the_formula(token_level, per_token_advantages, low, high):
    for seed in range(3):
        logprobs, generation, advantages, mask = random_inputs(seed, per_token_advantages)
        loss, metrics = clipped_pg_loss(
            logprobs, generation, advantages, mask,
            clip_low=low, clip_high=high, token_level=token_level,
        )  # fmt: skip
        sequences = reference_terms(logprobs, generation, advantages, mask, low, high)
        expected = token_mean(sequences) if token_level else sequence_mean(sequences)
        assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
        torch.testing.assert_close(gradient(loss, logprobs), gradient(expected, logprobs))
        chosen = [clip for terms in sequences for _, clip in terms]
        assert metrics["clip_fraction"] == pytest.approx(sum(chosen) / len(chosen))
        assert metrics["trainable_tokens"] == float(mask.sum())


def test_gradient_is_minus_ratio_times_advantage_where_unclipped_and_zero_where_clipped():
    logprobs, generation, advantages, mask = random_inputs(5)
    loss, _ = clipped_pg_loss(logprobs, generation, advantages, mask)
    grad = gradient(loss, logprobs)
    ratio = torch.exp(logprobs.detach() - generation)
    a = advantages[:, None].expand(B, L)
    clipped = ((ratio > 1.2) & (a > 0)) | ((ratio < 0.8) & (a < 0))
    expected = torch.where(clipped | (mask == 0), 0.0, -ratio * a / mask.sum())
    torch.testing.assert_close(grad, expected)


def test_clip_higher_keeps_a_positive_token_the_symmetric_clip_cuts():
    generation = torch.zeros(1, 2, dtype=torch.float64)
    logprobs = torch.log(torch.tensor([[1.25, 0.7]], dtype=torch.float64)).requires_grad_()
    advantages, mask = torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2)
    loss, metrics = clipped_pg_loss(logprobs, generation, advantages, mask)
    # 1.25 clips to 1.2; 0.7 with A > 0 keeps its (smaller) unclipped term
    assert loss.item() == pytest.approx(-(1.2 + 0.7) / 2) and metrics["clip_fraction"] == 0.5
    loss, metrics = clipped_pg_loss(logprobs, generation, advantages, mask, clip_high=0.28)
    assert loss.item() == pytest.approx(-(1.25 + 0.7) / 2) and metrics["clip_fraction"] == 0.0
    assert gradient(loss, logprobs)[0].tolist() == pytest.approx([-1.25 / 2, -0.7 / 2])


def test_truncated_importance_sampling_weights_the_on_policy_term():
    logprobs, generation, advantages, mask = random_inputs(7)
    cap = 1.1
    loss, metrics = clipped_pg_loss(logprobs, generation, advantages, mask, tis_cap=cap)
    anchor = logprobs.detach()
    sequences = reference_terms(logprobs, generation, advantages, mask, 0.2, 0.2, anchor, cap)
    expected = token_mean(sequences)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    # The ratio to the trainer's own logprobs is 1: the gradient is -w * A / N exactly.
    weight = torch.exp(logprobs.detach() - generation).clamp(max=cap)
    a = advantages[:, None].expand(B, L)
    torch.testing.assert_close(
        gradient(loss, logprobs), torch.where(mask == 0, 0.0, -weight * a / mask.sum())
    )
    trainable = mask == 1
    assert metrics["ratio_mean"] == pytest.approx(1.0) and metrics["clip_fraction"] == 0.0
    assert metrics["tis_weight_mean"] == pytest.approx(weight[trainable].mean().item())
    capped = (weight[trainable] >= cap).double().mean().item()
    assert 0 < capped < 1 and metrics["tis_capped_fraction"] == pytest.approx(capped)


def test_truncated_importance_sampling_with_old_logprobs_clips_the_ratio_to_them():
    logprobs, generation, advantages, mask = random_inputs(8)
    old = generation + 0.25 * torch.randn(B, L, generator=torch.Generator().manual_seed(1))
    loss, _ = clipped_pg_loss(
        logprobs, generation, advantages, mask, tis_cap=2.0, old_logprobs=old, token_level=False
    )
    sequences = reference_terms(logprobs, generation, advantages, mask, 0.2, 0.2, old, 2.0)
    expected = sequence_mean(sequences)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    torch.testing.assert_close(gradient(loss, logprobs), gradient(expected, logprobs))


def test_metrics_on_a_small_batch():
    generation = torch.tensor([[-1.0, -1.0, -2.0]])
    logprobs = torch.tensor([[-1.0, -0.5, 9.0]])  # the third token is not trainable
    mask = torch.tensor([[1, 1, 0]])
    _, metrics = clipped_pg_loss(logprobs, generation, torch.tensor([-1.0]), mask)
    d = 0.5  # second token: ratio e**0.5 > 1.2 but A < 0, so the unclipped term is chosen
    assert metrics == pytest.approx(
        {
            "clip_fraction": 0.0,
            "ratio_mean": (1 + math.exp(d)) / 2,
            "kl_sampler_trainer": (math.exp(d) - d - 1) / 2,
            "trainable_tokens": 2.0,
        }
    )


def test_k3_estimates_kl_from_sampler_to_trainer():
    # Tokens in exactly the sampler's proportions (q = 0.2, 0.3, 0.5: 2, 3 and 5 of 10), so
    # the mean of k3 over them is its expectation under q: KL(q || p), not KL(p || q).
    p = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    q = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    tokens = torch.tensor([0] * 2 + [1] * 3 + [2] * 5)
    logprobs, generation = p.log()[tokens][None], q.log()[tokens][None]
    _, metrics = clipped_pg_loss(logprobs, generation, torch.zeros(1), torch.ones_like(logprobs))
    kl_q_p = float((q * (q / p).log()).sum())
    kl_p_q = float((p * (p / q).log()).sum())
    assert metrics["kl_sampler_trainer"] == pytest.approx(kl_q_p, rel=1e-12)
    assert abs(kl_q_p - kl_p_q) > 0.03  # the two directions differ here


def test_no_trainable_token_gives_a_zero_loss_that_backpropagates():
    logprobs = torch.full((2, 3), -1.0, requires_grad=True)
    loss, metrics = clipped_pg_loss(
        logprobs, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3), token_level=False
    )
    assert loss.item() == 0.0 and loss.grad_fn is not None
    loss.backward()
    assert logprobs.grad is not None and logprobs.grad.tolist() == [[0.0] * 3] * 2
    assert set(metrics.values()) == {0.0}


def test_padding_values_never_leak_into_the_loss_or_gradient():
    logprobs = torch.tensor([[-1.0, float("-inf"), float("nan")]], requires_grad=True)
    generation = torch.tensor([[-1.5, 0.0, float("nan")]])
    advantages = torch.tensor([[2.0, float("inf"), 1.0]])
    loss, metrics = clipped_pg_loss(logprobs, generation, advantages, torch.tensor([[1, 0, 0]]))
    assert loss.item() == pytest.approx(-1.2 * 2.0)  # e**0.5 = 1.65 clipped to 1.2
    loss.backward()
    assert logprobs.grad.tolist() == [[0.0, 0.0, 0.0]]
    assert all(math.isfinite(v) for v in metrics.values())


def test_bad_inputs_are_refused_with_what_to_fix():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"mask has shape \(2, 4\).*advantages has shape \(3,\)"):
        clipped_pg_loss(x, x, torch.zeros(3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"clip_low must be in \[0, 1\).*tis_cap must be > 0"):
        clipped_pg_loss(x, x, torch.zeros(2), x, clip_low=1.0, tis_cap=0.0)
    with pytest.raises(ValueError, match=r"logprobs must be a float \[B, L\]"):
        clipped_pg_loss(torch.zeros(6), x, torch.zeros(2), x)
