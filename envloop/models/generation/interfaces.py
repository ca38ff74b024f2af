"""The contract between the rollout engine and a policy's generation backend."""

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any, TypedDict

import torch
from typing_extensions import NotRequired

from envloop.distributed.batched_data_dict import BatchedDataDict


class GenerationDatumSpec(TypedDict):
    """Generation input.

    Attributes:
        input_ids: [B, L] int64, right-padded prompts.
        input_lengths: [B] int, unpadded prompt lengths.
        stop_strings: length-B list; each ``None`` (EOS only) or a list of strings.
            Generation of a sample stops once its generated text ends with one of them;
            the stop string is kept in the output.
        max_new_tokens: optional [B] int, a per-sample cap on generated tokens (the
            rollout engine passes what is left of ``max_seq_len``); the backend also
            applies its own ``max_new_tokens`` and uses the smaller of the two.
        sample_ids: optional length-B list of hashable keys, one per sample, the same for
            every turn of a sample (the rollout engine passes them): a backend with several
            servers sends all of a sample's turns to one server, whose prefix cache holds
            the earlier turns. Backends without servers ignore them.
        <vision inputs>: for a vision-language policy, one column per vision input of its
            processor (e.g. ``pixel_values``, ``image_grid_thw``), each a ``PackedTensor``
            with one item per row (its images' inputs in message order; None for a row
            without images). ``HfGeneration`` feeds them to the model.
        images: optional length-B list, each row's images (RGB PIL images, in the order of
            its image placeholder runs) or None; ``ServerGeneration`` sends these to its
            servers. The rollout engines pass both with every row that has images.
    """

    input_ids: torch.Tensor
    input_lengths: torch.Tensor
    stop_strings: NotRequired[list[list[str] | None]]
    max_new_tokens: NotRequired[torch.Tensor]
    sample_ids: NotRequired[list[Any]]
    images: NotRequired[list[list[Any] | None]]


class GenerationOutputSpec(TypedDict):
    """Generation output.

    Attributes:
        output_ids: [B, L'] int64, the prompt followed by the generated tokens, right-padded
            with the pad token id. An EOS that ended generation is kept.
        generation_lengths: [B] int, number of generated tokens.
        unpadded_sequence_lengths: [B] int, ``input_lengths + generation_lengths``.
        logprobs: [B, L'] float32, zero at prompt and pad positions; at a generated position,
            the log-probability of the sampled token under the distribution it was sampled
            from (see the backend's docstring for the exact definition).
        truncated: optional [B] bool, True when a response stopped at its token budget
            rather than at EOS or a stop string.
        generation_error: optional length-B list, None for each row that generated and the
            failure text for each that could not (a server backend's request that failed
            after its retries; such a row has no generated tokens). The rollout engine ends
            those samples with ``loss_multiplier`` 0 and counts them in
            ``generation_error_rate``; the other rows go on.
        policy_versions: optional [B, L'] int32, zero at prompt and pad positions; at a
            generated position, the policy version (see
            :attr:`GenerationInterface.policy_version`) whose weights gave the distribution
            that token was drawn from. A backend that leaves it out reports version 0.
    """

    output_ids: torch.Tensor
    generation_lengths: torch.Tensor
    unpadded_sequence_lengths: torch.Tensor
    logprobs: torch.Tensor
    truncated: NotRequired[torch.Tensor]
    generation_error: NotRequired[list[str | None]]
    policy_versions: NotRequired[torch.Tensor]


class GenerationInterface(ABC):
    """A policy that turns a batch of prompts into responses."""

    reads_images: bool = False
    """Whether the backend reads a row's images from the ``images`` column (and its patch
    grids from ``image_grid_thw``) rather than from the vision input columns: a rollout
    called with ``deduplicate_multimodal_data=True`` then hands it only those."""

    @abstractmethod
    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]:
        """Generate one response per row of ``data``; rows come back in input order."""

    @property
    def policy_version(self) -> int:
        """The version of the weights the backend serves now: 0 after construction, then
        what each :meth:`update_weights` set."""
        return int(getattr(self, "_policy_version", 0))

    def update_weights(self, weights: Any, *, version: int | None = None) -> int:
        """Serve new weights from now on and return their version.

        ``version`` None means the current version plus one; an explicit version must not
        be lower than the current one. Backends that can take new weights override this
        (``HfGeneration``: a state dict, a module or a ``save_pretrained`` folder;
        ``ServerGeneration``: a checkpoint the servers reload).
        """
        raise NotImplementedError(
            f"{type(self).__name__} cannot update its weights: build a new "
            f"{type(self).__name__} from the new checkpoint, or use a backend that implements "
            "update_weights (HfGeneration, or ServerGeneration with a vLLM or SGLang server)."
        )

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Make the backend ready (load weights onto the device, wake engines)."""
        return True

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Release what generation needed (e.g. offload weights)."""
        return True

    def shutdown(self) -> bool:
        """Free every resource; the backend is unusable afterwards."""
        return True

    async def generate_async(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> AsyncIterator[tuple[int, BatchedDataDict[GenerationOutputSpec]]]:
        """Yield ``(sample_index, single-sample output)`` as each sample finishes.

        The default runs :meth:`generate` once and yields its rows in order; backends
        that can finish samples independently override it.
        """
        output = self.generate(data, greedy=greedy)
        for i in range(output.size):
            yield i, output.slice(i, i + 1)
