"""Tokenization exactly as llama.cpp does it, from a GGUF's tokenizer metadata.

Modules: `vocab` (loading: token attributes, special ids, EOG/FIM detection), `pretokenize` (BPE word
splitting by llama.cpp's regexes), `bpe` and `spm` (the two merge algorithms), `special` (cutting special
tokens out of text), `detokenize` (token_to_piece, detokenize, streaming), `core` (the Tokenizer).
"""

from .core import Tokenizer
from .detokenize import StreamDecoder

__all__ = ["Tokenizer", "StreamDecoder"]
