"""The rows a model is decoding together: their KV cache, attention mask and next-token
logits, one token per row per step.

Rows are left-padded (position ids come from the attention mask, so padding changes
nothing). A row leaves the batch, and the cache, as soon as it finishes, and new rows can
join between any two steps: their prompts are prefilled on their own, then their cache is
padded on the left to the batch's width (or the batch's to theirs) and appended. Columns
that only hold padding are trimmed whenever rows leave, so the width stays that of the
longest row still running.

The weights may change between two steps (:attr:`DecodeBatch.version` names them). Each
row's pending logits keep the version that computed them, and each token is recorded with
the version of the logits it was drawn from (``SampleResult.versions``); a row's cache is
kept as it is, or rebuilt from the new weights by :meth:`DecodeBatch.recompute`.
"""

from __future__ import annotations

import functools
import inspect
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from envloop.models.generation.sampling import draw_tokens, sampling_logprobs
from envloop.models.generation.stop_strings import StopWatcher


@dataclass(frozen=True)
class DecodeSettings:
    """How tokens are chosen, the same for every row of a backend."""

    temperature: float
    """Logits are divided by it before filtering."""
    top_k: int | None
    """Keep the ``top_k`` most likely tokens; None keeps all."""
    top_p: float
    """Keep the smallest most-likely set with at least this probability mass."""
    eos_ids: frozenset[int]
    """Token ids that end a row (kept in its output)."""
    pad_id: int
    """Token id used for left padding."""


@dataclass
class SampleResult:
    """What one row generated."""

    tokens: list[int] = field(default_factory=list)
    """Generated token ids, an ending EOS included."""
    logprobs: list[float] = field(default_factory=list)
    """Log-probability of each generated token (see ``sampling_logprobs``)."""
    truncated: bool = False
    """True when the row stopped at its token budget rather than at EOS or a stop string."""
    error: str | None = None
    """Why the row generated nothing, when it failed (a server backend's failed request)."""
    versions: list[int] = field(default_factory=list)
    """The policy version that produced each token (one per token); empty means version 0
    for every token (a backend without weight updates)."""


@dataclass(eq=False)
class DecodeRequest:
    """One prompt to generate for, with what ends it and how its tokens are chosen."""

    prompt: torch.Tensor
    """1-D token ids."""
    budget: int
    """Most tokens to generate (>= 1)."""
    greedy: bool
    """Argmax of the filtered distribution instead of a draw from it."""
    rng: random.Random | None = None
    """The row's own random stream (draws one uniform per token); required unless greedy.
    A row's tokens then depend only on its seed and its distributions, not on which rows
    share its steps."""
    stop: StopWatcher | None = None
    """Watches the row's text for its stop strings; None: EOS and budget only."""
    vision: dict[str, torch.Tensor] | None = None
    """The prompt's vision inputs for a vision-language model, packed along dim 0 (e.g.
    ``pixel_values`` [patches, D], ``image_grid_thw`` [images, 3]); None without images."""
    result: SampleResult = field(default_factory=SampleResult)
    abandoned: bool = False
    """Set (from any thread) when nobody waits for the result any more: the row is dropped
    at the next step."""


class DecodeBatch:
    """Rows decoded together, one token each per :meth:`step`."""

    def __init__(self, model: Any, settings: DecodeSettings, version: int = 0) -> None:
        self.model, self.settings = model, settings
        self.positions = RowPositions(model)
        self.rows: list[DecodeRequest] = []
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros((0, 0), dtype=torch.long)
        self.logits = torch.zeros((0, 0))
        self.version = version
        """The policy version of the model's weights now: the version of every logits
        computed from now on. Whoever changes the weights (between two steps) sets it."""
        self.logit_versions: list[int] = []
        """[b] per row: the version of the weights that computed its :attr:`logits`, which
        is the version of the token its next :meth:`step` draws from them."""
        self.deltas = torch.zeros(0, dtype=torch.long)
        """[b] per row: its next position minus its token count (non-zero only for rows
        whose images take fewer rotary positions than tokens, as in Qwen-VL's mrope)."""
        self.joinable = True
        """Whether rows can join while others run: the model's cache holds one full
        key/value tensor per layer (not sliding windows or recurrent states)."""

    def __len__(self) -> int:
        return len(self.rows)

    @torch.no_grad()
    def admit(self, requests: Sequence[DecodeRequest]) -> None:
        """Prefill ``requests``' prompts and add them as rows; the next :meth:`step` gives
        them their first token. Only while the batch is empty unless :attr:`joinable`."""
        if self.rows and not self.joinable:
            raise RuntimeError("rows cannot join a running batch of this model's cache type")
        cache, mask, logits, deltas = self._prefill([r.prompt for r in requests], requests)
        if not self.rows:
            self.rows, self.cache, self.mask, self.logits = list(requests), cache, mask, logits
            self.deltas = deltas
            self.logit_versions = [self.version] * len(requests)
            self.joinable = all(type(layer) is DynamicLayer for layer in cache.layers)
            return
        assert self.cache is not None
        width = max(self.mask.shape[1], mask.shape[1])
        self.mask = _join(self.mask, mask, width)
        for running, joining in zip(_full_layers(self.cache), _full_layers(cache)):
            keys, values = _tensors(running)
            running.keys, running.values = (
                _join(old, new, width) for old, new in zip((keys, values), _tensors(joining))
            )
        self.logits = torch.cat([self.logits, logits])
        self.deltas = torch.cat([self.deltas, deltas])
        self.logit_versions += [self.version] * len(requests)
        self.rows.extend(requests)

    @torch.no_grad()
    def recompute(self) -> None:
        """Rebuild every row's cache and next-token logits from the current weights, as if
        the row had run under them from the start: its prompt is prefilled (with its vision
        inputs), then its generated tokens [k] in one more pass (left-padded together, so a
        generated image placeholder is text, as it was when decoded). The rows keep their
        tokens; their logits become of :attr:`version`, so the next token each draws is too.
        """
        if not self.rows:
            return
        assert all(r.result.tokens for r in self.rows)  # a row is stepped once admitted
        cache, mask, _, deltas = self._prefill([r.prompt for r in self.rows], self.rows)
        generated, generated_mask = _left_pad(
            [torch.tensor(r.result.tokens, dtype=torch.long) for r in self.rows],
            self.settings.pad_id,
        )
        mask = torch.cat([mask, generated_mask.to(mask.device)], dim=1)
        positions = self.positions.decode(mask, deltas, count=generated.shape[1])
        generated = generated.to(self.model.device)
        self.logits = _next_token_logits(self.model, generated, mask, cache, positions)
        self.cache, self.mask, self.deltas = cache, mask, deltas
        self.logit_versions = [self.version] * len(self.rows)

    def _prefill(
        self, sequences: Sequence[torch.Tensor], requests: Sequence[DecodeRequest]
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One forward pass over ``sequences`` (1-D token ids, one per request; left-padded
        together) with the requests' vision inputs: their cache, attention mask [b, W],
        next-token logits [b, V] and rotary deltas [b]."""
        input_ids, mask = _left_pad(sequences, self.settings.pad_id)
        input_ids, mask = input_ids.to(self.model.device), mask.to(self.model.device)
        cache = DynamicCache(config=self.model.config)
        vision = _packed_vision(requests, self.model.device)
        positions, deltas = self.positions.prefill(input_ids, mask, vision)
        logits = _next_token_logits(self.model, input_ids, mask, cache, positions, vision)
        return cache, mask, logits, deltas

    @torch.no_grad()
    def step(self) -> list[DecodeRequest]:
        """Choose each row's next token, drop the rows it finished (returned, in row order)
        and those abandoned, and run the model on the rest."""
        s = self.settings
        logprobs = sampling_logprobs(self.logits, s.temperature, s.top_k, s.top_p)
        tokens, token_logprobs = _choose(logprobs, self.rows)
        finished, keep = [], []
        for k, (row, token, logprob, version) in enumerate(
            zip(self.rows, tokens.tolist(), token_logprobs.tolist(), self.logit_versions)
        ):
            row.result.tokens.append(token)
            row.result.logprobs.append(logprob)
            row.result.versions.append(version)
            if _ends(row, token, s.eos_ids):
                finished.append(row)
            elif not row.abandoned:
                keep.append(k)
        self._keep(keep)
        if self.rows:
            next_tokens = tokens[torch.tensor(keep, device=tokens.device)].unsqueeze(-1)
            self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], dim=1)
            assert self.cache is not None
            positions = self.positions.decode(self.mask, self.deltas)
            self.logits = _next_token_logits(
                self.model, next_tokens, self.mask, self.cache, positions
            )
            self.logit_versions = [self.version] * len(self.rows)
        return finished

    def _keep(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (in order) and trim columns left holding only padding."""
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[k] for k in keep]
        self.logit_versions = [self.logit_versions[k] for k in keep]
        if not self.rows:
            self.cache, self.mask, self.logits = None, self.mask[:0], self.logits[:0]
            self.deltas = self.deltas[:0]
            return
        assert self.cache is not None
        index = torch.tensor(keep, device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        self.deltas = self.deltas[index]
        if self.joinable:
            lead = int(self.mask.any(dim=0).int().argmax())
            if lead:
                self.mask = self.mask[:, lead:]
                for layer in _full_layers(self.cache):
                    keys, values = _tensors(layer)
                    layer.keys, layer.values = keys[:, :, lead:], values[:, :, lead:]


def _full_layers(cache: DynamicCache) -> list[DynamicLayer]:
    """The layers of a cache that :attr:`DecodeBatch.joinable` found to be full layers."""
    return cast(list[DynamicLayer], cache.layers)


def _tensors(layer: DynamicLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """A filled layer's keys and values [b, heads, W, d]."""
    assert layer.keys is not None and layer.values is not None
    return layer.keys, layer.values


def _ends(row: DecodeRequest, token: int, eos_ids: frozenset[int]) -> bool:
    """Whether ``token`` ends ``row``: EOS, a completed stop string or the budget (which
    marks the row truncated)."""
    if token in eos_ids:
        return True
    if row.stop is not None and row.stop.add(token):
        return True
    if len(row.result.tokens) >= row.budget:
        row.result.truncated = True
        return True
    return False


def _choose(logprobs: torch.Tensor, rows: list[DecodeRequest]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token: the argmax for greedy rows, a draw with the row's own uniform for
    the others; and its log-probability."""
    tokens = logprobs.argmax(dim=-1)
    sampled = [k for k, row in enumerate(rows) if not row.greedy]
    if sampled:
        uniforms = torch.tensor([1.0 - rows[k].rng.random() for k in sampled])  # type: ignore[union-attr]
        index = torch.tensor(sampled, device=logprobs.device)
        tokens[index] = draw_tokens(logprobs[index], uniforms)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _left_pad(prompts: Sequence[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids [b, W] and attention mask [b, W] (1 at real tokens)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    return input_ids, mask


def _join(running: torch.Tensor, joining: torch.Tensor, width: int) -> torch.Tensor:
    """Rows of ``running`` then ``joining``, each left-padded to ``width``."""
    return torch.cat([_pad_left(running, width), _pad_left(joining, width)])


def _pad_left(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """``tensor`` with zero columns added on the left of its sequence dimension (the last
    of a mask [b, W], the third of a cache tensor [b, heads, W, d]) up to ``width``."""
    dim = 1 if tensor.dim() == 2 else 2
    missing = width - tensor.shape[dim]
    if not missing:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def _next_token_logits(
    model: Any,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    cache: DynamicCache,
    positions: torch.Tensor,
    vision: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Logits [b, V] after ``input_ids`` [b, n], the last n columns of ``mask``, at
    ``positions``; fills ``cache``. ``vision``: the rows' vision inputs (prefill only)."""
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        **{cache_keyword(model.__class__): cache},
        use_cache=True,
        logits_to_keep=1,
        **(vision or {}),
    )
    return out.logits[:, -1, :]


@functools.cache
def cache_keyword(model_class: Any) -> str:
    """The keyword ``model_class.forward`` takes its KV cache by: ``cache`` since
    transformers renamed it (5.x deprecates ``past_key_values``, to be removed in 5.40),
    ``past_key_values`` in earlier releases and in models that still use it.

    >>> from transformers import Qwen3ForCausalLM
    >>> cache_keyword(Qwen3ForCausalLM)
    'cache'
    """
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _packed_vision(
    requests: Sequence[DecodeRequest], device: torch.device
) -> dict[str, torch.Tensor] | None:
    """The vision inputs of the rows that have them, concatenated in row order (as a
    vision-language model takes a batch's images), on ``device``; None if no row has any."""
    with_vision = [r.vision for r in requests if r.vision]
    if not with_vision:
        return None
    keys = with_vision[0].keys()
    return {k: torch.cat([v[k] for v in with_vision]).to(device) for k in keys}


class RowPositions:
    """Rotary position ids of a decode batch's rows.

    For most models a token's position is the number of real tokens before it (left
    padding skipped). Qwen2/2.5/3-VL models (those with ``get_rope_index``) give image
    tokens 3-D (time, height, width) positions that advance by less than one per token, so
    a row's later tokens sit at ``tokens before it + delta``; the model computes the
    prefill's positions and each row's delta, and decode steps add the delta.
    """

    def __init__(self, model: Any) -> None:
        inner = getattr(model, "model", None)
        self.rope_index = getattr(inner, "get_rope_index", None)
        config = model.config
        self.image_token_id = getattr(config, "image_token_id", None)
        self.video_token_id = getattr(config, "video_token_id", None)

    def prefill(
        self, input_ids: torch.Tensor, mask: torch.Tensor, vision: dict[str, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions of a left-padded prefill and each row's delta [b]."""
        text = (mask.cumsum(dim=-1) - 1).clamp(min=0)
        zeros = torch.zeros(len(input_ids), dtype=torch.long, device=input_ids.device)
        if self.rope_index is None:
            return text, zeros
        token_types = torch.zeros_like(input_ids, dtype=torch.int)
        if self.image_token_id is not None:
            token_types[input_ids == self.image_token_id] = 1
        if self.video_token_id is not None:
            token_types[input_ids == self.video_token_id] = 2
        if not bool(token_types.any()):
            return text.unsqueeze(0).expand(3, -1, -1), zeros
        positions, deltas = self.rope_index(
            input_ids,
            mm_token_type_ids=token_types,
            image_grid_thw=(vision or {}).get("image_grid_thw"),
            video_grid_thw=(vision or {}).get("video_grid_thw"),
            attention_mask=mask,
        )
        return positions, deltas.reshape(-1).to(input_ids.device)

    def decode(self, mask: torch.Tensor, deltas: torch.Tensor, count: int = 1) -> torch.Tensor:
        """Positions [b, count] (or [3, b, count]) of the last ``count`` columns of ``mask``
        [b, W]: the tokens each row takes next (padding columns among them get the position
        of the real token before them; the mask hides them)."""
        before = mask.cumsum(dim=-1)[:, -count:] - 1
        last = before.clamp(min=0) + deltas.unsqueeze(-1)
        return last if self.rope_index is None else last.unsqueeze(0).expand(3, -1, -1)
