"""`localllm convert`: Hugging Face checkpoints (safetensors) to GGUF, as llama.cpp's convert_hf_to_gguf.py.

Modules: `safetensors` (our reader), `checkpoint` (a checkpoint directory, checked), `architectures` (per-architecture
data and the hyperparameter keys), `vocab` (tokenizer keys, the pre-tokenizer), `converter` (planning and the
streaming writer).
"""

from .converter import QUANTIZE_MIXES, OUTPUT_TYPES, TYPE_CHOICES, convert, plan_conversion

__all__ = ["convert", "plan_conversion", "OUTPUT_TYPES", "QUANTIZE_MIXES", "TYPE_CHOICES"]
