"""OpenAI-compatible endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions.

Sampling follows OpenAI's meaning of the knobs (temperature 1 and top_p 1 by default, no top-k or min-p unless
the llama.cpp extensions `top_k`, `min_p`, `repeat_penalty` are given; `ignore_eos` too). Any model name is accepted (the server
runs one model, as llama.cpp's server does); responses name the model that ran.
"""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import StreamingResponse

from localllm.runtime.engine import GenerationParams
from localllm.server.app import (ApiError, Fields, Final, ServerState, check_max_tokens, collect, constrain,
                                 first_item, fix_seed, id_slot, json_response, off_loop, prompt_tokens, read_json,
                                 render_system_anywhere, sampling_from, sse, stream_error, stream_events, submit)
from localllm.server import llamacpp_ext as ext
from localllm.server import tool_calls
from localllm.server.infill import infill_tokens
from localllm.chat.tool_formats import CallDelta, TextDelta

MAX_TOP_LOGPROBS = 20


def model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "localllm",
            "meta": {"n_ctx": state.engine.ctx, "n_vocab": state.engine.config.vocab_size}}


async def list_models(state: ServerState, request: Request):
    if state.registry is not None:
        from localllm.server import models_api

        return json_response({"object": "list", "data": await off_loop(models_api.model_cards, state)})
    return json_response({"object": "list", "data": [model_card(state)]})


async def get_model(state: ServerState, request: Request):
    name = request.path_params["model"]
    if state.registry is not None:
        from localllm.server import models_api

        return json_response(await off_loop(models_api.model_card, state, name))
    if name != state.model_name:
        raise ApiError(404, f"the model '{name}' does not exist (this server runs '{state.model_name}')",
                       param="model", kind="invalid_request_error")
    return json_response(model_card(state))


def _logit_bias(f: Fields, vocab: int) -> dict[int, float]:
    raw = f.get("logit_bias", dict, {})
    out = {}
    for key, value in raw.items():
        try:
            tok = int(key)
        except ValueError:
            tok = -1
        if not 0 <= tok < vocab:
            raise ApiError(400, f"logit_bias: {key!r} is not a token id of this model (0..{vocab - 1})",
                           param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ApiError(400, f"logit_bias: the bias of token {key} must be a number in [-100, 100]",
                           param="logit_bias")
        out[tok] = float(value)
    return out


def _common(state: ServerState, f: Fields, max_key_default: int | None) -> tuple[GenerationParams, dict]:
    """Parameters shared by completions and chat completions."""
    f.get("model", str)
    if f.get("n", int, 1) != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    vocab = state.engine.config.vocab_size
    sampling = sampling_from(f, "openai", vocab)
    fix_seed(sampling)
    sampling.logit_bias = _logit_bias(f, vocab)
    key = "max_completion_tokens" if f.has("max_completion_tokens") else "max_tokens"
    max_tokens = check_max_tokens(state, f.get(key, int, max_key_default, lo=1), key)
    options = f.get("stream_options", dict, {})
    include_usage = Fields(options, "stream_options.").get("include_usage", bool, False)
    stream = f.get("stream", bool, False)
    if options and not stream:
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true", param="stream_options")
    params = GenerationParams(max_tokens=max_tokens, stop=f.stop("stop"), sampling=sampling,
                              ignore_eos=f.get("ignore_eos", bool, False))  # llama.cpp's extension
    # llama.cpp's extensions, as its server takes them here too: n_predict wins over max_tokens (0 is a cache
    # warm-up: llama.vim sends one while the user types an instruction), samplers, t_max_predict_ms.
    n_predict = ext.n_predict(f, state, keys=("n_predict",))
    if n_predict is not None:
        params.max_tokens = n_predict
    ext.apply_samplers(f, sampling)
    ext.time_caps(f, params)
    return params, {"stream": stream, "include_usage": include_usage}


async def _response_format(state: ServerState, f: Fields, params: GenerationParams) -> None:
    """OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
    "schema", "strict"}}), and llama.cpp's extensions on these endpoints: `json_schema` and `grammar` (GBNF)."""
    from localllm.chat.grammar import ANY_JSON_OBJECT

    fmt = f.get("response_format", dict, None)
    schema = gbnf = None
    param = "response_format"
    if fmt is not None:
        rf = Fields(fmt, "response_format.")
        kind = rf.get("type", str, "text")
        if kind == "json_object":
            schema = ANY_JSON_OBJECT
        elif kind == "json_schema":
            js = Fields(rf.get("json_schema", dict, {}), "response_format.json_schema.")
            js.get("name", str)
            strict = js.get("strict", bool, False)
            # Without a schema, any JSON object (what llama.cpp's server does too).
            schema = js.data.get("schema", ANY_JSON_OBJECT)
            if not isinstance(schema, (dict, bool)):
                raise ApiError(400, "'response_format.json_schema.schema' must be a JSON schema (an object)",
                               param="response_format")
            if not strict and isinstance(schema, dict) and schema is not ANY_JSON_OBJECT:
                # Not strict: what the grammar engine cannot enforce is relaxed (and logged), as llama.cpp's
                # converter ignores it; strict: such a schema fails closed, naming the keyword.
                tool_calls.log_relaxed("response_format", schema)
                schema = tool_calls.lenient(schema)
        elif kind != "text":
            raise ApiError(400, f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got "
                                f"{kind!r}", param="response_format")
    if schema is None and f.has("json_schema"):
        schema, param = f.get("json_schema", dict), "json_schema"
    if schema is None and f.get("grammar", str):
        gbnf, param = f.get("grammar", str), "grammar"
    await constrain(state, params, param, json_schema=schema, gbnf=gbnf)


def _usage(final: Final) -> dict:
    return {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens,
            "total_tokens": final.prompt_tokens + final.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": final.cached_tokens}}


def _visible(state: ServerState, event) -> bool:
    """Whether a token counts as output (the end-of-generation token that stopped it does not)."""
    return event.token is not None and not (event.finish_reason == "stop"
                                            and state.engine.tokenizer.is_eog(event.token))


# ---- completions ---------------------------------------------------------------------------------------


def _prompt_tokens(state: ServerState, prompt) -> list[int]:
    tok = state.engine.tokenizer
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt_tokens(state, prompt)
    if (isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < tok.vocab_size for t in prompt)):
        return list(prompt)
    raise ApiError(400, "'prompt' must be a string, or an array of token ids of this model (one prompt per "
                        "request)", param="prompt")


def _completion_logprobs(state: ServerState, events, offset0: int = 0) -> dict:
    tok = state.engine.tokenizer
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = offset0
    for e in events:
        if not _visible(state, e):
            continue
        out["tokens"].append(tok.piece(e.token))
        out["token_logprobs"].append(e.logprob)
        out["top_logprobs"].append({tok.piece(t): lp for t, lp in e.top_logprobs})
        out["text_offset"].append(offset)
        offset += len(e.text)
    return out


async def completions(state: ServerState, request: Request):
    f = Fields(await read_json(request, state.max_body))
    if "prompt" not in f.data:
        raise ApiError(400, "'prompt' is required", param="prompt")
    params, opts = _common(state, f, min(16, state.max_tokens))  # OpenAI's default for completions is 16
    n_logprobs = f.get("logprobs", int, None, lo=0, hi=MAX_TOP_LOGPROBS)
    if f.get("echo", bool, False):
        raise ApiError(400, "'echo' is not supported", param="echo")
    if f.get("best_of", int, 1) != 1:
        raise ApiError(400, "only best_of=1 is supported", param="best_of")
    params.sampling.n_probs = n_logprobs or 0
    params.sampling.logprob = n_logprobs is not None
    await _response_format(state, f, params)
    if f.get("suffix", str):
        # Fill in the middle between prompt and suffix with the model's FIM tokens, as Ollama does (Tabby's
        # openai/completion sends {prompt, suffix}).
        prompt = f.data["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ApiError(400, "with 'suffix', 'prompt' must be a string", param="prompt")
        if not {"pre", "suf", "mid"} <= set(state.engine.tokenizer.fim):
            raise ApiError(400, f"'suffix' needs a model with fill-in-the-middle tokens (e.g. qwen2.5-coder); "
                                f"{state.model_name} has none", param="suffix")
        tokens = await off_loop(infill_tokens, state.engine, prompt, f.data["suffix"])
    else:
        tokens = await off_loop(_prompt_tokens, state, f.data["prompt"])
    handle = submit(state, tokens, params, id_slot(f))
    cid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), state.model_name

    def body(choices, usage=None):
        out = {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": choices,
               "system_fingerprint": "localllm"}
        if usage is not None:
            out["usage"] = usage
        return out

    if not opts["stream"]:
        events, final = await collect(request, handle)
        choice = {"text": "".join(e.text for e in events), "index": 0,
                  "logprobs": _completion_logprobs(state, events) if n_logprobs is not None else None,
                  "finish_reason": final.finish_reason}
        return json_response(body([choice], _usage(final)))

    first = await first_item(request, handle)

    async def stream():
        offset = 0
        try:
            async for item in stream_events(handle, first):
                if isinstance(item, Final):
                    if opts["include_usage"]:
                        yield sse(body([], _usage(item)))
                    break
                if not item.text and item.finish_reason is None and n_logprobs is None:
                    continue
                lp = _completion_logprobs(state, [item], offset) if n_logprobs is not None else None
                offset += len(item.text)
                chunk = body([{"text": item.text, "index": 0, "logprobs": lp,
                               "finish_reason": item.finish_reason}])
                if opts["include_usage"]:
                    chunk["usage"] = None
                yield sse(chunk)
        except ApiError as e:
            yield sse(stream_error(e, "openai"))
        yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# ---- chat completions ----------------------------------------------------------------------------------


def _chat_logprob(state: ServerState, event, n_top: int) -> dict:
    tok = state.engine.tokenizer

    def entry(t, lp):
        b = tok.piece_bytes(t)
        return {"token": b.decode("utf-8", "replace"), "logprob": lp, "bytes": list(b)}

    out = entry(event.token, event.logprob)
    out["top_logprobs"] = [entry(t, lp) for t, lp in event.top_logprobs[:n_top]]
    return out


def chat_prompt(state: ServerState, messages) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array of messages", param="messages")
    # validates roles and contents (LocalLLMError -> 400); system messages after the first where they stand,
    # or folded into the system prompt where the template takes one only
    prompt = render_system_anywhere(state.engine.render_chat, messages)
    return prompt_tokens(state, prompt, chat=True)


async def chat_completions(state: ServerState, request: Request):
    f = Fields(await read_json(request, state.max_body))
    if "messages" not in f.data:
        raise ApiError(400, "'messages' is required", param="messages")
    params, opts = _common(state, f, None)
    want_logprobs = f.get("logprobs", bool, False)
    n_top = f.get("top_logprobs", int, 0, lo=0, hi=MAX_TOP_LOGPROBS)
    if n_top and not want_logprobs:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    params.sampling.n_probs = n_top
    params.sampling.logprob = want_logprobs
    tools = f.get("tools", list, None)
    await _response_format(state, f, params)
    plan = None
    if tool_calls.uses_tools(tools, f.data.get("tool_choice"), f.data["messages"]):
        plan = await tool_calls.prepare(state, params, tools or [], f.data.get("tool_choice"),
                                        f.get("parallel_tool_calls", bool, None))
        # Off the event loop: a model's template may take its whole render budget (2 s).
        tokens = await off_loop(tool_calls.prompt, state, plan, f.data["messages"])
    else:
        # Off the event loop: a model's template may take its whole render budget (2 s) and /health must answer.
        tokens = await off_loop(chat_prompt, state, f.data["messages"])
    calling = plan is not None and plan.choice != "none"
    handle = submit(state, tokens, params, id_slot(f))
    cid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), state.model_name

    if not opts["stream"]:
        events, final = await collect(request, handle)
        logprobs = None
        if want_logprobs:
            logprobs = {"content": [_chat_logprob(state, e, n_top) for e in events if _visible(state, e)]}
        message = {"role": "assistant", "content": "".join(e.text for e in events)}
        finish = final.finish_reason
        if calling:
            parser = plan.parser()
            parser.feed(message["content"])
            parser.finish()
            message["content"] = parser.content if parser.content or not parser.calls else None
            if parser.calls:
                message["tool_calls"] = [c.as_openai() for c in parser.calls]
                finish = "tool_calls" if finish == "stop" else finish
        return json_response({
            "id": cid, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": "localllm",
            "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}],
            "usage": _usage(final)})

    def chunk(delta, finish=None, logprobs=None):
        out = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
               "system_fingerprint": "localllm",
               "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if opts["include_usage"]:
            out["usage"] = None
        return out

    first = await first_item(request, handle)
    parser = plan.parser() if calling else None

    async def stream():
        yield sse(chunk({"role": "assistant", "content": ""}))
        try:
            async for item in stream_events(handle, first):
                if isinstance(item, Final):
                    if opts["include_usage"]:
                        last = chunk({})
                        last["choices"], last["usage"] = [], _usage(item)
                        yield sse(last)
                    break
                lp = None
                if want_logprobs and _visible(state, item):
                    lp = {"content": [_chat_logprob(state, item, n_top)]}
                finish = item.finish_reason
                if parser is None:
                    if item.text or lp:
                        yield sse(chunk({"content": item.text}, logprobs=lp))
                else:
                    deltas = parser.feed(item.text) + (parser.finish() if finish is not None else [])
                    for delta in filter(None, map(_tool_delta, deltas)):
                        yield sse(chunk(delta, logprobs=lp))
                        lp = None
                    if lp:
                        yield sse(chunk({}, logprobs=lp))
                    if finish == "stop" and parser.calls:
                        finish = "tool_calls"
                if finish is not None:
                    yield sse(chunk({}, finish))
        except ApiError as e:
            yield sse(stream_error(e, "openai"))
        yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _tool_delta(delta) -> dict | None:
    """A chunk's delta for a parser delta: content, or a tool call's first piece (index, id, name) or a
    fragment of its arguments."""
    if isinstance(delta, TextDelta):
        return {"content": delta.text}
    if isinstance(delta, CallDelta) and delta.id is not None:
        return {"tool_calls": [{"index": delta.index, "id": delta.id, "type": "function",
                                "function": {"name": delta.name, "arguments": delta.arguments}}]}
    if isinstance(delta, CallDelta) and delta.arguments:
        return {"tool_calls": [{"index": delta.index, "function": {"arguments": delta.arguments}}]}
    return None  # a call's end: nothing to send


ROUTES = [
    ("/v1/models", ["GET"], list_models),
    ("/v1/models/{model:path}", ["GET"], get_model),
    ("/v1/completions", ["POST"], completions),
    ("/v1/chat/completions", ["POST"], chat_completions),
]
