"""llama.cpp-server-compatible endpoints: POST /completion, /infill, /tokenize, /detokenize; GET /health,
/props, /metrics. Field names, defaults (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05) and response
shapes follow llama.cpp's `tools/server`, including `n_indent` for code completion (see `infill.IndentCut`)."""

from __future__ import annotations

import dataclasses
import json

from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse

from localllm import __version__
from localllm.runtime.engine import GenerationParams
from localllm.server.app import (ApiError, Fields, Final, ServerState, constrain, first_item, fix_seed, id_slot,
                                 json_response, off_loop, prompt_tokens, read_json, render_system_anywhere,
                                 sampling_from, sse, stream_error, stream_events, submit, watching_disconnect)
from localllm.server import llamacpp_ext as ext
from localllm.server.infill import IndentCut, infill_tokens



def _prompt_tokens(state: ServerState, prompt) -> list[int]:
    """A string, or an array mixing token ids and strings (llama.cpp's multimodal-free prompt forms)."""
    engine = state.engine
    vocab = engine.tokenizer.vocab_size
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt_tokens(state, prompt)
    if isinstance(prompt, list) and prompt:
        at_least = sum(engine.tokenizer.min_tokens(p) for p in prompt if isinstance(p, str))
        if at_least + 1 > engine.ctx:
            raise ApiError(400, f"the prompt is at least {at_least} tokens but the context holds {engine.ctx}",
                           param="prompt")
        out: list[int] = []
        for i, part in enumerate(prompt):
            if isinstance(part, str):
                out += engine.tokenizer.encode(part, add_special=(i == 0), parse_special=True)
            elif isinstance(part, int) and not isinstance(part, bool) and 0 <= part < vocab:
                out.append(part)
            else:
                raise ApiError(400, f"'prompt' item {i} must be a string or a token id (0..{vocab - 1})",
                               param="prompt")
        return out
    raise ApiError(400, "'prompt' must be a string or an array of token ids and strings", param="prompt")


def _logit_bias(f: Fields, vocab: int) -> dict[int, float]:
    """[[token, bias], ...] or {"token": bias}; a bias of false bans the token."""
    raw = f.data.get("logit_bias")
    if raw is None:
        return {}
    pairs = list(raw.items()) if isinstance(raw, dict) else raw
    if not isinstance(pairs, list):
        raise ApiError(400, "'logit_bias' must be an array of [token, bias] pairs or an object", param="logit_bias")
    out = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ApiError(400, "'logit_bias' entries must be [token, bias]", param="logit_bias")
        tok, bias = pair
        try:
            tok = int(tok) if isinstance(tok, (int, str)) and not isinstance(tok, bool) else -1
        except ValueError:
            tok = -1
        if not 0 <= tok < vocab:
            raise ApiError(400, f"logit_bias: {json.dumps(pair[0])[:40]} is not a token id of this model "
                                f"(0..{vocab - 1})", param="logit_bias")
        if bias is False:
            out[tok] = float("-inf")
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -1e6 <= bias <= 1e6:
            raise ApiError(400, f"logit_bias: the bias of token {tok} must be a number or false", param="logit_bias")
        else:
            out[tok] = float(bias)
    return out


def generation_params(state: ServerState, f: Fields) -> GenerationParams:
    vocab = state.engine.config.vocab_size
    sampling = sampling_from(f, "llamacpp", vocab)
    if sampling.seed is not None and sampling.seed < 0:
        sampling.seed = None  # -1: a random seed, as llama.cpp
    fix_seed(sampling)
    sampling.logit_bias = _logit_bias(f, vocab)
    sampling.n_probs = f.get("n_probs", int, 0, lo=0, hi=100)
    ext.apply_samplers(f, sampling)
    # n_predict (or its aliases max_tokens, max_completion_tokens); 0 is a cache warm-up, as in llama.cpp.
    max_tokens = ext.n_predict(f, state)
    params = GenerationParams(max_tokens=state.max_tokens if max_tokens is None else max_tokens,
                              stop=f.stop("stop"), sampling=sampling, ignore_eos=f.get("ignore_eos", bool, False))
    ext.time_caps(f, params)
    return params


def _settings(state: ServerState, params: GenerationParams) -> dict:
    s = params.sampling
    # In the order of llama.cpp's task_params::to_json, then the two it no longer writes there
    return {"seed": s.seed, "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
            "repeat_last_n": s.repeat_last_n, "repeat_penalty": s.repeat_penalty,
            "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty, "stop": params.stop,
            "n_predict": params.max_tokens, "ignore_eos": params.ignore_eos, "n_probs": s.n_probs,
            "n_ctx": state.engine.ctx, "model": state.model_name}


# llama.cpp's result_timings::to_json order; the keys it does not write follow in their own order
_TIMINGS_ORDER = ("cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
                  "predicted_ms", "predicted_per_token_ms", "predicted_per_second")


def _timings(timings: dict) -> dict:
    out = {k: timings[k] for k in _TIMINGS_ORDER if k in timings}
    out.update((k, v) for k, v in timings.items() if k not in out)
    return out


def _probs(state: ServerState, event) -> dict:
    tok = state.engine.tokenizer

    def entry(t, lp):
        b = tok.piece_bytes(t)
        return {"id": t, "token": b.decode("utf-8", "replace"), "logprob": lp, "bytes": list(b)}

    out = entry(event.token, event.logprob)
    out["top_logprobs"] = [entry(t, lp) for t, lp in event.top_logprobs]
    return out


def _final(state: ServerState, params, final: Final, content: str, tokens: list[int], text: str,
           slot: int) -> dict:
    """The last answer of a request, keys in the order of llama.cpp's to_json_non_oaicompat (final); `text` is
    all that was generated (`content` is "" at the end of a stream, which sent it already)."""
    stop_type = "limit" if final.finish_reason == "length" else ("word" if final.stop_word else "eos")
    # tokens_cached is llama.cpp's: the tokens the KV cache holds after the request (the prompt and what was
    # generated, less the last token, which is never evaluated); timings.cache_n counts the prompt tokens reused.
    return {"index": 0, "content": content, "tokens": tokens, "id_slot": slot, "stop": True,
            "model": state.model_name, "tokens_predicted": final.completion_tokens,
            "tokens_evaluated": final.prompt_tokens, "generation_settings": _settings(state, params),
            "has_new_line": "\n" in text, "truncated": False, "stop_type": stop_type,
            "stopping_word": final.stop_word or "",
            "tokens_cached": final.prompt_tokens + max(final.completion_tokens - 1, 0),
            "timings": _timings(final.timings or {})}


async def _items(handle, first, n_indent: int, n_prompt: int):
    """The request's events then its Final, with llama.cpp's n_indent cut applied."""
    cut = IndentCut(n_indent) if n_indent > 0 else None
    n = 0
    async for item in stream_events(handle, first):
        if cut is None or isinstance(item, Final):
            yield item
            continue
        n += 1
        text, stop = cut.feed(item.text)
        if not stop:
            yield item
            continue
        handle.cancel()  # the completion left the block: stop generating now
        t = item.timings
        yield dataclasses.replace(item, text=text, finish_reason="length")
        yield Final("length", n_prompt, n, t.cache_n if t else 0, None, t.to_dict() if t else {})
        return


async def _run(state: ServerState, request: Request, f: Fields, tokens: list[int], params: GenerationParams):
    n_indent = f.get("n_indent", int, 0, lo=0, hi=1 << 16)
    fields = ext.response_fields(f)
    handle = submit(state, tokens, params, id_slot(f))
    n_probs = params.sampling.n_probs
    if not f.get("stream", bool, False):

        async def gather():
            events = []
            async for item in _items(handle, None, n_indent, len(tokens)):
                if isinstance(item, Final):
                    return events, item
                events.append(item)
            raise ApiError(500, "the generation ended without a result")

        events, final = await watching_disconnect(request, handle, gather())
        text = "".join(e.text for e in events)
        out = _final(state, params, final, text, [e.token for e in events if e.token is not None], text,
                     handle.slot)
        if n_probs:
            out["completion_probabilities"] = [_probs(state, e) for e in events if e.token is not None]
        return json_response(ext.pick_fields(fields, out))

    first = await first_item(request, handle)

    async def stream():
        text = []
        try:
            async for item in _items(handle, first, n_indent, len(tokens)):
                if isinstance(item, Final):
                    yield sse(ext.pick_fields(fields, _final(state, params, item, "", [], "".join(text),
                                                             handle.slot)))
                    return
                text.append(item.text)
                # llama.cpp's to_json_non_oaicompat (partial), in its order
                out = {"index": 0, "content": item.text, "tokens": [item.token] if item.token is not None else [],
                       "stop": False, "id_slot": handle.slot, "tokens_predicted": len(text),
                       "tokens_evaluated": len(tokens)}
                if n_probs and item.token is not None:
                    out["completion_probabilities"] = [_probs(state, item)]
                yield sse(out)
        except ApiError as e:
            yield sse(stream_error(e, "llamacpp"))

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def grammar(state: ServerState, f: Fields, params: GenerationParams) -> None:
    """llama.cpp's structured output: `json_schema` (an object) or `grammar` (GBNF text); the schema wins, as
    in llama.cpp's server."""
    if f.has("json_schema"):
        schema = f.data["json_schema"]
        if not isinstance(schema, (dict, bool)):
            raise ApiError(400, "'json_schema' must be a JSON schema (an object)", param="json_schema")
        await constrain(state, params, "json_schema", json_schema=schema)
    elif f.get("grammar", str):
        await constrain(state, params, "grammar", gbnf=f.get("grammar", str))


async def completion(state: ServerState, request: Request):
    f = Fields(await read_json(request, state.max_body))
    if "prompt" not in f.data:
        raise ApiError(400, "'prompt' is required", param="prompt")
    params = generation_params(state, f)
    await grammar(state, f, params)
    return await _run(state, request, f, await off_loop(_prompt_tokens, state, f.data["prompt"]), params)


async def infill(state: ServerState, request: Request):
    f = Fields(await read_json(request, state.max_body))
    prefix = f.get("input_prefix", str, "")
    suffix = f.get("input_suffix", str, "")
    prompt = f.get("prompt", str, "")
    extra = f.get("input_extra", list, [])
    for i, chunk in enumerate(extra):
        c = Fields(chunk, f"input_extra[{i}].") if isinstance(chunk, dict) else None
        if c is None:
            raise ApiError(400, f"'input_extra[{i}]' must be an object {{'filename', 'text'}}", param="input_extra")
        c.get("filename", str)
        c.get("text", str)
    params = generation_params(state, f)
    await grammar(state, f, params)
    extra = [{"filename": c.get("filename") or "tmp", "text": c.get("text") or ""} for c in extra]
    tokens = await off_loop(infill_tokens, state.engine, prefix, suffix, prompt, extra)
    return await _run(state, request, f, tokens, params)


async def tokenize(state: ServerState, request: Request):
    f = Fields(await read_json(request, state.max_body))
    content = f.get("content", str, "")
    add_special = f.get("add_special", bool, False)
    parse_special = f.get("parse_special", bool, True)
    with_pieces = f.get("with_pieces", bool, False)

    def run():  # off the loop: tokenizing 4 MB takes seconds, and so does writing a million pieces
        tok = state.engine.tokenizer
        ids = tok.encode(content, add_special=add_special, parse_special=parse_special)
        if with_pieces:
            return json_response({"tokens": [{"id": i, "piece": tok.piece(i)} for i in ids]})
        return json_response({"tokens": ids})

    return await off_loop(run)


async def detokenize(state: ServerState, request: Request):
    f = Fields(await read_json(request, state.max_body))
    ids = f.get("tokens", list, [])
    vocab = state.engine.tokenizer.vocab_size

    def run():  # off the loop: a 4 MB body holds two million ids
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise ApiError(400, f"'tokens' must be token ids of this model (0..{vocab - 1})", param="tokens")
        return json_response({"content": state.engine.tokenizer.decode(ids)})

    return await off_loop(run)


async def health(state: ServerState, request: Request):
    from localllm.server.liveness import unavailable

    if (why := await unavailable(state)) is not None:  # 503 while a request would not be served now
        raise ApiError(503, why)
    return json_response({"status": "ok"})


async def props(state: ServerState, request: Request):
    params = GenerationParams(max_tokens=state.max_tokens)  # SamplingParams' defaults are llama.cpp's
    template = state.engine.template
    return json_response({
        "default_generation_settings": {"n_ctx": state.engine.ctx, "params": _settings(state, params)},
        "total_slots": state.parallel, "model_path": state.model_name, "model_alias": state.model_name,
        "chat_template": template.source or "", "n_ctx": state.engine.ctx,
        "fim": sorted(state.engine.tokenizer.fim), "build_info": f"localllm {__version__}"})


async def apply_template(state: ServerState, request: Request):
    """llama.cpp's POST /apply-template: the prompt /v1/chat/completions would run for the same body, without
    running it: `tools` (and `tool_choice`, `parallel_tool_calls`) rendered as the chat route renders them, an
    assistant message's tool-call `arguments` given as JSON text turned into the object the template expects."""
    from localllm.server import tool_calls
    from localllm.chat.tool_formats import ToolError, plan_tools

    f = Fields(await read_json(request, state.max_body))
    messages = f.get("messages", list)
    if not messages:
        raise ApiError(400, "'messages' must be a non-empty array of messages", param="messages")
    add = f.get("add_generation_prompt", bool, True)
    tools = f.get("tools", list, None)
    if not tool_calls.uses_tools(tools, f.data.get("tool_choice"), messages):
        # a template may take its whole budget; late system messages as the chat route renders them
        prompt = await off_loop(render_system_anywhere, lambda msgs: state.engine.render_chat(msgs, add), messages)
        return json_response({"prompt": prompt})
    template = state.engine.template

    def render():
        try:
            plan = plan_tools(template, tools or [], f.data.get("tool_choice"),
                              f.get("parallel_tool_calls", bool, None))
            return render_system_anywhere(
                lambda msgs: plan.render(template, msgs, add_generation_prompt=add), messages)
        except ToolError as e:
            raise ApiError(400, str(e), param=e.param) from None

    return json_response({"prompt": await off_loop(render)})


async def slots(state: ServerState, request: Request):
    """llama.cpp's GET /slots: one entry per parallel slot, with what it is running. `?fail_on_no_slot=1`
    answers 503 when every slot is busy, as llama.cpp does (a client may poll it before sending work)."""
    out = state.scheduler.slots()
    for slot in out:
        if isinstance(slot.get("params"), GenerationParams):
            slot["params"] = _settings(state, slot["params"])
    if request.query_params.get("fail_on_no_slot") and all(s["is_processing"] for s in out):
        raise ApiError(503, "no slot available")
    return json_response(out)


# What a slot file's name may not hold (llama.cpp's fs_validate_filename): path separators and the characters
# Windows reserves, so a name is one file inside --slot-save-path and nothing else.
_RESERVED = set('/\\:*?"<>|')


def slot_filename(name) -> str:
    """`name` if it is a plain file name for --slot-save-path, else a 400: no path (no separator, no `..`), no
    control, format or unassigned character (terminal escapes, U+202E), no leading or trailing space, no trailing
    dot, at most 255 bytes of UTF-8."""
    import unicodedata

    if not isinstance(name, str) or not name:
        raise ApiError(400, "'filename' must be a non-empty string", param="filename")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate from a JSON escape
        size = 256
    if (size > 255 or name in (".", "..") or name != name.strip() or name.endswith(".")
            or any(c in _RESERVED or unicodedata.category(c)[0] == "C" for c in name)):
        raise ApiError(400, "Invalid filename", param="filename")
    return name


async def slot_action(state: ServerState, request: Request):
    """llama.cpp's POST /slots/{id_slot}?action=save|restore|erase: a slot's KV cache written to, or read from,
    a file of --slot-save-path (localllm's session format: checked against the model, written atomically), so
    an agent's long system prompt is computed once per model, not once per server start; erase forgets it."""
    import asyncio
    import time
    from pathlib import Path

    from localllm.server.scheduler import RequestFailed, SlotBusy

    if not state.slot_save_path:
        raise ApiError(501, "This server does not support slots action. Start it with --slot-save-path DIR",
                       kind="not_supported_error")
    try:
        slot = int(request.path_params["id_slot"])
    except ValueError:
        raise ApiError(400, "Invalid slot ID") from None
    action = request.query_params.get("action", "")
    if action not in ("save", "restore", "erase"):
        raise ApiError(400, "Invalid action: expected ?action=save, restore or erase")
    filename = None
    if action != "erase":
        f = Fields(await read_json(request, state.max_body))
        filename = slot_filename(f.data.get("filename"))
    path = Path(state.slot_save_path) / filename if filename else None
    if action == "restore" and not path.is_file():
        raise ApiError(400, f"failed to restore slot {slot}: no file {filename!r} in the slot save path")
    sched = state.scheduler
    work = {"save": lambda engine: sched.save_slot(slot, path),
            "restore": lambda engine: sched.restore_slot(slot, path),
            "erase": lambda engine: sched.erase_slot(slot)}[action]
    t0 = time.perf_counter()
    while True:  # a busy slot: llama.cpp defers the action until the slot is idle; so does this
        try:
            result = await sched.run(work)
            break
        except SlotBusy:
            if await request.is_disconnected():
                raise ApiError(499, "the client went away") from None
            await asyncio.sleep(0.05)
        except RequestFailed as e:
            raise ApiError(e.status, str(e)) from None
    ms = round(1000 * (time.perf_counter() - t0), 3)
    if action == "save":
        return json_response({"id_slot": slot, "filename": filename, "n_saved": result[0], "n_written": result[1],
                              "timings": {"save_ms": ms}})
    if action == "restore":
        return json_response({"id_slot": slot, "filename": filename, "n_restored": result[0], "n_read": result[1],
                              "timings": {"restore_ms": ms}})
    return json_response({"id_slot": slot, "n_erased": result})


async def metrics(state: ServerState, request: Request):
    return PlainTextResponse(state.scheduler.metrics.render(), media_type="text/plain; version=0.0.4")


ROUTES = [
    ("/health", ["GET"], health),
    ("/v1/health", ["GET"], health),
    ("/props", ["GET"], props),
    ("/metrics", ["GET"], metrics),
    ("/completion", ["POST"], completion),
    ("/completions", ["POST"], completion),
    ("/infill", ["POST"], infill),
    ("/tokenize", ["POST"], tokenize),
    ("/detokenize", ["POST"], detokenize),
    ("/apply-template", ["POST"], apply_template),
    ("/slots", ["GET"], slots),
    ("/slots/{id_slot}", ["POST"], slot_action),
]
