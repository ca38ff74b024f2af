"""``nemo_rl.algorithms.utils``'s tokenizer helper, at the same path, for code ported from
NeMo-RL (``from nemo_rl.algorithms.utils import get_tokenizer`` becomes
``from envloop.algorithms.utils import get_tokenizer``). The implementation lives in
:mod:`envloop.models.tokenizers`; new code can import it from there.

>>> from envloop.models import tokenizers
>>> get_tokenizer is tokenizers.get_tokenizer and TokenizerConfig is tokenizers.TokenizerConfig
True
"""

from envloop.models.tokenizers import TokenizerConfig, get_tokenizer

__all__ = ["TokenizerConfig", "get_tokenizer"]
