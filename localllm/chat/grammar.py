"""Constrained decoding: JSON schemas, GBNF grammars and regexes compiled with llguidance against a model's
vocabulary, and the per-sequence matcher that the sampler chain consults (sampling.py's grammar stage).

llguidance (guidance-ai's Rust engine, a wheel with no runtime dependencies) computes the set of tokens that
keep the output inside the grammar: on smollm2's 49k vocabulary a JSON schema compiles in ~2 ms and a token
mask takes ~0.2 ms. Its tokenizer is built here from localllm's own `Tokenizer` (each token's bytes as
llama.cpp's token_to_piece renders them; control tokens marked with a 0xFF prefix, as llguidance's llama.cpp
binding marks them, so grammar text can never produce them), once per vocabulary.

A schema or grammar that does not compile raises a LocalLLMError carrying llguidance's reason: a request that
asked for structure gets an error, never an unconstrained answer.
"""

from __future__ import annotations

import json
import threading
import weakref

import numpy as np

from localllm.errors import LocalLLMError
from localllm.tokenizer.vocab import ATTR_CONTROL, ATTR_USER_DEFINED

__all__ = ["Grammar", "compile_grammar", "json_schema_grammar", "gbnf_grammar", "regex_grammar", "lark_grammar",
           "ANY_JSON_OBJECT"]

ANY_JSON_OBJECT = {"type": "object"}

# Whitespace a JSON answer may hold between tokens, as llama.cpp's json-schema-to-grammar bounds it
# (`space ::= | " " | "\n"{1,2} [ \t]{0,20}`): unbounded whitespace lets a small model pad forever.
_JSON_WHITESPACE = r"(?:\x20|\n{1,2}[\x20\t]{0,20})?"

_tokenizers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


def _llg():
    try:
        import llguidance
    except ImportError as e:  # a broken install: say what is missing
        raise LocalLLMError(f"structured output needs the 'llguidance' package ({e})") from None
    return llguidance


def ll_tokenizer(tokenizer, n_vocab: int):
    """llguidance's tokenizer for localllm's `tokenizer` whose model has `n_vocab` logits (a model may have
    more logits than tokens: those rows are empty tokens, never allowed). Built once per vocabulary (~0.5 s on
    smollm2's 49k tokens), then cached."""
    with _tokenizers_lock:
        cached = _tokenizers.get(tokenizer)
        if cached is not None and cached[0] == n_vocab:
            return cached[1]
        llg = _llg()
        vocab = tokenizer.vocab
        attrs = vocab.attrs
        pieces: list[bytes] = []
        special: list[int] = []
        for t in range(tokenizer.vocab_size):
            b = tokenizer.piece_bytes(t, True)
            a = int(attrs[t])
            if a & ATTR_CONTROL or (a & ATTR_USER_DEFINED and b.startswith(b"<") and b.endswith(b">")):
                b = b"\xff" + b
                special.append(t)
            pieces.append(b)
        pieces += [b""] * max(0, n_vocab - len(pieces))

        class _Source:  # what llguidance.TokenizerWrapper reads
            eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else min(tokenizer.eog_ids, default=0)
            bos_token_id = tokenizer.bos_id
            tokens = pieces
            special_token_ids = special

            def __call__(self, text):
                if isinstance(text, bytes):
                    text = text.decode("utf-8", "replace")
                return tokenizer.encode(text, add_special=False, parse_special=False)

        eos = sorted(tokenizer.eog_ids) or [_Source.eos_token_id]
        llt = llg.LLTokenizer(llg.TokenizerWrapper(_Source()), n_vocab=n_vocab, eos_token=eos)
        _tokenizers[tokenizer] = (n_vocab, llt)
        return llt


class Grammar:
    """A compiled constraint for one model's vocabulary. `matcher()` gives each sequence its own state."""

    def __init__(self, matcher, kind: str, vocab_size: int):
        self._template = matcher
        self.kind = kind  # "json_schema", "gbnf", "regex", "lark" (for messages and logs)
        self.vocab_size = vocab_size

    def matcher(self) -> "GrammarMatcher":
        return GrammarMatcher(self._template.deep_copy(), self.vocab_size)

    def __repr__(self) -> str:
        return f"Grammar({self.kind})"


class GrammarMatcher:
    """One sequence's position in a grammar: which tokens may come next, advanced token by token."""

    def __init__(self, matcher, vocab_size: int):
        self._m = matcher
        self.vocab_size = vocab_size

    def clone(self) -> "GrammarMatcher":
        return GrammarMatcher(self._m.deep_copy(), self.vocab_size)

    def reset(self) -> None:
        self._m.reset()

    # A panic inside llguidance (pyo3's PanicException, a BaseException) must fail this request only, never the
    # scheduler's thread: each call below turns one into a LocalLLMError.

    def allows(self, token: int) -> bool:
        """Whether `token` may come next (an end-of-generation token: whether the grammar is complete)."""
        try:
            return self._m.validate_tokens([int(token)]) == 1
        except BaseException as e:
            raise _failed(e) from None

    def allowed(self) -> np.ndarray:
        """The full mask: a bool per token id."""
        try:
            bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        except BaseException as e:
            raise _failed(e) from None
        self._check()
        return np.unpackbits(bits, bitorder="little", count=self.vocab_size).view(np.bool_)

    def consume(self, token: int) -> None:
        try:
            ok = self._m.consume_token(int(token))
        except BaseException as e:
            raise _failed(e) from None
        if not ok:
            self._check()
            raise LocalLLMError(f"token {token} does not fit the grammar")

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order from here, the grammar allows (state unchanged)."""
        try:
            return self._m.validate_tokens([int(t) for t in tokens])
        except BaseException as e:
            raise _failed(e) from None

    def rollback(self, n: int) -> None:
        self._m.rollback(int(n))

    @property
    def accepting(self) -> bool:
        """The output so far is a complete match (the model may end here)."""
        return self._m.is_accepting()

    @property
    def stopped(self) -> bool:
        """Nothing but the end of generation can follow."""
        return self._m.is_stopped()

    def _check(self) -> None:
        if self._m.is_error():
            raise LocalLLMError(f"the grammar failed: {self._m.get_error()}")


def _binding_error(e: BaseException) -> bool:
    """An error of llguidance's on input it could not take (not Ctrl-C, not an exit): pyo3 turns a Rust panic
    into PanicException, which derives from BaseException."""
    return isinstance(e, Exception) or type(e).__name__ == "PanicException"


def _failed(e: BaseException) -> BaseException:
    if not _binding_error(e):
        return e  # Ctrl-C and exits go on as they were
    return LocalLLMError(f"the grammar failed: {_short(str(e))}")


class Validated:
    """llguidance grammar text that compiled without a vocabulary (`_compile` with no tokenizer: what a grammar
    worker process hands back, localllm/chat/grammar_worker.py); `matcher_for` builds it for a model's vocabulary."""

    def __init__(self, text: str, kind: str):
        self.text, self.kind = text, kind


def limits():
    """llguidance's parser limits for client grammars: its own defaults, and error messages without the parser
    state (which can be as long as the grammar)."""
    return _llg().LLParserLimits(verbose_errors=False)


_BYTE_TOKENIZERS: dict = {}


def special_names(tokenizer) -> list[str]:
    """The special tokens a grammar may name (`<tool_call>`, `<|im_end|>`): as ll_tokenizer marks them."""
    vocab = tokenizer.vocab
    names = []
    for t in range(tokenizer.vocab_size):
        a = int(vocab.attrs[t])
        if a & ATTR_CONTROL or a & ATTR_USER_DEFINED:
            b = tokenizer.piece_bytes(t, True)
            if a & ATTR_CONTROL or (b.startswith(b"<") and b.endswith(b">")):
                names.append(b.decode("utf-8", "replace"))
    return names


def _byte_tokenizer(specials: tuple[str, ...]):
    """An llguidance tokenizer of the 256 bytes, the model's special tokens and an end token: what a grammar
    worker builds a validated grammar for, so that what fails only when a grammar is built (llguidance asserts
    fewer than 65,525 grammar symbols) fails there, in the worker, and not in the server."""
    llt = _BYTE_TOKENIZERS.get(specials)
    if llt is None:
        llg = _llg()
        eos = 256 + len(specials)

        class _Source:  # what llguidance.TokenizerWrapper reads
            eos_token_id = eos
            bos_token_id = None
            tokens = [bytes([i]) for i in range(256)] + [b"\xff" + n.encode() for n in specials] + [b"\xff<eos>"]
            special_token_ids = list(range(256, eos + 1))

            def __call__(self, text):
                return list(text.encode("utf-8", "replace") if isinstance(text, str) else text)

        llt = llg.LLTokenizer(llg.TokenizerWrapper(_Source()), n_vocab=eos + 1, eos_token=[eos])
        if len(_BYTE_TOKENIZERS) > 8:
            _BYTE_TOKENIZERS.clear()
        _BYTE_TOKENIZERS[specials] = llt
    return llt


def check_buildable(validated: Validated, specials: tuple[str, ...] = ()) -> None:
    """Build `validated` for a vocabulary of bytes, or raise LocalLLMError: a grammar of 130,000 alternatives
    passes validation and then, built for a model's vocabulary, took 16 s and 150-300 MB of the server's memory
    before llguidance's assertion on its symbol count stopped it (the hostile-input soak, issue 39); built here
    first, in the worker, it takes them from the worker's budget."""
    llg = _llg()
    try:
        matcher = llg.LLMatcher(_byte_tokenizer(tuple(specials)), validated.text, log_level=0, limits=limits())
        error = matcher.get_error() if matcher.is_error() else None
    except BaseException as e:
        if not _binding_error(e):
            raise
        error = str(e)
    if error is not None:
        raise LocalLLMError(f"the {_NAMES[validated.kind]} does not compile: {_short(error)}")


def matcher_for(validated: Validated, tokenizer, n_vocab: int) -> Grammar:
    """The Grammar of grammar text a worker validated, for `tokenizer`'s vocabulary."""
    return _compile(validated.text, validated.kind, tokenizer, n_vocab, validate=False)


def _compile(ll_grammar: str, kind: str, tokenizer, n_vocab: int, validate: bool = True):
    llg = _llg()
    llt = ll_tokenizer(tokenizer, n_vocab) if tokenizer is not None else None
    try:
        is_error, messages = (llg.LLMatcher.validate_grammar_with_warnings(ll_grammar, llt, limits=limits())
                              if validate else (False, []))
        matcher = None if is_error or llt is None else llg.LLMatcher(llt, ll_grammar, log_level=0, limits=limits())
    except BaseException as e:
        if not _binding_error(e):
            raise
        is_error, messages = True, [str(e)]
    if is_error:
        raise LocalLLMError(f"the {_NAMES[kind]} does not compile: {_short(messages[0] if messages else '?')}")
    if llt is None:
        return Validated(ll_grammar, kind)
    if matcher.is_error():
        raise LocalLLMError(f"the {_NAMES[kind]} does not compile: {_short(matcher.get_error())}")
    return Grammar(matcher, kind, n_vocab)


_NAMES = {"json_schema": "JSON schema", "gbnf": "grammar", "regex": "regex", "lark": "grammar"}


def _short(message: str, limit: int = 600) -> str:
    """An error message for a client: at most `limit` characters, without a Rust panic's backtrace or
    location (what llguidance's panics carry after the reason)."""
    message = message.strip()
    for marker in ("<backtrace>", "stack backtrace:", "Stack backtrace:", "note: run with `RUST_BACKTRACE", "\n   0: "):
        message = message.split(marker, 1)[0].strip()
    return message if len(message) <= limit else message[:limit] + " ..."


def json_schema_grammar(schema, tokenizer, n_vocab: int) -> Grammar:
    """A JSON schema (a dict, or its JSON text); `ANY_JSON_OBJECT` for "any JSON object"."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise LocalLLMError(f"the JSON schema is not valid JSON: {e}") from None
    if isinstance(schema, bool):  # JSON Schema's `true` accepts anything: llguidance wants an object
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise LocalLLMError(f"a JSON schema must be an object, got {type(schema).__name__}")
    llg = _llg()
    try:
        g = llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_pattern": _JSON_WHITESPACE})
    except BaseException as e:  # ValueError for what is not an object; a Rust panic is a BaseException
        if not _binding_error(e):
            raise
        raise LocalLLMError(f"the JSON schema does not compile: {_short(str(e))}") from None
    return _compile(g, "json_schema", tokenizer, n_vocab)


def gbnf_grammar(text: str, tokenizer, n_vocab: int) -> Grammar:
    """A llama.cpp GBNF grammar (its rule `root` is the answer); Lark text is accepted too."""
    if not isinstance(text, str) or not text.strip():
        raise LocalLLMError("the grammar is empty")
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        lark = any_to_lark(text)
    except Exception as e:  # the converter's own error (GbnfToLarkError) and anything it trips on
        raise LocalLLMError(f"the grammar does not compile: {_short(str(e))}") from None
    return _compile(_llg().LLMatcher.grammar_from_lark(lark), "gbnf", tokenizer, n_vocab)


def lark_grammar(text: str, tokenizer, n_vocab: int) -> Grammar:
    """llguidance's Lark grammar (special tokens as <name>, `%json {schema}` inline, lazy lexemes): what
    chat/tool_formats.py writes for a tool call's lazy constraint."""
    if not isinstance(text, str) or not text.strip():
        raise LocalLLMError("the grammar is empty")
    try:
        grammar = _llg().LLMatcher.grammar_from_lark(text)
    except BaseException as e:
        if not _binding_error(e):
            raise
        raise LocalLLMError(f"the grammar does not compile: {_short(str(e))}") from None
    return _compile(grammar, "lark", tokenizer, n_vocab)


def regex_grammar(pattern: str, tokenizer, n_vocab: int) -> Grammar:
    if not isinstance(pattern, str):
        raise LocalLLMError("a regex must be a string")
    return _compile(_llg().LLMatcher.grammar_from_regex(pattern), "regex", tokenizer, n_vocab)


def compile_grammar(tokenizer, n_vocab: int, *, json_schema=None, gbnf: str | None = None,
                    regex: str | None = None, lark: str | None = None) -> Grammar | None:
    """The one constraint given (None when none is): at most one of json_schema, gbnf, regex and lark."""
    given = [k for k, v in (("json_schema", json_schema), ("grammar", gbnf), ("regex", regex), ("lark", lark))
             if v is not None]
    if len(given) > 1:
        raise LocalLLMError(f"give one constraint, not {' and '.join(given)}")
    if json_schema is not None:
        return json_schema_grammar(json_schema, tokenizer, n_vocab)
    if gbnf is not None:
        return gbnf_grammar(gbnf, tokenizer, n_vocab)
    if regex is not None:
        return regex_grammar(regex, tokenizer, n_vocab)
    if lark is not None:
        return lark_grammar(lark, tokenizer, n_vocab)
    return None
