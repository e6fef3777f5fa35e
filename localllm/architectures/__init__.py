"""Model architectures: one small module per architecture over the shared blocks in `transformer.py`.

Each module holds that architecture's `TRAITS` (its differences from llama, as data) and a `config(meta)`.
Adding an architecture is adding a module and a line in `ARCHITECTURES`.
"""

from __future__ import annotations

from typing import Any

from localllm.architectures import gemma3, llama, qwen2
from localllm.architectures.base import ArchTraits, ModelConfig
from localllm.errors import ModelFileError

ARCHITECTURES = {
    "llama": llama,
    "qwen2": qwen2,
    "gemma3": gemma3,
}


def load_config(meta: dict[str, Any]) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelFileError(
            f"unsupported architecture {arch!r}; localllm runs {', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[arch].config(meta)


__all__ = ["ARCHITECTURES", "ArchTraits", "ModelConfig", "load_config"]
