"""What `show` reports about a GGUF file, also used by the server's model endpoints."""

from __future__ import annotations

from collections import Counter


def model_info(path) -> dict:
    """What `show` reports about a GGUF file (also used by the server's model endpoints)."""
    from localllm.gguf_file import GGUFFile

    g = GGUFFile(path)
    arch = g.architecture
    meta = g.metadata
    tensor_types = Counter(t.qtype.name for t in g.tensors.values())
    info = {
        "path": str(g.path),
        "name": meta.get("general.name"),
        "architecture": arch,
        "parameters": sum(t.n_elements for t in g.tensors.values()),
        "file_size": g.file_size,
        "tensor_count": len(g.tensors),
        "tensor_types": dict(sorted(tensor_types.items(), key=lambda kv: -kv[1])),
        "context_length": meta.get(f"{arch}.context_length"),
        "embedding_length": meta.get(f"{arch}.embedding_length"),
        "block_count": meta.get(f"{arch}.block_count"),
        "tokenizer": {
            "model": meta.get("tokenizer.ggml.model"),
            "pre": meta.get("tokenizer.ggml.pre"),
            "vocab_size": len(meta.get("tokenizer.ggml.tokens", [])),
        },
        "chat_template": "tokenizer.chat_template" in meta,
    }
    info.update(_runnable(g))
    g.close()
    return info


def _runnable(g) -> dict:
    """Whether localllm runs the file, and how its architecture departs from a plain llama block (the checks
    a load runs first, on metadata and tensor headers only: no weight is read)."""
    from localllm.architectures import features, load_model_config
    from localllm.errors import ModelFileError

    try:
        config = load_model_config(g)
    except ModelFileError as e:
        return {"supported": False, "refused": str(e), "features": []}
    return {"supported": True, "features": features(config, g.tensors)}
