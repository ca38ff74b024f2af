"""The next-token distribution of a decode step, and drawing a token from it.

One function builds the distribution (temperature, then top-k and top-p filtering,
renormalized) and another picks from it, so the reported log-probability is always the one
of the distribution the token was drawn from.
"""

from __future__ import annotations

import torch


def sampling_logprobs(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float
) -> torch.Tensor:
    """Log-probabilities [b, V] float32 of the distribution tokens are drawn from.

    ``log_softmax(filter(logits / temperature))``, where ``filter`` keeps the ``top_k`` largest
    logits (all if None), then the smallest set of most likely tokens whose probability sums
    to at least ``top_p`` (the most likely token is always kept), and sets the rest to -inf.

    >>> logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    >>> sampling_logprobs(logits, 1.0, top_k=None, top_p=0.7).exp()
    tensor([[0.6250, 0.3750, 0.0000]])
    >>> sampling_logprobs(logits, 1.0, top_k=1, top_p=1.0).exp()
    tensor([[1., 0., 0.]])
    """
    scaled = logits.float() / temperature
    if top_k is not None and top_k < scaled.shape[-1]:
        scaled = _keep_top_k(scaled, top_k)
    if top_p < 1.0:
        scaled = _keep_top_p(scaled, top_p)
    return torch.log_softmax(scaled, dim=-1)


def draw_tokens(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Tokens [b] drawn from ``logprobs`` [b, V] by inverse transform: row i takes the first
    token whose cumulative probability reaches ``uniforms[i]`` (in (0, 1]) of its total, so
    each row's draw depends only on its own distribution and its own uniform.

    >>> logprobs = torch.log(torch.tensor([[0.5, 0.0, 0.5], [0.1, 0.9, 0.0]]))
    >>> draw_tokens(logprobs, torch.tensor([0.7, 0.05])).tolist()
    [2, 0]
    """
    cdf = logprobs.exp().cumsum(dim=-1)
    targets = uniforms.to(cdf.device, cdf.dtype).unsqueeze(-1) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, targets).squeeze(-1)
    return tokens.clamp(max=cdf.shape[-1] - 1)


def _keep_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    kth_largest = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def _keep_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
