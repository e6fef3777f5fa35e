"""The tokenizer against llama.cpp: its own vocab test files, real prompts, generated text, speed."""

from __future__ import annotations

import argparse
import functools
import logging
import random
import time
import unicodedata
from pathlib import Path

import pydoc_data.topics
import pytest

from conftest import CATALOG_MODELS, VOCAB_DIR, model_file, reference_cases
from localllm.errors import LocalLLMError
from localllm.gguf_file import load_metadata
from localllm.tokenizer import Tokenizer
from localllm.tokenizer.pretokenize import WHITESPACE, pre_tokenizer_config, split_words
from localllm.tokenizer.spm import SPACE_MARK

VOCAB_FILES = sorted(p.name for p in VOCAB_DIR.glob("ggml-vocab-*.gguf"))


@functools.lru_cache(maxsize=None)
def vocab_meta(name: str) -> dict:
    return load_metadata(VOCAB_DIR / name)


@functools.lru_cache(maxsize=None)
def vocab_tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_metadata(vocab_meta(name))


@functools.lru_cache(maxsize=None)
def model_meta(name: str) -> dict:
    return load_metadata(model_file(name))


@functools.lru_cache(maxsize=None)
def model_tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_metadata(model_meta(name))


def read_vocab_cases(name: str) -> list[tuple[str, list[int]]]:
    """Split .inp as llama.cpp's tests/test-tokenizer-0.cpp does: on "\\n__ggml_vocab_test__\\n", the text
    after the last separator (empty here) ending the list; .out has one line of ids per case."""
    raw = (VOCAB_DIR / (name + ".inp")).read_bytes().decode("utf-8")
    separator = "\n__ggml_vocab_test__\n"
    inputs, pos = [], 0
    while pos < len(raw):
        found = raw.find(separator, pos)
        if found < 0:
            inputs.append(raw[pos:])
            break
        inputs.append(raw[pos:found])
        pos = found + len(separator)
    lines = (VOCAB_DIR / (name + ".out")).read_text().split("\n")
    assert len(lines) >= len(inputs) and all(not line.strip() for line in lines[len(inputs):])
    return [(text, [int(t) for t in lines[i].split()]) for i, text in enumerate(inputs)]


# --- llama.cpp's own tokenizer tests -----------------------------------------------------------------


def test_vocab_test_files_are_all_present():
    assert len(VOCAB_FILES) == 6


@pytest.mark.parametrize("name", VOCAB_FILES)
def test_vocab_file_cases_match_llamacpp_exactly(name):
    tok = vocab_tokenizer(name)
    cases = read_vocab_cases(name)
    assert len(cases) == 46
    failures = [(text, expected, got) for text, expected in cases
                if (got := tok.encode(text, add_special=False, parse_special=False)) != expected]
    assert not failures, f"{len(failures)} of {len(cases)} cases differ, first: {failures[0]!r}"


@pytest.mark.parametrize("name", VOCAB_FILES)
def test_vocab_file_cases_decode_back_to_their_text(name):
    tok = vocab_tokenizer(name)
    meta = vocab_meta(name)
    for text, expected in read_vocab_cases(name):
        decoded = tok.decode(expected)
        if meta["tokenizer.ggml.model"] == "llama":
            assert decoded == text  # the SPM prefix space is removed again
        elif not tok.vocab.clean_spaces:
            assert decoded == text


# --- real models: llama.cpp's prompt tokens and generated text ---------------------------------------


@pytest.mark.parametrize("name", CATALOG_MODELS)
def test_prompt_tokens_match_llamacpp(name):
    tok = model_tokenizer(name)
    for case in reference_cases(name):
        got = tok.encode(case["prompt"], add_special=True, parse_special=True)
        assert got == case["prompt_tokens"], case["name"]


@pytest.mark.parametrize("name", CATALOG_MODELS)
def test_streamed_generation_text_matches_llamacpp_content(name):
    tok = model_tokenizer(name)
    for case in reference_cases(name):
        decoder = tok.stream_decoder()
        text = "".join(decoder.feed(t) for t in case["tokens"]) + decoder.flush()
        assert text == case["content"], case["name"]


# --- special tokens, BOS/EOS, EOG, FIM ---------------------------------------------------------------


def test_chat_markers_are_parsed_only_when_parse_special():
    tok = model_tokenizer("qwen2.5-coder-0.5b-instruct")
    im_start = tok.token_id("<|im_start|>")
    assert tok.encode("<|im_start|>user", parse_special=True)[0] == im_start
    as_text = tok.encode("<|im_start|>user", parse_special=False)
    assert im_start not in as_text and tok.decode(as_text) == "<|im_start|>user"


def test_user_defined_tokens_are_cut_out_even_without_parse_special():
    # gemma3's newline and space runs are user-defined tokens: llama.cpp always partitions them.
    tok = model_tokenizer("gemma3-270m")
    ids = tok.encode("a\n\nb", add_special=False, parse_special=False)
    assert tok.token_id("\n\n") in ids
    qwen = model_tokenizer("qwen2.5-coder-0.5b-instruct")
    assert qwen.encode("<tool_call>", add_special=False, parse_special=False) == [qwen.token_id("<tool_call>")]


def test_longest_special_token_is_cut_first():
    tok = model_tokenizer("gemma3-270m")
    ids = tok.encode("x" + " " * 40 + "y", add_special=False, parse_special=False)
    assert tok.token_id(" " * 31) in ids and tok.token_id(" " * 9) in ids


def test_phi3_strips_whitespace_after_its_end_token():
    # "</s>" is user-defined in phi-3's vocab, but as an end-of-generation text llama.cpp makes it control
    # too, so it is cut out only with parse_special; phi-3's specials carry RSTRIP.
    tok = vocab_tokenizer("ggml-vocab-phi-3.gguf")
    end = tok.token_id("</s>")
    assert end not in tok.encode("a</s>   b", add_special=False, parse_special=False)
    ids = tok.encode("a</s>   b", add_special=False, parse_special=True)
    after = ids[ids.index(end) + 1:]
    assert tok.decode(after) == "b"  # "   b" lost its spaces; the prefix space of the new fragment stays
    assert [tok.token_text(i) for i in after] == [SPACE_MARK + "b"]


def test_add_special_adds_bos_only_where_the_model_asks():
    gemma = model_tokenizer("gemma3-270m")
    assert gemma.add_bos and gemma.encode("hi")[0] == gemma.bos_id == 2
    assert gemma.encode("hi", add_special=False)[0] != gemma.bos_id
    qwen = model_tokenizer("qwen2.5-coder-0.5b-instruct")
    assert not qwen.add_bos and qwen.encode("hi") == qwen.encode("hi", add_special=False)
    assert qwen.encode("") == [] and gemma.encode("") == [2]


def test_add_bos_defaults_follow_llamacpp_per_model_type():
    def without_add_keys(meta):
        return {k: v for k, v in meta.items() if k not in ("tokenizer.ggml.add_bos_token",
                                                         "tokenizer.ggml.add_eos_token")}

    spm = Tokenizer.from_metadata(without_add_keys(vocab_meta("ggml-vocab-llama-spm.gguf")))
    llama3 = Tokenizer.from_metadata(without_add_keys(vocab_meta("ggml-vocab-llama-bpe.gguf")))
    qwen2 = Tokenizer.from_metadata(without_add_keys(vocab_meta("ggml-vocab-qwen2.gguf")))
    assert (spm.add_bos, spm.add_eos) == (True, False)
    assert (llama3.add_bos, llama3.add_eos) == (True, False)
    assert (qwen2.add_bos, qwen2.add_eos) == (False, False)


def test_end_of_generation_ids_as_llamacpp_finds_them():
    qwen = model_tokenizer("qwen2.5-coder-0.5b-instruct")
    for text in ("<|im_end|>", "<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"):
        assert qwen.token_id(text) in qwen.eog_ids, text
    assert qwen.eos_id in qwen.eog_ids and qwen.token_id("<|im_start|>") not in qwen.eog_ids
    gemma = model_tokenizer("gemma3-270m")
    assert {gemma.eos_id, gemma.token_id("<end_of_turn>")} <= gemma.eog_ids
    smol = model_tokenizer("smollm2-135m-instruct")
    assert {smol.token_id("<|im_end|>"), smol.token_id("<|endoftext|>")} <= smol.eog_ids


def test_fim_roles_found_by_token_text():
    qwen = model_tokenizer("qwen2.5-coder-1.5b-instruct")
    expected = {"pre": "<|fim_prefix|>", "suf": "<|fim_suffix|>", "mid": "<|fim_middle|>",
                "pad": "<|fim_pad|>", "rep": "<|repo_name|>", "sep": "<|file_sep|>"}
    assert {role: qwen.token_text(i) for role, i in qwen.fim.items()} == expected
    assert model_tokenizer("gemma3-270m").fim == {}


def test_fim_metadata_key_wins_over_token_text():
    meta = dict(model_meta("qwen2.5-coder-0.5b-instruct"))
    meta["tokenizer.ggml.fim_pre_token_id"] = 42
    assert Tokenizer.from_metadata(meta).fim["pre"] == 42


# --- decoding ----------------------------------------------------------------------------------------


def test_decode_renders_control_tokens_unless_skipped():
    qwen = model_tokenizer("qwen2.5-coder-0.5b-instruct")
    ids = qwen.encode("<|im_start|>user\nhi<|im_end|>")
    assert qwen.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert qwen.decode(ids, skip_special=True) == "user\nhi"


def test_decode_skip_special_drops_gemma_bos():
    gemma = model_tokenizer("gemma3-270m")
    ids = gemma.encode("Grüße aus München!")
    assert gemma.decode(ids) == "<bos>Grüße aus München!"
    assert gemma.decode(ids, skip_special=True) == "Grüße aus München!"


def test_pieces_are_llamacpp_token_to_piece():
    qwen = model_tokenizer("qwen2.5-coder-0.5b-instruct")
    assert qwen.piece(qwen.token_id("Ġhello")) == " hello"
    assert qwen.piece(qwen.token_id("<|im_end|>")) == "<|im_end|>"
    gemma = model_tokenizer("gemma3-270m")
    assert gemma.piece(gemma.token_id(SPACE_MARK + "the")) == " the"
    assert gemma.piece_bytes(gemma.token_id("<0x0A>")) == b"\n"


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-instruct", "gemma3-270m"])
def test_stream_decoder_holds_a_split_character_until_complete(name):
    tok = model_tokenizer(name)
    ids = tok.encode("a𓀀b", add_special=False)  # a hieroglyph: several byte-level tokens
    decoder = tok.stream_decoder()
    outputs = [decoder.feed(i) for i in ids]
    assert len(ids) > 3
    assert outputs[0] == "a" and outputs[-1] == "b"
    assert [o for o in outputs[1:-1] if o] == ["𓀀"]
    assert decoder.flush() == ""


def test_stream_decoder_flush_reports_an_unfinished_character():
    tok = model_tokenizer("gemma3-270m")
    decoder = tok.stream_decoder()
    assert decoder.feed(tok.token_id("<0xF0>")) == ""
    assert decoder.flush() == "\ufffd"


def test_stream_decoder_renders_control_tokens_only_on_request():
    qwen = model_tokenizer("qwen2.5-coder-0.5b-instruct")
    end = qwen.token_id("<|im_end|>")
    assert qwen.stream_decoder().feed(end) == ""
    assert qwen.stream_decoder(skip_special=False).feed(end) == "<|im_end|>"


def test_gpt2_decode_cleans_spaces_like_llamacpp():
    tok = vocab_tokenizer("ggml-vocab-gpt-2.gguf")
    ids = tok.encode("Hello , world . It 's fine", add_special=False)
    assert tok.decode(ids) == "Hello, world. It's fine"


# --- the pre-tokenizer regexes against llama.cpp's hand-written scanners ----------------------------


def _flags(ch: str) -> tuple[bool, bool, bool]:
    """(whitespace, letter, number) as llama.cpp's unicode_cpt_flags see a code point."""
    if ord(ch) in WHITESPACE:
        return True, False, False
    category = unicodedata.category(ch)
    return False, category[0] == "L", category[0] == "N"


def _scanner_split(text: str, kind: str) -> list[str]:
    """Line-by-line port of unicode_regex_split_custom_gpt2 / _llama3 (and _qwen2: llama3 with one digit
    per number) from llama.cpp's src/unicode.cpp, for one fragment."""
    n = len(text)
    out: list[str] = []
    prev_end = 0

    def flags(pos):
        return _flags(text[pos]) if 0 <= pos < n else None

    def add(end):
        nonlocal prev_end
        if end > prev_end:
            out.append(text[prev_end:end])
        length = end - prev_end
        prev_end = end
        return length

    def ws(pos):
        f = flags(pos)
        return f is not None and f[0]

    def letter(pos):
        f = flags(pos)
        return f is not None and f[1]

    def number(pos):
        f = flags(pos)
        return f is not None and f[2]

    def other(pos):  # [^\s\p{L}\p{N}]: any code point in range that is none of them
        f = flags(pos)
        return f is not None and not any(f)

    pos = 0
    while pos < n:
        c = text[pos]
        nxt = text[pos + 1] if pos + 1 < n else ""
        if kind == "gpt2":
            if c == "'" and pos + 1 < n:
                if nxt in "stmd":
                    pos += add(pos + 2)
                    continue
                if pos + 2 < n and nxt + text[pos + 2] in ("re", "ve", "ll"):
                    pos += add(pos + 3)
                    continue
            at = pos + 1 if c == " " else pos
            matched = False
            for test in (letter, number, other):
                if test(at):
                    pos = at
                    while test(pos):
                        pos += 1
                    add(pos)
                    matched = True
                    break
            if matched:
                continue
            count = 0
            while ws(pos + count):
                count += 1
            if count > 1 and pos + count < n:
                pos += count - 1
                add(pos)
                continue
            if count > 0:
                pos += count
                add(pos)
                continue
            pos += 1
            add(pos)
            continue
        # llama3 / qwen2
        if c == "'" and pos + 1 < n:
            low = nxt.lower() if nxt.isascii() else nxt
            if low in ("s", "t", "m", "d"):
                pos += add(pos + 2)
                continue
            if pos + 2 < n:
                low2 = text[pos + 2].lower() if text[pos + 2].isascii() else text[pos + 2]
                if low + low2 in ("re", "ve", "ll"):
                    pos += add(pos + 3)
                    continue
        if not (c in "\r\n" or number(pos)) and (letter(pos) or letter(pos + 1)):
            pos += 1
            while letter(pos):
                pos += 1
            add(pos)
            continue
        if number(pos):
            start = pos
            limit = 3 if kind == "llama3" else 1
            while number(pos):
                pos += 1
                if pos - start >= limit:
                    add(pos)
                    start = pos
            add(pos)
            continue
        at = pos + 1 if c == " " else pos
        if other(at):
            pos = at
            while other(pos):
                pos += 1
            while pos < n and text[pos] in "\r\n":
                pos += 1
            add(pos)
            continue
        count = 0
        last_newline_end = 0
        while ws(pos + count):
            if text[pos + count] in "\r\n":
                last_newline_end = pos + count + 1
            count += 1
        if last_newline_end > 0:
            pos = last_newline_end
            add(pos)
            continue
        if count > 1 and pos + count < n:
            pos += count - 1
            add(pos)
            continue
        if count > 0:
            pos += count
            add(pos)
            continue
        pos += 1
        add(pos)
    return out


_ALPHABET = ("abcdeSTtsmdlrveLRVEM'' \n\r\t\x0b\x00\x1f\x7f.,!?-_(){}[]~$+<=>^`|@#0123456789"
             "éßЖΩ中文カ한\u0301\u0903²½٣€∑©\u00a0\u2003\u3000\u0085\u200b\ue000🦙😀")


@pytest.mark.parametrize("kind,pre_name", [("gpt2", "gpt-2"), ("llama3", "llama-bpe"), ("qwen2", "qwen2")])
def test_pre_tokenizer_regex_matches_llamacpp_scanner(kind, pre_name):
    rules = pre_tokenizer_config(pre_name).rules
    rng = random.Random(1234)
    for _ in range(3000):
        text = "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(0, 24)))
        assert split_words(text, rules) == _scanner_split(text, kind), repr(text)


def test_pre_tokenizer_pieces_cover_the_text():
    rng = random.Random(7)
    for name in ("default", "deepseek-coder", "deepseek-llm", "falcon", "starcoder", "tekken", "gpt-4o",
                 "chameleon", "bloom", "deepseek-v3", "tiny_aya", "superbpe", "exaone-moe"):
        rules = pre_tokenizer_config(name).rules
        for _ in range(200):
            text = "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(0, 30)))
            assert "".join(split_words(text, rules)) == text, (name, text)


def test_unknown_pre_tokenizer_is_a_clear_error():
    meta = dict(vocab_meta("ggml-vocab-qwen2.gguf"))
    meta["tokenizer.ggml.pre"] = "no-such-pretokenizer"
    with pytest.raises(LocalLLMError, match="unknown pre-tokenizer type: 'no-such-pretokenizer'"):
        Tokenizer.from_metadata(meta)


def test_unsupported_tokenizer_model_is_a_clear_error():
    meta = dict(vocab_meta("ggml-vocab-qwen2.gguf"))
    meta["tokenizer.ggml.model"] = "bert"
    with pytest.raises(LocalLLMError, match="unsupported tokenizer model 'bert'"):
        Tokenizer.from_metadata(meta)


def test_missing_pre_tokenizer_falls_back_to_default_with_a_warning(caplog):
    meta = {k: v for k, v in vocab_meta("ggml-vocab-gpt-2.gguf").items() if k != "tokenizer.ggml.pre"}
    with caplog.at_level(logging.WARNING):
        tok = Tokenizer.from_metadata(meta)
    assert tok.vocab.pre.family == "default" and "missing pre-tokenizer" in caplog.text


# --- speed, and the shortcuts that buy it ------------------------------------------------------------


def _hundred_kb_of_text() -> str:
    """Code with English docstrings and English prose, from the standard library (always present)."""
    code = Path(argparse.__file__).read_text(encoding="utf-8")[:50_000]
    prose = Path(pydoc_data.topics.__file__).read_text(encoding="utf-8")[:50_000]
    return code + prose


def test_spm_cutting_at_spaces_gives_the_same_ids_as_merging_the_whole_text():
    tok = model_tokenizer("gemma3-270m")
    spm = tok._model
    text = _hundred_kb_of_text()[:6000].replace("\n", " ").replace(" ", SPACE_MARK)
    cut: list[int] = []
    spm.tokenize(text, cut)
    assert cut == list(spm._tokenize_piece(text))
    for name in ("ggml-vocab-llama-spm.gguf", "ggml-vocab-phi-3.gguf"):
        spm = vocab_tokenizer(name)._model
        text = (SPACE_MARK + "Hello" + SPACE_MARK * 3 + "world," + SPACE_MARK + "y'all" + SPACE_MARK * 2) * 20
        cut = []
        spm.tokenize(text, cut)
        assert cut == list(spm._tokenize_piece(text)), name


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-instruct", "gemma3-270m"])
def test_100kb_of_text_encodes_well_under_a_second(name):
    text = _hundred_kb_of_text()
    tok = Tokenizer.from_metadata(model_meta(name))  # fresh: nothing cached
    start = time.perf_counter()
    ids = tok.encode(text)
    elapsed = time.perf_counter() - start
    print(f"{name}: encoded {len(text)} chars into {len(ids)} tokens in {elapsed:.3f}s")
    assert tok.decode(ids, skip_special=True) == text
    assert elapsed < 3.0  # measured ~0.1 s; the bound only catches pathological regressions


def test_gemma3_vocabulary_loads_quickly():
    meta = model_meta("gemma3-270m")
    start = time.perf_counter()
    tok = Tokenizer.from_metadata(meta)
    elapsed = time.perf_counter() - start
    print(f"gemma3 tokenizer from metadata: {elapsed:.3f}s for {tok.vocab_size} tokens")
    assert tok.vocab_size == 262144
    assert elapsed < 1.5  # measured ~0.25 s


# --- the early length check ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CATALOG_MODELS + ["ggml-vocab-gpt-2.gguf", "ggml-vocab-llama-spm.gguf",
                                                   "ggml-vocab-phi-3.gguf", "ggml-vocab-deepseek-coder.gguf"])
def test_min_tokens_never_exceeds_the_real_count(name):
    """min_tokens is what lets the server refuse a 4 MB prompt in milliseconds instead of tokenizing it: it
    must be a true lower bound on any text, and still useful on ordinary text where a bound holds."""
    tok = model_tokenizer(name) if name in CATALOG_MODELS else vocab_tokenizer(name)
    rng = random.Random(7)
    longest = max(range(tok.vocab_size), key=lambda i: len(tok.piece_bytes(i)))
    specials = [tok.token_text(i) for i in tok.vocab.special_tokens[:50]]
    texts = [text for text, _ in read_vocab_cases("ggml-vocab-llama-bpe.gguf")] + [
        tok.piece_bytes(longest).decode("utf-8", "replace") * 50,  # the longest token, back to back
        " " * 5000, "\n" * 3000, "\t \r\n" * 500, "".join(specials) * 20, "a\ud800b\udc80c" * 300,
        # Characters that give no token at all (smollm2 has none for \x04, \x06, ...): they must not count.
        "".join(c for c in map(chr, range(128)) if not tok.encode(c, add_special=False)) * 2000,
        "".join(chr(rng.randrange(0, 0x800)) for _ in range(3000)),  # controls and 2-byte characters
        "".join(chr(rng.choice([rng.randrange(0x20, 0x7f), rng.randrange(0x4e00, 0x9fff),
                                rng.randrange(0x1f300, 0x1f6ff), rng.randrange(0x40000, 0xbffff)]))
                for _ in range(3000)),
        _hundred_kb_of_text()[:5_000]]
    for text in texts:
        for parse_special in (True, False):
            n = len(tok.encode(text, add_special=False, parse_special=parse_special))
            assert tok.min_tokens(text) <= n, (name, text[:60], tok.min_tokens(text), n)
    if name == "ggml-vocab-phi-3.gguf":
        assert tok.min_tokens("x" * 10_000) == 0  # its specials strip the spaces beside them: no bound
    else:
        english = _hundred_kb_of_text()
        assert tok.min_tokens(english) >= len(english) // 300  # e.g. a 4 MB prompt: >= 13,000 tokens
