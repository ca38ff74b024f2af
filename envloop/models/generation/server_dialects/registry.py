"""Every dialect by its name in the config (``policy.dialect``,
:data:`~envloop.models.generation.server_config.Dialect`).

Adding a dialect: write its :class:`~interfaces.ServerDialect` subclass in a module of this
package, list it in :data:`DIALECTS`, and add its name to the config's ``Dialect`` literal.
"""

from __future__ import annotations

from envloop.models.generation.server_dialects.interfaces import Decode, ServerDialect
from envloop.models.generation.server_dialects.llamacpp import LlamaCppDialect
from envloop.models.generation.server_dialects.sglang import SglangDialect
from envloop.models.generation.server_dialects.vllm import VllmDialect

DIALECTS: dict[str, type[ServerDialect]] = {
    "vllm": VllmDialect,
    "sglang": SglangDialect,
    "llamacpp": LlamaCppDialect,
}


def make_dialect(
    name: str, model: str | None = None, decode: Decode | None = None
) -> ServerDialect:
    """The dialect called ``name`` (a key of :data:`DIALECTS`), for the served ``model``
    and writing token ids as text with ``decode``.

    >>> make_dialect("sglang").path
    '/generate'
    """
    return DIALECTS[name](model, decode)
