"""The vocabulary as llama.cpp loads it (`llama_vocab::impl::load` in src/llama-vocab.cpp).

Everything that decides *which* ids come out, apart from the merge algorithms themselves, is settled here:
token texts and attributes, scores, BPE merge ranks, the special ids with llama.cpp's per-model defaults,
add_bos/add_eos/add_space_prefix, the end-of-generation set and the FIM roles (found by metadata key and by
token text), and the list of special tokens that `tokenizer_st_partition` cuts out of a text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from localllm.architectures.validate import check_tokenizer
from localllm.errors import ModelFileError

from .pretokenize import PreTokenizerConfig, pre_tokenizer_config

log = logging.getLogger(__name__)

# Token types stored in tokenizer.ggml.token_type (llama.h `llama_token_type`).
TYPE_UNDEFINED, TYPE_NORMAL, TYPE_UNKNOWN, TYPE_CONTROL, TYPE_USER_DEFINED, TYPE_UNUSED, TYPE_BYTE = range(7)

# Token attributes (llama.h `llama_token_attr`): a bit set, because llama.cpp adds bits after loading
# (e.g. CONTROL on an "<|im_end|>" that the converter left NORMAL, RSTRIP on phi-3's specials).
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_NORMALIZED = 1 << 6
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8
ATTR_SINGLE_WORD = 1 << 9

_TYPE_TO_ATTR = np.array(
    [ATTR_UNDEFINED, ATTR_NORMAL, ATTR_UNKNOWN, ATTR_CONTROL, ATTR_USER_DEFINED, ATTR_UNUSED, ATTR_BYTE],
    dtype=np.int32,
)

# Token texts llama.cpp recognises when the metadata names no id (the "auto-detect special tokens by
# text" block of llama_vocab::impl::load). Where several are present llama.cpp takes whichever its hash
# map yields first; we take the first present in this order.
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
            "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
            "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
            "<|code_middle|>", "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
# Every token with one of these texts ends generation (llama.cpp issue #9606: "determined based on the
# token text, which is obviously not ideal").
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
              "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
              "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
              "<｜end▁of▁sentence｜>", "[e~[")

# Metadata keys of the special ids. "seperator" is spelled as llama.cpp spells it (LLM_KV_TOKENIZER_SEP_ID).
_SPECIAL_ID_KEYS = (
    ("bos", "tokenizer.ggml.bos_token_id"),
    ("eos", "tokenizer.ggml.eos_token_id"),
    ("eot", "tokenizer.ggml.eot_token_id"),
    ("eom", "tokenizer.ggml.eom_token_id"),
    ("unk", "tokenizer.ggml.unknown_token_id"),
    ("sep", "tokenizer.ggml.seperator_token_id"),
    ("pad", "tokenizer.ggml.padding_token_id"),
    ("mask", "tokenizer.ggml.mask_token_id"),
    ("fim_pre", "tokenizer.ggml.fim_pre_token_id"),
    ("fim_suf", "tokenizer.ggml.fim_suf_token_id"),
    ("fim_mid", "tokenizer.ggml.fim_mid_token_id"),
    ("fim_pad", "tokenizer.ggml.fim_pad_token_id"),
    ("fim_rep", "tokenizer.ggml.fim_rep_token_id"),
    ("fim_sep", "tokenizer.ggml.fim_sep_token_id"),
    # deprecated spellings, read after the new ones exactly as llama.cpp does
    ("fim_pre", "tokenizer.ggml.prefix_token_id"),
    ("fim_suf", "tokenizer.ggml.suffix_token_id"),
    ("fim_mid", "tokenizer.ggml.middle_token_id"),
)

_UNSUPPORTED_MODELS = {
    "bert": "WordPiece (BERT)",
    "t5": "Unigram (T5)",
    "rwkv": "RWKV",
    "plamo2": "PLaMo-2",
    "no_vocab": "no vocabulary",
    "none": "no vocabulary",
    "hybriddna": "hybrid DNA",
    "whitespace": "whitespace-split BPE",
}


@dataclass
class Vocab:
    """A loaded vocabulary. `kind` is "spm" (tokenizer.ggml.model = llama) or "bpe" (gpt2, gemma4)."""

    kind: str
    model_name: str
    pre_name: str
    pre: PreTokenizerConfig | None
    texts: list[str]
    token_to_id: dict[str, int]
    attrs: np.ndarray  # int32 attribute bits per id
    scores: list[float]  # SPM merge priority per id (0.0 when the file has none)
    merge_ranks: dict[str, int]  # BPE: "left right" -> rank (the merge line itself is the key)
    special: dict[str, int | None]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    clean_spaces: bool
    ignore_merges: bool
    escape_whitespaces: bool
    eog_ids: frozenset[int]
    special_tokens: list[int] = field(default_factory=list)  # partition order: longest text first

    @property
    def n_tokens(self) -> int:
        return len(self.texts)

    def has_attr(self, token_id: int, attr: int) -> bool:
        return bool(int(self.attrs[token_id]) & attr)


def load_vocab(meta: dict) -> Vocab:
    check_tokenizer(meta)  # types and lengths of every key read below
    model_name = meta.get("tokenizer.ggml.model")
    if model_name is None:
        raise ModelFileError("the model file has no tokenizer (tokenizer.ggml.model is missing)")
    if model_name in _UNSUPPORTED_MODELS:
        raise ModelFileError(
            f"unsupported tokenizer model '{model_name}' ({_UNSUPPORTED_MODELS[model_name]}): "
            "only SentencePiece ('llama') and byte-level BPE ('gpt2') vocabularies are supported")
    if model_name not in ("llama", "gpt2", "gemma4"):
        raise ModelFileError(f"unknown tokenizer model '{model_name}'")

    texts = meta.get("tokenizer.ggml.tokens")
    if not texts:
        raise ModelFileError("the model file has no vocabulary (tokenizer.ggml.tokens)")
    texts = list(texts)
    n = len(texts)
    if "" in texts:  # llama.cpp renames empty tokens so that they can never match
        texts = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(texts)]

    # First occurrence wins, as with llama.cpp's token_to_id.emplace.
    token_to_id = dict(zip(reversed(texts), range(n - 1, -1, -1)))

    token_types = meta.get("tokenizer.ggml.token_type")
    if token_types is None:
        attrs = np.full(n, ATTR_NORMAL, dtype=np.int32)
    else:
        token_types = np.asarray(token_types, dtype=np.int64)[:n]
        if len(token_types) < n:
            raise ModelFileError("tokenizer.ggml.token_type is shorter than the vocabulary")
        in_range = (token_types >= 0) & (token_types < len(_TYPE_TO_ATTR))
        attrs = np.where(in_range, _TYPE_TO_ATTR[np.clip(token_types, 0, len(_TYPE_TO_ATTR) - 1)], ATTR_UNDEFINED)
        attrs = attrs.astype(np.int32)

    raw_scores = meta.get("tokenizer.ggml.scores")
    scores = [0.0] * n if raw_scores is None else np.asarray(raw_scores, dtype=np.float32)[:n].tolist()

    merge_ranks: dict[str, int] = {}
    pre_name = meta.get("tokenizer.ggml.pre") or ""
    special: dict[str, int | None] = dict.fromkeys(k for k, _ in _SPECIAL_ID_KEYS)

    if model_name == "llama":
        kind = "spm"
        special.update(bos=1, eos=2, unk=0)
        pre = None
        add_space_prefix, clean_spaces, add_bos, add_eos = True, False, True, False
        ignore_merges, escape_whitespaces = False, True
    else:
        kind = "bpe"
        merges = meta.get("tokenizer.ggml.merges")
        if merges is None:
            raise ModelFileError("cannot find tokenizer merges in model file (tokenizer.ggml.merges)")
        merges = list(merges)
        # Keyed by the merge line itself: BPE symbols never contain a space, so "left right" is unique,
        # and building the dict stays at C speed. First occurrence wins, like bpe_ranks.emplace.
        merge_ranks = dict(zip(reversed(merges), range(len(merges) - 1, -1, -1)))
        if model_name == "gemma4":
            pre_name = "gemma4"
        else:
            special.update(bos=11, eos=11)
        if not pre_name:
            log.warning("missing pre-tokenizer type, using 'default': generation quality will be degraded")
        pre = pre_tokenizer_config(pre_name or "default")
        add_space_prefix, clean_spaces, add_bos, add_eos = False, pre.clean_spaces, pre.add_bos, False
        ignore_merges, escape_whitespaces = pre.ignore_merges, pre.escape_whitespaces
        if pre.no_bos:
            special["bos"] = None

    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", add_space_prefix))

    # Special ids: the per-model default is dropped when out of range; a metadata id out of range is
    # ignored (the default stays).
    for role, key in _SPECIAL_ID_KEYS:
        if special[role] is not None and special[role] >= n:
            special[role] = None
        value = meta.get(key)
        if value is None:
            continue
        value = int(value)
        if 0 <= value < n:
            special[role] = value
        else:
            log.warning("bad special token: %s = %d, using default id %s", key, value, special[role])

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", add_eos))
    if pre is not None and pre.force_add_bos:
        add_bos = True  # llama.cpp's Gemma 4 workaround (PR #21500)
    if add_bos and special["bos"] is None:
        raise ModelFileError("tokenizer.ggml.add_bos_token is true, but tokenizer.ggml.bos_token_id is not set")
    if add_eos and special["eos"] is None:
        raise ModelFileError("tokenizer.ggml.add_eos_token is true, but tokenizer.ggml.eos_token_id is not set")

    eog_ids = _find_special_tokens_by_text(texts, token_to_id, attrs, special)
    _apply_model_specific_attributes(meta, texts, token_to_id, attrs)

    vocab = Vocab(
        kind=kind, model_name=model_name, pre_name=pre_name, pre=pre, texts=texts, token_to_id=token_to_id,
        attrs=attrs, scores=scores, merge_ranks=merge_ranks, special=special, add_bos=add_bos,
        add_eos=add_eos, add_space_prefix=add_space_prefix, clean_spaces=clean_spaces,
        ignore_merges=ignore_merges, escape_whitespaces=escape_whitespaces, eog_ids=eog_ids,
    )
    vocab.special_tokens = _special_tokens_longest_first(texts, attrs)
    return vocab


def _mark_control(attrs: np.ndarray, token_id: int) -> None:
    # "control-looking token ... was not control-type; its type will be overridden"
    attrs[token_id] |= ATTR_CONTROL


def _find_special_tokens_by_text(texts, token_to_id, attrs, special) -> frozenset[int]:
    """EOT/EOM/FIM detection by token text, "unused" marking, and the end-of-generation set."""

    def first_present(candidates):
        for text in candidates:
            token_id = token_to_id.get(text)
            if token_id is not None:
                return token_id
        return None

    for role, candidates in (("eot", _EOT_TEXTS), ("eom", _EOM_TEXTS)):
        if special[role] is None:
            found = first_present(candidates)
            if found is not None:
                special[role] = found
                _mark_control(attrs, found)
    for role, candidates in _FIM_TEXTS.items():
        key = "fim_" + role
        if special[key] is None:
            found = first_present(candidates)
            if found is not None:
                special[key] = found
                _mark_control(attrs, found)

    # Control tokens whose text says "unused" are unused (gemma's <unusedN>).
    for token_id in np.flatnonzero(attrs & ATTR_CONTROL).tolist():
        if "unused" in texts[token_id]:
            attrs[token_id] |= ATTR_UNUSED

    eog: set[int] = set()
    for role in ("fim_pad", "fim_rep", "fim_sep"):
        if special[role] is not None:
            eog.add(special[role])
    for text in _EOG_TEXTS:
        token_id = token_to_id.get(text)
        if token_id is not None:
            eog.add(token_id)
            _mark_control(attrs, token_id)

    # gpt-oss: these always render, so they are user-defined whatever the file says.
    for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
        token_id = token_to_id.get(text)
        if token_id is not None:
            attrs[token_id] = ATTR_USER_DEFINED

    for role in ("eos", "eot", "eom"):
        if special[role] is not None:
            eog.add(special[role])

    # o200k_harmony / solar-open: "<|end|>" is not end-of-generation when the return/call tokens exist.
    eog_texts = {texts[i] for i in eog}
    if "<|end|>" in eog_texts and (
        ("<|return|>" in eog_texts and ("<|call|>" in eog_texts or "<|calls|>" in eog_texts))
        or (("<|call|>" in eog_texts or "<|calls|>" in eog_texts) and "<|flush|>" in eog_texts)
    ):
        end_id = token_to_id["<|end|>"]
        eog.discard(end_id)
        attrs[end_id] = ATTR_USER_DEFINED
    # gemma4 / paddleocr: "</s>" is not end-of-generation next to "<|tool_response>".
    if "<|tool_response>" in eog_texts and "</s>" in eog_texts:
        s_id = token_to_id["</s>"]
        eog.discard(s_id)
        attrs[s_id] = ATTR_NORMAL
    return frozenset(eog)


def _special_tokens_longest_first(texts, attrs) -> list[int]:
    """llama.cpp's cache_special_tokens: control, user-defined and unknown tokens, longest text (in UTF-8
    bytes) first. llama.cpp's std::sort leaves equal lengths in no particular order; we keep id order."""
    ids = np.flatnonzero(attrs & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)).tolist()
    return sorted(ids, key=lambda i: -len(texts[i].encode("utf-8", "surrogateescape")))


def _apply_model_specific_attributes(meta, texts, token_to_id, attrs) -> None:
    """Per-model lstrip/rstrip attributes llama.cpp sets by model name ("Handle per token attributes")."""
    model_name = str(meta.get("general.name", "")).lower()
    pre_name = str(meta.get("tokenizer.ggml.pre", ""))
    arch = str(meta.get("general.architecture", ""))

    if any(s in pre_name for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
            s in arch for s in ("nomic-bert-moe", "jina-bert-v3")):
        if "<mask>" in token_to_id:
            attrs[token_to_id["<mask>"]] |= ATTR_LSTRIP
    elif "phi-3" in model_name or "phi3" in model_name:
        # Phi-3 eats the whitespace after its special tokens, except after <unk>, <s> and <|endoftext|>.
        for token_id in _special_tokens_longest_first(texts, attrs):
            attrs[token_id] |= ATTR_RSTRIP
        if "</s>" in token_to_id:
            attrs[token_to_id["</s>"]] |= ATTR_RSTRIP
        for text in ("<unk>", "<s>", "<|endoftext|>"):
            if text in token_to_id:
                attrs[token_to_id[text]] &= ~ATTR_RSTRIP
    elif "modern-bert" in model_name:
        if "[MASK]" in token_to_id:
            attrs[token_to_id["[MASK]"]] |= ATTR_LSTRIP
