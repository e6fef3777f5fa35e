"""Model architectures: one small module per architecture over the shared blocks in `transformer.py`.

Each module holds that architecture's `TRAITS` (its differences from llama, as data) and a `config(meta)`.
Adding an architecture is adding a module and a line in `ARCHITECTURES`.
"""

from __future__ import annotations

from typing import Any

from localllm.architectures import gemma3, llama, qwen2, validate
from localllm.architectures.base import ArchTraits, ModelConfig
from localllm.errors import ModelFileError

ARCHITECTURES = {
    "llama": llama,
    "qwen2": qwen2,
    "gemma3": gemma3,
}


def load_config(meta: dict[str, Any]) -> ModelConfig:
    """The model's hyperparameters, checked (validate.py): a ModelFileError naming the key if one is wrong."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise ModelFileError(
            f"unsupported architecture {arch!r}; localllm runs {', '.join(sorted(ARCHITECTURES))}"
        )
    validate.check_metadata(meta)
    config = ARCHITECTURES[arch].config(meta)
    validate.check_config(config, meta)
    return config


def load_model_config(g) -> ModelConfig:
    """The config of an open GGUF file after every check of validate.py: hyperparameters, each tensor's shape
    and type, the tokenizer's arrays. Runs before any weight is wrapped or kernel called."""
    try:
        config = load_config(g.metadata)
        validate.check_vocabulary(g.metadata, config, g.tensors)
        validate.check_tensors(g, config)
    except ModelFileError as e:
        if str(g.path) in str(e):
            raise
        raise ModelFileError(f"{g.path}: {e}") from None
    return config


__all__ = ["ARCHITECTURES", "ArchTraits", "ModelConfig", "load_config", "load_model_config"]
