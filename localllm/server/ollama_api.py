"""Ollama-compatible endpoints: GET /api/tags, /api/ps, /api/version; POST /api/show, /api/generate, /api/chat.

Streams are NDJSON and streaming is the default, as in Ollama. Sampling defaults are Ollama's (temperature 0.8,
top-k 40, top-p 0.9, repeat penalty 1.1 over the last 64 tokens); options.num_predict -1 means "until the model
stops" (up to the server's --max-tokens). /api/generate applies the chat template unless `raw` is true, and
with a `suffix` it fills in the middle, as Ollama does for code models.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import time
from pathlib import Path

from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse

from localllm import __version__
from localllm.chat.history import fit_messages
from localllm.runtime.engine import GenerationParams
from localllm.server.app import (ApiError, Fields, Final, ServerState, collect, constrain, first_item, fix_seed,
                                 ndjson_line, off_loop, ollama_response, prompt_tokens, read_json,
                                 render_system_anywhere, sampling_from, stream_error, stream_events, submit)
from localllm.server import models_api, tool_calls
from localllm.server.infill import infill_tokens
from localllm.chat.tool_formats import CallDelta, TextDelta, supports_tools



def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _model_facts(path: str) -> dict:
    # One digest and date per file for every route, whether one model is served or several (models_api).
    return models_api.model_facts(Path(path))


def _details(state: ServerState) -> dict:
    return models_api.details(_model_facts(state.model_path))


def _model_entry(state: ServerState) -> dict:
    info = _model_facts(state.model_path)
    return {"name": state.model_name, "model": state.model_name, "modified_at": info["modified_at"],
            "size": info["file_size"], "digest": info["digest"], "details": _details(state)}


async def root(state: ServerState, request: Request):
    return PlainTextResponse("Ollama is running (localllm)")


async def version(state: ServerState, request: Request):
    return ollama_response({"version": __version__})


async def tags(state: ServerState, request: Request):
    if state.registry is not None:  # the models this server serves that are in the store
        return ollama_response({"models": await off_loop(models_api.tags, state)})
    return ollama_response({"models": [_model_entry(state)]})


async def ps(state: ServerState, request: Request):
    if state.registry is not None:  # the models loaded now, and until when
        return ollama_response({"models": await off_loop(models_api.ps, state)})
    entry = _model_entry(state)
    return ollama_response({"models": [models_api.ps_entry(entry, entry["size"], "2999-01-01T00:00:00Z",
                                                           state.engine.ctx)]})


async def show(state: ServerState, request: Request):
    f = Fields(await read_json(request, state.max_body))
    name = f.get("model", str) or f.get("name", str)
    if not name:
        raise ApiError(400, "'model' is required", param="model")
    info = _model_facts(state.model_path)
    arch = info["architecture"]
    capabilities = ["completion"] + (["insert"] if {"pre", "suf", "mid"} <= set(state.engine.tokenizer.fim)
                                     else [])
    # "tools" where the model's own template renders them (a probe render; off the loop: a template may take
    # its render budget). Any model takes tools on /api/chat, through the generic JSON form otherwise.
    if await off_loop(supports_tools, state.engine.template):
        capabilities.append("tools")
    # /api/embed answers with every model (its hidden states pooled): clients such as llm-ollama look for this
    # to offer the model for embeddings.
    capabilities.append("embedding")
    model_info = {"general.architecture": arch, "general.parameter_count": info["parameters"],
                  f"{arch}.context_length": info["context_length"],
                  f"{arch}.embedding_length": info["embedding_length"], f"{arch}.block_count": info["block_count"]}
    # Ollama's ShowResponse, in its fields' order; its empty strings are left out (omitempty) and model_info,
    # a Go map, is written with sorted keys.
    return ollama_response(go_omitempty({
        "license": "", "modelfile": f"FROM {state.model_name}\n", "parameters": "",
        "template": state.engine.template.source or "", "details": _details(state),
        "model_info": dict(sorted(model_info.items())), "capabilities": capabilities,
        "modified_at": info["modified_at"]}, ("license", "parameters", "template")))


def _params(state: ServerState, f: Fields) -> GenerationParams:
    opts = Fields(f.get("options", dict, {}), "options.")
    sampling = sampling_from(opts, "ollama", state.engine.config.vocab_size)
    fix_seed(sampling)
    n = opts.get("num_predict", int, -1)
    if n is None or n < 0:
        max_tokens = state.max_tokens
    elif n > state.max_tokens:
        raise ApiError(400, f"options.num_predict is {n} but this server generates at most {state.max_tokens} "
                            "tokens per request (localllm serve --max-tokens)")
    elif n == 0:
        raise ApiError(400, "options.num_predict 0 asks for nothing")
    else:
        max_tokens = n
    if f.get("images", list, []):
        raise ApiError(400, "images are not supported by this model")
    return GenerationParams(max_tokens=max_tokens, stop=opts.stop("stop"), sampling=sampling)


async def _format(state: ServerState, f: Fields, params: GenerationParams) -> None:
    """Ollama's structured output: `format` is "json" (any JSON object) or a JSON schema."""
    from localllm.chat.grammar import ANY_JSON_OBJECT

    fmt = f.data.get("format")
    if fmt in (None, ""):
        return
    if fmt == "json":
        fmt = ANY_JSON_OBJECT
    elif not isinstance(fmt, dict):
        raise ApiError(400, f"'format' must be \"json\" or a JSON schema object, got {json.dumps(fmt)[:80]}",
                       param="format")
    await constrain(state, params, "format", json_schema=fmt)


def go_omitempty(body: dict, keys=("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration",
                                   "eval_count", "eval_duration")) -> dict:
    """`body` less the `keys` whose value is zero or empty: Ollama's structs tag them omitempty (its Metrics:
    a duration or count of 0 is not written)."""
    return {k: v for k, v in body.items() if not (k in keys and v in (0, "", None))}


def _durations(final: Final, started: float) -> dict:
    t = final.timings
    return go_omitempty({"total_duration": int((time.perf_counter() - started) * 1e9), "load_duration": 0,
                         "prompt_eval_count": final.prompt_tokens,
                         "prompt_eval_duration": int(t["prompt_ms"] * 1e6), "eval_count": final.completion_tokens,
                         "eval_duration": int(t["predicted_ms"] * 1e6)})


async def _respond(state: ServerState, request: Request, f: Fields, tokens, params, shape, parser=None):
    """Run the request; `shape(text)` is the per-message payload ({"response": text} or {"message": ...});
    with a tool-call `parser`, `shape(text, calls)` (calls in Ollama's shape) and the answer is parsed: content
    streams as it comes, each call in a message of its own once complete."""
    started = time.perf_counter()
    stream = f.get("stream", bool, True)
    handle = submit(state, tokens, params)
    model = f.get("model", str) or state.model_name

    def done(final: Final, text: str, generated: list[int]) -> dict:
        # Ollama's GenerateResponse / ChatResponse field order: ..., done, done_reason, context, the metrics
        out = {"model": model, "created_at": _now(), **shape(text), "done": True,
               "done_reason": final.finish_reason}
        if "response" in out:
            out["context"] = tokens + generated
        out.update(_durations(final, started))
        return out

    if not stream:
        events, final = await collect(request, handle)
        generated = [e.token for e in events if e.token is not None]
        text = "".join(e.text for e in events)
        if parser is None:
            return ollama_response(done(final, text, generated))
        parser.feed(text)
        parser.finish()
        out = done(final, "", generated)
        out.update(shape(parser.content, _ollama_calls(parser.calls)))  # (replaces the value: keeps its place)
        return ollama_response(out)

    first = await first_item(request, handle)

    def line(payload: dict) -> str:
        return ndjson_line({"model": model, "created_at": _now(), **payload, "done": False})

    async def lines():
        generated = []
        try:
            async for item in stream_events(handle, first):
                if isinstance(item, Final):
                    yield ndjson_line(done(item, "", generated))
                    return
                if item.token is not None:
                    generated.append(item.token)
                if parser is not None:
                    deltas = parser.feed(item.text) + (parser.finish() if item.finish_reason is not None else [])
                    for d in deltas:
                        if isinstance(d, TextDelta):
                            yield line(shape(d.text, []))
                        elif isinstance(d, CallDelta) and d.done is not None and _ollama_calls([d.done]):
                            yield line(shape("", _ollama_calls([d.done])))
                elif item.text:
                    yield line(shape(item.text))
        except ApiError as e:
            yield ndjson_line(stream_error(e, "ollama"))

    return StreamingResponse(lines(), media_type="application/x-ndjson")


_BARE_TEMPLATE = re.compile(r"\s*\{\{-?\s*\.Prompt\s*-?\}\}\s*")


def _is_fim_prompt(state: ServerState, prompt: str) -> bool:
    """A prompt already laid out with the model's fill-in-the-middle tokens (Twinny sends
    "<|fim_prefix|>...<|fim_suffix|>...<|fim_middle|>" without 'raw'). Ollama runs it as is for code models,
    whose template is the bare prompt; wrapped in a chat turn it would be a question about FIM tokens."""
    fim = state.engine.tokenizer.fim
    if not {"pre", "mid"} <= set(fim):
        return False
    tok = state.engine.tokenizer
    marks = [tok.piece(fim[role]) for role in ("pre", "mid")]
    if not all(m and m in prompt for m in marks):
        return False
    ids = set(tok.encode(prompt, add_special=False, parse_special=True))
    return fim["pre"] in ids and fim["mid"] in ids


async def generate(state: ServerState, request: Request):
    f = Fields(await read_json(request, state.max_body))
    prompt = f.get("prompt", str, "")
    suffix = f.get("suffix", str, "")
    system = f.get("system", str, "")
    raw = f.get("raw", bool, False)
    f.get("model", str)
    context = f.get("context", list, [])
    vocab = state.engine.tokenizer.vocab_size
    if len(context) >= state.engine.ctx:  # before looking at each id: a 4 MB body holds two million
        raise ApiError(400, f"'context' is {len(context)} tokens but the context holds {state.engine.ctx}")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in context):
        raise ApiError(400, "'context' must be token ids of this model")
    if f.has("template"):
        # Tabby's Ollama binding sends the bare-prompt template "{{ .Prompt }}", which is raw mode; other
        # templates are not supported.
        if not _BARE_TEMPLATE.fullmatch(f.get("template", str)):
            raise ApiError(400, "a custom 'template' is not supported; use 'raw': true with a formatted prompt")
        raw = True
    params = _params(state, f)
    await _format(state, f, params)
    if not prompt and not suffix and not context:
        # Ollama answers an empty prompt by loading the model: it is loaded.
        return ollama_response({"model": f.get("model", str) or state.model_name, "created_at": _now(),
                              "response": "", "done": True, "done_reason": "load"})
    if suffix:
        tokens = await off_loop(infill_tokens, state.engine, prompt, suffix, n_predict=params.max_tokens or 0)
    elif raw or _is_fim_prompt(state, prompt):
        tokens = await off_loop(prompt_tokens, state, prompt)
    else:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user",
                                                                                  "content": prompt}]
        # Off the event loop: a model's template may take its whole render budget (2 s).
        tokens = await off_loop(lambda: prompt_tokens(state, state.engine.render_chat(messages), chat=True))
    if context:
        tokens = context + (tokens[1:] if tokens and tokens[0] == state.engine.tokenizer.bos_id else tokens)
    return await _respond(state, request, f, tokens, params, lambda text: {"response": text})


async def chat(state: ServerState, request: Request):
    f = Fields(await read_json(request, state.max_body))
    f.get("model", str)
    messages = f.get("messages", list, None)
    if not messages:
        raise ApiError(400, "'messages' must be a non-empty array of messages")
    tools = f.get("tools", list, None)
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object with 'role' and 'content'")
        mf = Fields(m, f"messages[{i}].")
        if mf.get("images", list, []):
            raise ApiError(400, "images are not supported by this model")
        msg = {"role": mf.get("role", str, ""), "content": mf.get("content", str, "")}
        # A call the assistant made ({"function": {"name", "arguments": {...}}}) and a tool's result
        # (`tool_name`): the template renders them in the model's own form.
        if mf.get("tool_calls", list, []):
            msg["tool_calls"] = mf.get("tool_calls", list)
        if msg["role"] == "tool" and mf.get("tool_name", str):
            msg["tool_name"] = mf.get("tool_name", str)
        clean.append(msg)
    params = _params(state, f)
    await _format(state, f, params)
    plan = None
    if tool_calls.uses_tools(tools, None, clean):
        plan = await tool_calls.prepare(state, params, tools or [])
    # As Ollama does: a conversation longer than the context loses its oldest turns (the system prompt and the
    # last message stay) rather than failing.
    room = max(1, min(params.max_tokens or state.engine.ctx // 4, state.engine.ctx // 4))
    # Off the event loop: a model's template may take its whole render budget (2 s) and /health must answer.
    tokens = await off_loop(_chat_tokens, state, clean, room, plan)
    if plan is None or plan.choice == "none":
        return await _respond(state, request, f, tokens, params,
                              lambda text: {"message": {"role": "assistant", "content": text}})

    def shape(text, calls=None):
        message = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        return {"message": message}

    return await _respond(state, request, f, tokens, params, shape, parser=plan.parser())


def _ollama_calls(calls) -> list[dict]:
    """Ollama's tool calls: arguments as an object (a call cut short by the token limit is left out: its
    arguments are not an object yet)."""
    return [{"function": {"index": i, "name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(calls) if c.arguments is not None]


def _chat_tokens(state: ServerState, messages: list[dict], room: int, plan=None) -> list[int]:
    if plan is None:
        kept, _ = fit_messages(state.engine, messages, room)
        return prompt_tokens(state, render_system_anywhere(state.engine.render_chat, kept), chat=True)
    kept, _ = fit_messages(state.engine, messages, room,
                           render=lambda msgs: plan.render(state.engine.template, msgs))
    return tool_calls.prompt(state, plan, kept)


ROUTES = [
    ("/", ["GET", "HEAD"], root),
    ("/api/version", ["GET"], version),
    ("/api/tags", ["GET"], tags),
    ("/api/ps", ["GET"], ps),
    ("/api/show", ["POST"], show),
    ("/api/generate", ["POST"], generate),
    ("/api/chat", ["POST"], chat),
]
