"""Convert a transformers model folder to a GGUF file at full precision (f32) with the
converter of the llama.cpp sources that scripts/build_llama_server.sh unpacks, so that
llama-server can serve it:

    .venv/bin/python scripts/convert_to_gguf.py LLAMA_SRC MODEL_DIR OUT.gguf

The converter identifies a BPE tokenizer's pre-tokenizer by hashing how it splits a test
string, and refuses one it does not know, as it does the bundled policy's byte-level BPE.
envloop sends prompts to the server as token ids and reads token ids back, so the server
never pre-tokenizes text; this script then declares ``qwen2`` (a byte-level BPE
pre-tokenizer) instead of failing. Needs ``sentencepiece`` importable (the converter
imports it).
"""

from __future__ import annotations

import sys

FALLBACK_PRE_TOKENIZER = "qwen2"


def main(src: str, model_dir: str, out: str) -> None:
    sys.path[:0] = [src, f"{src}/gguf-py"]
    import conversion.base as base  # the converter's own modules, from the sources

    known = base.TextModel.get_vocab_base_pre

    def declared(self, tokenizer):  # type: ignore[no-untyped-def]
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            return FALLBACK_PRE_TOKENIZER

    base.TextModel.get_vocab_base_pre = declared
    import convert_hf_to_gguf

    sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outtype", "f32", "--outfile", out]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
