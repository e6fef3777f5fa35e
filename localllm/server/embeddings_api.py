"""Embeddings in each API's shape: OpenAI POST /v1/embeddings, Ollama POST /api/embed and /api/embeddings (the
older one), llama.cpp POST /embedding and /embeddings.

A text's vector is the model's final hidden states (after the output norm) pooled as `Engine.embed` does (the
GGUF's pooling type, else the mean over the text's tokens) and L2-normalized, except where the API says
otherwise: Ollama's older /api/embeddings returns the raw pooled vector, as Ollama does, and llama.cpp's routes
follow `embd_normalize` (2: Euclidean, the default; -1: none). Texts are tokenized off the event loop, then
embedded on the engine thread between two generation steps (`Scheduler.run`), several per forward; a text's
vector is the same alone or among others.
"""

from __future__ import annotations

import base64
import time

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from localllm.server.app import (ApiError, Fields, ServerState, dumps_go, go_float32_rows, json_response, off_loop,
                                 ollama_response, read_json)

MAX_INPUTS = 2048  # OpenAI's limit on the texts of one request


def _texts(f: Fields, key: str, allow_tokens: bool) -> list:
    """A string, a list of strings, or (allow_tokens) a list of token ids or of lists of them: a list of items,
    each a str or a list[int]."""
    value = f.data.get(key)
    if isinstance(value, str):
        items = [value]
    elif isinstance(value, list) and value and allow_tokens and all(type(t) is int for t in value):
        items = [value]
    elif isinstance(value, list):
        items = value
    else:
        raise ApiError(400, f"'{key}' must be a string or an array of strings" +
                       (" or of token ids" if allow_tokens else ""), param=key)
    if not items:
        raise ApiError(400, f"'{key}' must not be empty", param=key)
    if len(items) > MAX_INPUTS:
        raise ApiError(400, f"'{key}' has {len(items)} texts; at most {MAX_INPUTS} per request", param=key)
    for i, item in enumerate(items):
        ok = isinstance(item, str) or (allow_tokens and isinstance(item, list) and item
                                       and all(type(t) is int for t in item))
        if not ok:
            raise ApiError(400, f"'{key}'[{i}] must be a string" + (" or an array of token ids" if allow_tokens
                                                                    else ""), param=key)
        if isinstance(item, str) and not item:
            raise ApiError(400, f"'{key}'[{i}] is an empty string", param=key)
    return items


def _tokenize(state: ServerState, items: list, key: str, truncate: bool = False) -> list[list[int]]:
    engine = state.engine
    out = []
    for i, item in enumerate(items):
        tokens = engine.tokenize_prompt(item) if isinstance(item, str) else list(item)
        if isinstance(item, list):
            bad = next((t for t in tokens if not 0 <= t < engine.config.vocab_size), None)
            if bad is not None:
                raise ApiError(400, f"'{key}'[{i}]: token id {bad} is not a token of this model", param=key)
        if len(tokens) > engine.ctx:
            if not truncate:
                raise ApiError(400, f"'{key}'[{i}] is {len(tokens)} tokens but the context holds {engine.ctx}",
                               param=key)
            tokens = tokens[:engine.ctx]
        out.append(tokens)
    return out


async def _embed(state: ServerState, tokens: list[list[int]], normalize: bool = True) -> np.ndarray:
    return await state.scheduler.run(lambda engine: engine.embed(tokens, normalize=normalize))


def _check_dimensions(state: ServerState, f: Fields) -> None:
    n = state.engine.config.n_embd
    dims = f.get("dimensions", int, None, lo=1)
    if dims is not None and dims != n:
        raise ApiError(400, f"dimensions: this model's embeddings have {n}; shortened embeddings are not "
                            "supported", param="dimensions")


# ---- OpenAI ------------------------------------------------------------------------------------------------


async def openai_embeddings(state: ServerState, request: Request):
    f = Fields(await read_json(request, state.max_body))
    items = _texts(f, "input", allow_tokens=True)
    encoding = f.get("encoding_format", str, "float")
    if encoding not in ("float", "base64"):
        raise ApiError(400, "encoding_format must be 'float' or 'base64'", param="encoding_format")
    _check_dimensions(state, f)
    tokens = await off_loop(_tokenize, state, items, "input")
    vectors = await _embed(state, tokens)
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if encoding == "base64"
             else v.tolist()} for i, v in enumerate(vectors)]
    n = sum(len(t) for t in tokens)
    return json_response({"object": "list", "data": data, "model": state.model_name,
                          "usage": {"prompt_tokens": n, "total_tokens": n}})


# ---- Ollama ------------------------------------------------------------------------------------------------


async def ollama_embed(state: ServerState, request: Request):
    start = time.perf_counter_ns()
    f = Fields(await read_json(request, state.max_body))
    items = _texts(f, "input", allow_tokens=False)
    truncate = f.get("truncate", bool, True)
    _check_dimensions(state, f)
    tokens = await off_loop(_tokenize, state, items, "input", truncate)
    vectors = await _embed(state, tokens)
    # Ollama's EmbedResponse, in its field order (its load_duration of 0 left out: omitempty), the vectors
    # written as Go writes []float32: "-0.01379362", not the float64 repr "-0.01379362028092146"
    head = dumps_go({"model": f.get("model", str, state.model_name)})
    tail = dumps_go({"total_duration": time.perf_counter_ns() - start,
                     "prompt_eval_count": sum(len(t) for t in tokens)})
    text = await off_loop(lambda: f'{head[:-1]},"embeddings":{go_float32_rows(vectors)},{tail[1:]}')
    return Response(text.encode(), media_type="application/json; charset=utf-8")


async def ollama_embeddings(state: ServerState, request: Request):
    """The older route: one `prompt`, one unnormalized `embedding` (as Ollama returns it)."""
    f = Fields(await read_json(request, state.max_body))
    prompt = f.get("prompt", str, None)
    if prompt is None:
        raise ApiError(400, "'prompt' is required", param="prompt")
    if not prompt:
        return ollama_response({"embedding": []})  # Ollama answers an empty prompt with an empty vector
    tokens = await off_loop(_tokenize, state, [prompt], "prompt", True)
    vectors = await _embed(state, tokens, normalize=False)
    return ollama_response({"embedding": vectors[0].tolist()})


# ---- llama.cpp ---------------------------------------------------------------------------------------------


async def llamacpp_embedding(state: ServerState, request: Request):
    f = Fields(await read_json(request, state.max_body))
    key = "content" if f.has("content") else "input"
    items = _texts(f, key, allow_tokens=True)
    norm = f.get("embd_normalize", int, 2)
    if norm not in (-1, 2):
        raise ApiError(400, "embd_normalize: 2 (Euclidean, the default) or -1 (none) are supported",
                       param="embd_normalize")
    tokens = await off_loop(_tokenize, state, items, key)
    vectors = await _embed(state, tokens, normalize=norm == 2)
    # llama.cpp's shape: one entry per text, its pooled vector as the one row of `embedding`
    return json_response([{"index": i, "embedding": [v.tolist()]} for i, v in enumerate(vectors)])


ROUTES = [
    ("/v1/embeddings", ["POST"], openai_embeddings),
    ("/embeddings", ["POST"], llamacpp_embedding),
    ("/embedding", ["POST"], llamacpp_embedding),
    ("/api/embed", ["POST"], ollama_embed),
    ("/api/embeddings", ["POST"], ollama_embeddings),
]
