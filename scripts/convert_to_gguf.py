"""Convert a transformers model folder to a GGUF file at full precision (f32) with the
converter of the llama.cpp sources that scripts/build_llama_server.sh unpacks, so that
llama-server can serve it:

    .venv/bin/python scripts/convert_to_gguf.py LLAMA_SRC MODEL_DIR OUT.gguf [--mmproj]

With ``--mmproj`` it writes the vision projector of a vision-language model (Qwen2.5-VL
and others the converter knows) instead of its text model; llama-server takes both
(``-m text.gguf --mmproj mmproj.gguf``).

The converter identifies a BPE tokenizer's pre-tokenizer by hashing how it splits a test
string, and refuses one it does not know, as it does the bundled policy's byte-level BPE.
envloop sends prompts to the server as token ids and reads token ids back, so the server
never pre-tokenizes text; this script then declares ``qwen2`` (a byte-level BPE
pre-tokenizer) instead of failing. (Prompts with images are the exception: llama-server
re-tokenizes their text, and the backend checks that it got the same number of tokens.)

The converter names a vision model's tensors through a table built for as many indices as
the vision encoder has blocks, and Qwen2.5-VL's merger has a layer ``mlp.2``: an encoder of
fewer than three blocks (a tiny test model) would fail on it, so the table is built for at
least ``MIN_VISION_TABLE`` indices. Needs ``sentencepiece`` importable (the converter
imports it).
"""

from __future__ import annotations

import sys

FALLBACK_PRE_TOKENIZER = "qwen2"
MIN_VISION_TABLE = 8


def main(src: str, model_dir: str, out: str, *flags: str) -> None:
    if set(flags) - {"--mmproj"}:
        sys.exit(__doc__)
    sys.path[:0] = [src, f"{src}/gguf-py"]
    import conversion.base as base  # the converter's own modules, from the sources

    known = base.TextModel.get_vocab_base_pre

    def declared(self, tokenizer):  # type: ignore[no-untyped-def]
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            return FALLBACK_PRE_TOKENIZER

    base.TextModel.get_vocab_base_pre = declared
    vision_init = base.MmprojModel.__init__

    def wide_table(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        vision_init(self, *args, **kwargs)
        blocks = max(self.block_count, MIN_VISION_TABLE)
        self.tensor_map = base.gguf.get_tensor_name_map(base.gguf.MODEL_ARCH.MMPROJ, blocks)

    base.MmprojModel.__init__ = wide_table
    import convert_hf_to_gguf

    sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outtype", "f32", "--outfile", out, *flags]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    if len(sys.argv) not in (4, 5):
        sys.exit(__doc__)
    main(*sys.argv[1:])
