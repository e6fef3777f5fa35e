"""The table of sampling parameters (localllm/parameters.py) is the one owner of each parameter's default, range and
names: the sampler's defaults, every API's request fields, the CLI flags and the chat app's settings follow it."""

from __future__ import annotations

import dataclasses

import pytest

from localllm import parameters
from localllm.parameters import SAMPLING


def test_sampling_params_defaults_are_the_tables_llama_cpp_defaults():
    from localllm.chat.sampling import SamplingParams

    s = SamplingParams()
    assert {p.name: getattr(s, p.name) for p in SAMPLING} == parameters.defaults("llamacpp")
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert {p.name for p in SAMPLING} <= fields


@pytest.mark.parametrize("api", parameters.API_NAMES)
def test_a_request_without_sampling_fields_gets_each_apis_defaults_from_the_table(api):
    from localllm.server.app import Fields, sampling_from

    s = sampling_from(Fields({}), api, 1000)
    assert {p.name: getattr(s, p.name) for p in SAMPLING} == parameters.defaults(api)


def test_the_apis_defaults_are_what_each_server_documents():
    # llama-server: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05; Ollama: 0.8, 40, 0.9, no min-p, repeat
    # penalty 1.1; OpenAI and Anthropic: temperature 1 and no truncation.
    want = {"llamacpp": (0.8, 40, 0.95, 0.05, 1.0), "ollama": (0.8, 40, 0.9, 0.0, 1.1),
            "openai": (1.0, 0, 1.0, 0.0, 1.0), "anthropic": (1.0, 0, 1.0, 0.0, 1.0)}
    for api, values in want.items():
        d = parameters.defaults(api)
        assert (d["temperature"], d["top_k"], d["top_p"], d["min_p"], d["repeat_penalty"]) == values, api


@pytest.mark.parametrize("api, field, value, message", [
    ("openai", "temperature", 2.5, "'temperature' must be in [0, 2], got 2.5"),
    ("anthropic", "temperature", 1.5, "'temperature' must be in [0, 1], got 1.5"),
    ("llamacpp", "temperature", 2.5, None),
    ("openai", "presence_penalty", 3, "'presence_penalty' must be in [-2, 2], got 3"),
    ("llamacpp", "presence_penalty", 3, None),
    ("ollama", "top_k", 1001, "'options.top_k' must be in [0, 1000], got 1001"),
    ("llamacpp", "top_k", 2.5, "'top_k' must be an integer, got 2.5"),
    ("llamacpp", "min_p", "a", "'min_p' must be a number, got \"a\""),
    ("llamacpp", "top_p", 0, None),  # llama-server's "off"
    ("llamacpp", "repeat_penalty", 0, "'repeat_penalty' must be in [0.01, 100], got 0"),
])
def test_a_request_is_refused_by_the_tables_range_with_each_apis_own_bound(api, field, value, message):
    from localllm.server.app import ApiError, Fields, sampling_from

    fields = Fields({field: value}, "options." if api == "ollama" else "")
    if message is None:
        s = sampling_from(fields, api, 1000)
        assert getattr(s, field) == (1.0 if field == "top_p" else value)
        return
    with pytest.raises(ApiError) as e:
        sampling_from(fields, api, 1000)
    assert e.value.message == message


def test_each_flag_takes_the_tables_default_and_refuses_a_value_outside_its_range(capsys):
    from localllm.cli.main import build_parser
    from localllm.cli.generate import generation_params

    p = build_parser()
    run = generation_params(p.parse_args(["run", "m", "hi"])).sampling
    for param in SAMPLING:
        assert getattr(run, param.name) == param.default, param.name
    given = generation_params(p.parse_args(["run", "m", "hi", "--temp", "0.3", "--top-k", "7", "--xtc-threshold",
                                            "0.2"])).sampling
    assert (given.temperature, given.top_k, given.xtc_threshold) == (0.3, 7, 0.2)
    for flag, value, why in (("--top-p", "0", "must be in (0, 1], not 0"), ("--temp", "-1", "must be in [0, 100]"),
                             ("--top-k", "2.5", "'2.5' is not an integer")):
        with pytest.raises(SystemExit):
            p.parse_args(["run", "m", "hi", flag, value])
        assert f"argument {flag}: {why}" in capsys.readouterr().err


def test_the_chat_apps_settings_take_the_tables_defaults_labels_and_ranges():
    from localllm.tui.screens import SETTING_LABELS
    from localllm.tui.settings import ChatSettings

    s = ChatSettings()
    for param in parameters.chat_settings():
        assert SETTING_LABELS[param.name] == (param.label, param.hint)
        if param.name != "dry_multiplier":  # the chat's loop protection turns DRY on
            assert getattr(s, param.name) == param.default
    assert s.generation_params().sampling.dry_multiplier > 0
    for name, bad, why in (("top_p", 0.0, "Top-p must be in (0, 1]"), ("temperature", -0.5, "Temperature must be"),
                           ("top_k", -1, "Top-k must be in [0, "),
                           ("dry_multiplier", -0.8, "DRY multiplier must be in [0, 100]")):
        with pytest.raises(ValueError, match=__import__("re").escape(why)):
            dataclasses.replace(s, **{name: bad}).validated()
