"""llama.cpp's request extensions that editor plugins rely on (llama.vim, llama.vscode, Twinny, Tabby), shared by
the llama.cpp routes and the OpenAI routes (llama.cpp's server accepts them on both):

  n_predict 0        a cache warm-up: the prompt is evaluated into the KV cache and nothing is generated; the
                     plugins send one whenever their ring of extra context changes, so that the next
                     completion finds it cached
  samplers           which sampler stages run (llama.cpp's names or one-letter codes); the plugins ask for
                     ["top_k", "top_p", "infill"]: no temperature stage, and the infill stage
                     (sampling.py, stage 5b)
  response_fields    keep only these fields of the response; "a/b" picks field b of object a and returns it
                     flattened under the key "a/b" (llama.cpp's json_get_nested_values)
  t_max_predict_ms   a time cap on generation: the first newline after that many ms ends the answer
  t_max_prompt_ms    accepted and ignored, as llama.cpp's server does (its own code marks it "TODO"; llama.vim
                     documents it as not yet supported). Cutting the prompt short would not help: the text
                     after the cursor sits behind the line being typed in the prompt, so it is read again on
                     every keystroke, and a cap below that reading time would never let a suggestion through.
"""

from __future__ import annotations

from localllm.chat.sampling import SamplingParams
from localllm.server.app import ApiError, Fields, ServerState

# llama.cpp's sampler names (common/sampling.cpp, common_sampler_types_from_names) and one-letter codes.
_SAMPLER_NAMES = {"dry": "dry", "top_k": "top_k", "top_p": "top_p", "top_n_sigma": "top_n_sigma",
                  "typ_p": "typ_p", "min_p": "min_p", "temperature": "temperature", "xtc": "xtc",
                  "infill": "infill", "penalties": "penalties", "adaptive_p": "adaptive_p",
                  "nucleus": "top_p", "temp": "temperature", "typ": "typ_p"}
for _name in [n for n in _SAMPLER_NAMES if "_" in n]:
    _SAMPLER_NAMES[_name.replace("_", "-")] = _SAMPLER_NAMES[_name.replace("_", "")] = _SAMPLER_NAMES[_name]
_SAMPLER_CHARS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
                  "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties", "a": "adaptive_p"}


def apply_samplers(f: Fields, sampling: SamplingParams) -> None:
    """`samplers`: the stages not listed are off (a missing temperature stage means no scaling, never greedy).
    Listed stages run in our chain's fixed order (sampling.py), which is llama.cpp's default order and the
    order the plugins list them in. typical-p, top-n-sigma and adaptive-p are accepted as no-ops: their
    parameters are not supported and they do nothing at llama.cpp's defaults."""
    raw = f.data.get("samplers")
    if raw is None:
        return
    if isinstance(raw, str):
        bad = [c for c in raw if c not in _SAMPLER_CHARS]
        if bad:
            raise ApiError(400, f"'samplers' has unknown sampler codes {''.join(bad)!r} (known: "
                                f"{''.join(_SAMPLER_CHARS)})", param="samplers")
        names = {_SAMPLER_CHARS[c] for c in raw}
    elif isinstance(raw, list) and all(isinstance(n, str) for n in raw):
        unknown = [n for n in raw if n.lower() not in _SAMPLER_NAMES]
        if unknown:
            raise ApiError(400, f"'samplers' has unknown samplers {unknown[:4]} (known: "
                                f"{', '.join(sorted(set(_SAMPLER_NAMES.values())))})", param="samplers")
        names = {_SAMPLER_NAMES[n.lower()] for n in raw}
    else:
        raise ApiError(400, "'samplers' must be an array of sampler names or a string of sampler codes",
                       param="samplers")
    if "top_k" not in names:
        sampling.top_k = 0
    if "top_p" not in names:
        sampling.top_p = 1.0
    if "min_p" not in names:
        sampling.min_p = 0.0
    if "temperature" not in names:
        sampling.temperature = 1.0
    if "penalties" not in names:
        sampling.repeat_penalty, sampling.presence_penalty, sampling.frequency_penalty = 1.0, 0.0, 0.0
    if "dry" not in names:
        sampling.dry_multiplier = 0.0
    if "xtc" not in names:
        sampling.xtc_probability = 0.0
    sampling.infill = "infill" in names


def n_predict(f: Fields, state: ServerState, keys=("n_predict", "max_tokens", "max_completion_tokens")):
    """The tokens to generate from llama.cpp's n_predict or its aliases (the first given wins): None when none
    is given, state.max_tokens for -1 (until the model stops), 0 for a cache warm-up."""
    key = next((k for k in keys if f.has(k)), None)
    if key is None:
        return None
    n = f.get(key, int, lo=-1)
    if n < 0:
        return state.max_tokens
    if n > state.max_tokens:
        raise ApiError(400, f"'{key}' is {n} but this server generates at most {state.max_tokens} tokens per "
                            "request (localllm serve --max-tokens)", param=key)
    return n


def time_caps(f: Fields, params) -> None:
    """t_max_predict_ms onto GenerationParams (<= 0: no cap); t_max_prompt_ms checked and ignored."""
    f.get("t_max_prompt_ms", int, lo=-1)
    t = f.get("t_max_predict_ms", int, lo=-1)
    params.t_max_predict_ms = float(t) if t is not None and t > 0 else None


def response_fields(f: Fields) -> list[str] | None:
    raw = f.data.get("response_fields")
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(p, str) for p in raw):
        raise ApiError(400, "'response_fields' must be an array of field names", param="response_fields")
    return raw


def pick_fields(paths: list[str] | None, body: dict) -> dict:
    """llama.cpp's json_get_nested_values: the fields named by `paths`, nested paths ("timings/prompt_n")
    flattened under their path; missing fields are left out without error. No paths: the body unchanged."""
    if not paths:
        return body
    out = {}
    for path in paths:
        value, found = body, True
        for key in path.split("/"):
            if isinstance(value, dict) and key in value:
                value = value[key]
            else:
                found = False
                break
        if found:
            out[path] = value
    return out
