"""BPE pre-tokenization: splitting text into words the way llama.cpp's `unicode_regex_split` does.

llama.cpp (src/llama-vocab.cpp, `llm_tokenizer_bpe`) gives every pre-tokenizer type a *list* of regexes.
They are applied one after the other: each regex splits every piece the previous ones produced, and the
text between two matches stays a piece of its own. Regexes are run by std::regex over a "collapsed" text
(src/unicode.cpp): every code point >= 128 is replaced by one byte standing for its Unicode category
(0xD1 number, 0xD2 letter, 0xD3 punctuation, 0xD4 mark, 0xD5 symbol, 0xD0 anything else, 0x0B for
whitespace), and each `\\p{X}` in the regex by a class of that byte plus llama.cpp's ASCII members of X.
We do the same with Python's `re` (in ASCII mode, so `\\s` is std::regex's C-locale `[ \\t\\n\\v\\f\\r]`),
which reproduces llama.cpp's results including its quirks (e.g. `~` is neither \\p{P} nor \\p{S} there).

The gpt-2 and llama3 regexes are not run by std::regex but by hand-written scanners (and qwen2's by one in
newer llama.cpp). Those scanners implement exactly their regex over llama.cpp's category flags, so the
collapsed-regex route gives the same pieces.
"""

from __future__ import annotations

import re
import unicodedata
import warnings
from dataclasses import dataclass

from localllm.errors import ModelFileError

# llama.cpp's whitespace set (unicode_set_whitespace: the Unicode White_Space property). Not str.isspace,
# which also counts U+001C..U+001F as whitespace.
WHITESPACE = frozenset(
    [0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029,
     0x202F, 0x205F, 0x3000])

_COLLAPSED_WHITESPACE = "\x0b"
_CATEGORY_BYTE = {"N": "\xd1", "L": "\xd2", "P": "\xd3", "M": "\xd4", "S": "\xd5"}
_OTHER_BYTE = "\xd0"

# `\p{...}` names llama.cpp understands, and what they collapse to: the category byte plus its ASCII
# members as llama.cpp lists them (k_ucat_map).
_UCAT_CLASS = {
    "N": "\xd1" + "0-9",
    "L": "\xd2" + "A-Za-z",
    "P": "\xd3" + r"!-#%-*,-/:-;?-@\[-\]_\{\}",
    "M": "\xd4",
    "S": "\xd5" + r"\$\+<->\^`\|",
}
_UCAT_NAMES = {
    r"\p{N}": "N", r"\p{L}": "L", r"\p{P}": "P", r"\p{M}": "M", r"\p{S}": "S",
    r"\p{Lu}": "L", r"\p{Ll}": "L", r"\p{Lt}": "L", r"\p{Lm}": "L", r"\p{Lo}": "L",
}


class _CollapseTable(dict):
    """str.translate table: ASCII stays, other code points become their category byte (cached)."""

    def __init__(self):
        super().__init__((c, c) for c in range(128))

    def __missing__(self, cp: int) -> str:
        if cp in WHITESPACE:
            value = _COLLAPSED_WHITESPACE
        else:
            value = _CATEGORY_BYTE.get(unicodedata.category(chr(cp))[0], _OTHER_BYTE)
        self[cp] = value
        return value


class _WhitespaceTable(dict):
    """str.translate table for regexes without `\\p{...}` (llama.cpp's std::wregex route): code points stay,
    except non-ASCII whitespace, which becomes 0x0B so that `\\s` matches it."""

    def __init__(self):
        super().__init__((c, c) for c in range(128))

    def __missing__(self, cp: int) -> int | str:
        value = _COLLAPSED_WHITESPACE if cp in WHITESPACE else cp
        self[cp] = value
        return value


_COLLAPSE = _CollapseTable()
_WS_ONLY = _WhitespaceTable()


def _collapse_regex(expr: str) -> str:
    """Rewrite `\\p{X}` as llama.cpp does before handing the regex to std::regex."""
    out = []
    inside = False  # inside [...]: llama.cpp does not nest brackets there
    i = 0
    while i < len(expr):
        c = expr[i]
        if c == "[" and (i == 0 or expr[i - 1] != "\\"):
            out.append("[")
            inside = True
            i += 1
            continue
        if inside and c == "]" and expr[i - 1] != "\\":
            out.append("]")
            inside = False
            i += 1
            continue
        if expr.startswith("\\p{", i):
            close = expr.find("}", i + 3)
            if close != -1 and close <= i + 10 and expr[i:close + 1] in _UCAT_NAMES:
                members = _UCAT_CLASS[_UCAT_NAMES[expr[i:close + 1]]]
                out.append(members if inside else "[" + members + "]")
                i = close + 1
                continue
        out.append(c)
        i += 1
    return "".join(out)


def _to_python_regex(expr: str) -> str:
    # ECMAScript `$` (no multiline) matches only at the very end; Python's also before a final "\n".
    if expr.endswith("$") and not expr.endswith("\\$"):
        expr = expr[:-1] + r"\Z"
    return expr


@dataclass(frozen=True)
class SplitRule:
    """One regex of a pre-tokenizer, compiled for the text form llama.cpp runs it on."""

    pattern: re.Pattern
    collapsed: bool  # run on the category-collapsed text (the regex uses \p{...})

    @classmethod
    def compile(cls, expr: str) -> "SplitRule":
        collapsed = any(name in expr for name in _UCAT_NAMES)
        if collapsed:
            if any(ord(c) >= 128 for c in expr):
                raise ModelFileError("pre-tokenizer regex mixes unicode categories and non-ASCII characters")
            expr = _collapse_regex(expr)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # "possible nested set" for `[...[...`
            pattern = re.compile(_to_python_regex(expr), re.ASCII)
        return cls(pattern, collapsed)


def split_words(text: str, rules: tuple[SplitRule, ...]) -> list[str]:
    """Apply the rules in turn; return the pieces of `text` (llama.cpp's bpe_words, before byte encoding)."""
    if not text:
        return []
    spans = [(0, len(text))]
    forms: dict[bool, str] = {}
    for rule in rules:
        form = forms.get(rule.collapsed)
        if form is None:
            form = forms[rule.collapsed] = text.translate(_COLLAPSE if rule.collapsed else _WS_ONLY)
        finditer = rule.pattern.finditer
        new_spans = []
        append = new_spans.append
        for start, end in spans:
            # Searching a slice gives std::regex_iterator's view: the piece is the whole input.
            piece = form if (start == 0 and end == len(form)) else form[start:end]
            pos = 0
            for m in finditer(piece):
                m_start, m_end = m.span()
                if m_start > pos:
                    append((start + pos, start + m_start))
                if m_end > m_start:
                    append((start + m_start, start + m_end))
                pos = m_end
            if pos < end - start:
                append((start + pos, end))
        spans = new_spans
    return [text[s:e] for s, e in spans]


# ---------------------------------------------------------------------------------------------------
# The regexes, verbatim from llama.cpp's llm_tokenizer_bpe constructor (as C string contents).

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s+(?!\S)|\s+")
_LETTERS_UPPER_THEN_LOWER = r"((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
_LETTERS_LOWER_AFTER_UPPER = r"((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
_BLOOM = " ?[^(\\s|.,!?…。，、।۔،)]+"

_REGEXES: dict[str, tuple[str, ...]] = {
    "llama3": (LLAMA3,),
    "jais2": (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)"
        r"|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",),
    "deepseek-llm": (
        "[\r\n]",
        (  # escaped: the class holds characters that Unicode normalization would change (U+212A KELVIN)
            "\\s?["
            "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
            "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
            "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
            "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
            "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
            "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
            "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
            "\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149"
            "\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
            "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
            "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
            "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
            "\U0001e900-\U0001e943"
            "]+"
        ),
        "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
        "\\s+$",
        "[一-龥ࠀ-一가-퟿]+",
        r"\p{N}+",
    ),
    "deepseek3-llm": (
        r"\p{N}{1,3}",
        "[一-龥぀-ゟ゠-ヿ]+",
        r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^""" + "\r\n" + r"""\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
        r"""| ?[\p{P}\p{S}]+[""" + "\r\n" + r"""]*|\s*[""" + "\r\n" + r"""]+|\s+(?!\S)|\s+""",
    ),
    "deepseek-coder": (
        "[\r\n]",
        r"\s?\p{L}+",
        r"\s?\p{P}+",
        "[一-龥ࠀ-一가-퟿]+",
        r"\p{N}",
    ),
    "falcon": (
        r"[\p{P}\$\+<=>\^~\|`]+",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        "[0-9][0-9][0-9]",
    ),
    "starcoder": (r"\p{N}", GPT2),
    "gpt2": (GPT2,),
    "qwen2": (QWEN2,),
    "qwen35": (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+",),
    "bloom": (_BLOOM,),
    "viking": (_BLOOM, r"\p{N}"),
    "tekken": (
        r"[^\r\n\p{L}\p{N}]?" + _LETTERS_UPPER_THEN_LOWER + r"|[^\r\n\p{L}\p{N}]?" + _LETTERS_LOWER_AFTER_UPPER
        + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "chameleon": (
        "<sentinel:[0-9]+>",
        "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        "([\\t\\n]|    |  )",
        r"\p{N}",
        r"[\p{P}!-/:-@\[-`{-~]",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    ),
    "gpt4o": (
        r"[^\r\n\p{L}\p{N}]?" + _LETTERS_UPPER_THEN_LOWER + _CONTRACTIONS + r"?|[^\r\n\p{L}\p{N}]?"
        + _LETTERS_LOWER_AFTER_UPPER + _CONTRACTIONS
        + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "tiny-aya": (
        r"\d{1,3}(?=(?:\d{3})*\b)",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS
        + r"?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS
        + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "superbpe": (r"\p{N}+", r"(?=(\d{3})+(?!\d))"),
    "bailingmoe": (
        r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]|\s+(?!\S)|\s+",),
    "seed-coder": (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "ufakzeka": (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "laguna": ("[^\\n]+|[\\n]+", QWEN2),
    "exaone-moe": (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
        r"|\s*[\r\n]|\s+(?!\S)|\s+",),
    "gemma4": ("[^\\n]+|[\\n]+",),
    "minicpm5": (
        r"\p{N}{1,3}",
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "default": (
        r"[\p{P}\$\+<=>\^~\|]+",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        r"\p{N}+",
        "[0-9][0-9][0-9]",
    ),
}
_REGEXES["grok-2"] = _REGEXES["qwen2"]
_REGEXES["spark2_5"] = (
    r"\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^""" + "\r\n" + r"""\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"""| ?[\p{P}\p{S}]+|[""" + "\r\n" + r"""]|\s+(?!\S)|\s+""",
    r"\p{N}",
)


@dataclass(frozen=True)
class PreTokenizerConfig:
    """What `tokenizer.ggml.pre` selects: the regexes and the vocab flags llama.cpp sets alongside."""

    name: str
    family: str
    rules: tuple[SplitRule, ...]
    clean_spaces: bool = True  # BPE default; many types turn it off
    ignore_merges: bool = False  # a whole word that is a token is taken as is (llama3, tekken, ...)
    add_bos: bool = False  # default for add_bos when the metadata does not say
    force_add_bos: bool = False
    no_bos: bool = False  # the type has no BOS token at all (chatglm)
    byte_encode: bool = True  # GPT-2 byte-to-unicode encoding of words (false for SPM-style BPE)
    escape_whitespaces: bool = False  # spaces become U+2581 before BPE (SPM-style BPE)


# tokenizer.ggml.pre -> (regex family, flags), transcribed from llama_vocab::impl::load.
_NO_CLEAN = {"clean_spaces": False}
_PRE_TYPES: dict[str, tuple[str, dict]] = {
    "default": ("default", {}),
    "minicpm5": ("minicpm5", {"ignore_merges": True}),
    **{name: ("llama3", {"ignore_merges": True, "add_bos": True}) for name in (
        "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
        "jina-v5-nano")},
    "deepseek-llm": ("deepseek-llm", _NO_CLEAN),
    "deepseek-coder": ("deepseek-coder", _NO_CLEAN),
    "deepseek-v3": ("deepseek3-llm", _NO_CLEAN),
    "spark2_5": ("spark2_5", _NO_CLEAN),
    "falcon": ("falcon", {}),
    "mpt": ("gpt2", {}),
    "starcoder": ("starcoder", {}),
    **{name: ("gpt2", {}) for name in (
        "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
        "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4")},
    "jais-2": ("jais2", {}),
    "gemma4": ("gemma4", {"force_add_bos": True, "byte_encode": False, "escape_whitespaces": True}),
    "granite-embed-multi-311m": ("gemma4", {"force_add_bos": True, "byte_encode": False,
                                            "escape_whitespaces": True}),
    "sarvam-moe": ("gemma4", {"byte_encode": False, "escape_whitespaces": True, "clean_spaces": False}),
    "refact": ("starcoder", {}),
    "command-r": ("starcoder", _NO_CLEAN),
    **{name: ("qwen2", _NO_CLEAN) for name in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2")},
    "qwen35": ("qwen35", _NO_CLEAN),
    "stablelm2": ("qwen2", {}),
    "olmo": ("gpt2", {}),
    "dbrx": ("llama3", {}),
    "smaug-bpe": ("llama3", {}),
    "poro-chat": ("bloom", _NO_CLEAN),
    "glm4": ("llama3", {"no_bos": True}),
    "chatglm-bpe": ("llama3", {"no_bos": True}),
    "viking": ("viking", _NO_CLEAN),
    "jais": ("gpt2", {}),
    "tekken": ("tekken", {"clean_spaces": False, "ignore_merges": True, "add_bos": True}),
    "smollm": ("starcoder", _NO_CLEAN),
    "codeshell": ("starcoder", {}),
    "bloom": ("bloom", {}),
    "gpt3-finnish": ("bloom", {}),
    "exaone": ("starcoder", {}),
    "exaone-moe": ("exaone-moe", {}),
    "chameleon": ("chameleon", {"add_bos": True, "clean_spaces": False}),
    "minerva-7b": ("starcoder", {}),
    "megrez": ("qwen2", {}),
    **{name: ("gpt4o", _NO_CLEAN) for name in ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2")},
    **{name: ("tiny-aya", _NO_CLEAN) for name in ("tiny_aya", "cohere2moe")},
    "superbpe": ("superbpe", _NO_CLEAN),
    "trillion": ("gpt2", _NO_CLEAN),
    "granite-docling": ("gpt2", _NO_CLEAN),
    **{name: ("bailingmoe", _NO_CLEAN) for name in ("bailingmoe", "bailingmoe2", "llada-moe")},
    "seed-coder": ("seed-coder", _NO_CLEAN),
    "hunyuan": ("qwen2", _NO_CLEAN),
    **{name: ("deepseek3-llm", _NO_CLEAN) for name in ("hunyuan-dense", "hy_v4", "joyai-llm")},
    "ufakzeka": ("ufakzeka", _NO_CLEAN),
    "grok-2": ("grok-2", _NO_CLEAN),
    "laguna": ("laguna", _NO_CLEAN),
    "solar-open": ("qwen2", _NO_CLEAN),
    "mellum2": ("starcoder", {}),
}

# Types whose llama.cpp pre-tokenizer is hand-written code, not a regex we can reproduce.
_UNSUPPORTED_PRE_TYPES = {
    "kimi-k2": "Kimi-K2's custom Han-aware splitter",
    "afmoe": "AFMoE's custom digit grouping",
    "granite-embed-multi-97m": "lookahead-heavy GPT-4o variant with marks",
    "youtu": "Youtu's CJK-first splitter",
    "whitespace": "the whitespace splitter",
}

_COMPILED: dict[str, tuple[SplitRule, ...]] = {}


def pre_tokenizer_config(name: str) -> PreTokenizerConfig:
    """The pre-tokenizer llama.cpp uses for tokenizer.ggml.pre = `name`; unknown names are an error, as
    in llama.cpp ("unknown pre-tokenizer type")."""
    if name in _UNSUPPORTED_PRE_TYPES:
        raise ModelFileError(f"unsupported pre-tokenizer type '{name}' ({_UNSUPPORTED_PRE_TYPES[name]})")
    if name not in _PRE_TYPES:
        raise ModelFileError(f"unknown pre-tokenizer type: '{name}' (tokenizer.ggml.pre)")
    family, flags = _PRE_TYPES[name]
    rules = _COMPILED.get(family)
    if rules is None:
        rules = _COMPILED[family] = tuple(SplitRule.compile(expr) for expr in _REGEXES[family])
    return PreTokenizerConfig(name=name, family=family, rules=rules, **flags)
