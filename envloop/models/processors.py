"""Multimodal processors, loaded with or without torchvision.

transformers builds a Qwen2/2.5/3-VL processor with a video processor, which needs
torchvision. Where torchvision is missing (CPU-only installs, where only CUDA wheels exist),
:func:`load_processor` builds the same processor class from the image processor (its Pillow
backend) and the tokenizer, without a video processor; asking such a processor for video
input raises an error that says why.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

__all__ = [
    "load_processor",
    "processor_build",
    "processor_without_video",
    "torchvision_available",
]


def torchvision_available() -> bool:
    return importlib.util.find_spec("torchvision") is not None


def load_processor(name: str, **kwargs: Any) -> Any:
    """The processor of a local folder or hub id (``AutoProcessor``), without a video
    processor when torchvision is missing or the folder has none (one saved where
    torchvision was missing, as the bundled models are). ``kwargs`` go to every
    ``from_pretrained``."""
    from transformers import AutoProcessor

    if torchvision_available():
        try:
            return AutoProcessor.from_pretrained(name, **kwargs)
        except (OSError, ValueError) as exc:
            if "video" not in str(exc).lower():
                raise
            # saved without a video processor (where torchvision was missing): build it so
    return _processor_without_video(name, **kwargs)


def _processor_without_video(name: str, **kwargs: Any) -> Any:
    """The processor of ``name`` built from its image processor and tokenizer alone."""
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import processor_class_from_name

    processor_class_name = _processor_class_name(name, AutoConfig.from_pretrained(name, **kwargs))
    processor_class = processor_class_from_name(processor_class_name)
    if processor_class is None:
        raise ValueError(
            f"{name!r} names the processor class {processor_class_name!r}, which this "
            "transformers version does not have; upgrade transformers."
        )
    image_processor = AutoImageProcessor.from_pretrained(name, backend="pil", **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(name, **kwargs)
    return processor_without_video(processor_class)(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template
    )


def processor_build(
    processor_class: type, video_processor: Callable[[], Any]
) -> tuple[type, dict[str, Any]]:
    """How to build a new ``processor_class``: the class and the keyword arguments beside
    its image processor and tokenizer. Where torchvision is installed, with the video
    processor ``video_processor()`` makes (transformers requires one there); else the class
    without a video processor (:func:`processor_without_video`)."""
    if torchvision_available():
        return processor_class, {"video_processor": video_processor()}
    return processor_without_video(processor_class), {}


@functools.cache
def processor_without_video(processor_class: type) -> type:
    """``processor_class`` taking no video processor (same name, so it saves as itself)."""

    def __init__(self: Any, image_processor: Any = None, tokenizer: Any = None, **kwargs: Any):
        base: Any = processor_class
        base.__init__(self, image_processor, tokenizer, None, **kwargs)

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("videos") is not None:
            raise ValueError(
                f"{processor_class.__name__} was built without a video processor because "
                "torchvision is not installed; video input needs torchvision (a build that "
                "matches your torch). Images work without it."
            )
        base: Any = processor_class
        return base.__call__(self, *args, **kwargs)

    return type(
        processor_class.__name__,
        (processor_class,),
        {"__init__": __init__, "__call__": __call__, "__module__": processor_class.__module__},
    )


def _processor_class_name(name: str, config: Any) -> str:
    import json

    from transformers.utils import PROCESSOR_NAME, cached_file

    for filename in (PROCESSOR_NAME, "preprocessor_config.json"):
        path = cached_file(name, filename, _raise_exceptions_for_missing_entries=False)
        if path is None:
            continue
        with open(path, encoding="utf-8") as f:
            found = json.load(f).get("processor_class")
        if found:
            return str(found)
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    found = PROCESSOR_MAPPING_NAMES.get(config.model_type)
    if not found:
        raise ValueError(
            f"{name!r} has no processor_class in its processor config and its model type "
            f"{config.model_type!r} has no known processor; is it a vision-language model?"
        )
    return str(found)
