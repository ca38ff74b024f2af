"""What a request to each kind of inference server looks like, and how its answer is read:
one :class:`ServerDialect` per server API (:mod:`.vllm`, :mod:`.sglang`, :mod:`.llamacpp`),
listed by name in :mod:`.registry`.

Prompts go out as token ids; the generated token ids and the log-probability of each come
back from the server's own fields, never from re-tokenizing text. Every sampling knob is
sent explicitly, because each server fills a missing one from the model's or its own
defaults (llama.cpp samples with top-k 40, top-p 0.95, min-p 0.05 and temperature 0.8 by
default, vLLM stops at 16 tokens, SGLang at 128).

Log-probabilities, as each dialect asks for them:

- sampled tokens: the log-probability under the distribution the token was drawn from
  (temperature, then top-k and top-p): llama.cpp's post-sampling probabilities with its
  samplers in that order; vLLM's when the server runs with
  ``--logprobs-mode processed_logprobs``; SGLang applies only the temperature, so its
  dialect refuses top-k and top-p (:meth:`ServerDialect.sampling_refused`, checked by
  :class:`~envloop.models.generation.server_config.ServerGenerationConfig`);
- greedy tokens: the model's unfiltered log-softmax at temperature 1, the value all three
  servers report for an argmax.

Images (a row's :class:`~envloop.models.generation.server_media.RequestImages`) go as each
server's source defines: llama.cpp takes a prompt *string* with its media marker where each
image stands and the images base64-encoded (it cannot mix token ids and images, so the text
around the images is decoded and re-tokenized by the server); SGLang takes ``input_ids``
with one ``<|image_pad|>`` per image and ``image_data``, and expands each pad itself; vLLM's
``/v1/completions`` takes no images (see :class:`VllmDialect`). The server's count of prompt
tokens (``Reply.prompt_tokens``) is then checked against the row's.

Shapes of the answers were read from each server's source (llama.cpp: the version
``scripts/build_llama_server.sh`` builds; vLLM's ``CompletionResponse``; SGLang's
``/generate`` output); ``tests/unit/models/generation/server_dialects/`` holds recorded
examples.

Weight reloads (:meth:`ServerDialect.weight_reload`): the requests that make a vLLM or SGLang
server serve a checkpoint from its disk, read from their sources as each class says
(``tests/unit/models/generation/test_server_weight_updates.py`` replays recorded shapes:
neither server runs on the machines these tests run on). llama.cpp's server cannot reload.
"""

from envloop.models.generation.server_dialects.interfaces import (
    ControlRequest,
    Decode,
    Finish,
    FollowUp,
    GenerationFailed,
    GenerationRequest,
    GetJson,
    MalformedReply,
    Reply,
    RetryableFailure,
    Sampling,
    ServerDialect,
    ServerMedia,
    WeightReload,
)
from envloop.models.generation.server_dialects.llamacpp import LlamaCppDialect
from envloop.models.generation.server_dialects.registry import DIALECTS, make_dialect
from envloop.models.generation.server_dialects.sglang import SglangDialect
from envloop.models.generation.server_dialects.vllm import VllmDialect

__all__ = [
    "DIALECTS",
    "ControlRequest",
    "Decode",
    "Finish",
    "FollowUp",
    "GenerationFailed",
    "GenerationRequest",
    "GetJson",
    "LlamaCppDialect",
    "MalformedReply",
    "Reply",
    "RetryableFailure",
    "Sampling",
    "ServerDialect",
    "ServerMedia",
    "SglangDialect",
    "VllmDialect",
    "WeightReload",
    "make_dialect",
]
