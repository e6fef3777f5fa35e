"""Fill-in-the-middle prompts, laid out as llama.cpp's server lays them out (`format_infill`), but for where the
text typed so far on the cursor's line (`prompt`) goes:

    [extra context] [BOS] <FIM_PRE> prefix <FIM_SUF> suffix <FIM_MID> prompt

llama.cpp appends `prompt` to the prefix, before the suffix. Then every keystroke changes the prompt in front of
the suffix, and everything after it (the suffix: up to a quarter of the batch, ~500 tokens for llama.vim) must be
computed again: a chunk reused from the last keystroke's cache (`--cache-reuse`) keeps keys and values computed
with the old line, and the model answers as if the keystroke had not happened (qwen2.5-coder-0.5b, llama.vim's
requests on json/decoder.py, greedy: 4 of 4 suggestions were the previous keystroke's). Here the line typed so
far is the start of the middle, a split a FIM model is trained on as much as the other (the split point is
random in training), and a keystroke only extends the prompt's end: the cached prompt is an exact prefix of the
next, each keystroke computes its few new tokens, and the answer is exactly a fresh forward's.

The extra context (`input_extra`: other files of the project) goes first. A model trained on repository-level
FIM (qwen2.5-coder has <|repo_name|> and <|file_sep|>) gets it in that pattern:

    <|repo_name|>myproject\\n <|file_sep|>name\\n text ... <|file_sep|>filename\\n <FIM_PRE> ...

otherwise each chunk follows a plain-text "--- snippet ---" separator. The prefix keeps its last tokens and the
suffix its first ones, 3:1 within a batch (2048 tokens, at most half the context), as llama.cpp does; the
extra context fills what the context has left beyond the batch and room to generate. That room is a fixed
GENERATION_ROOM, not the request's n_predict (llama.cpp too sizes it from a server setting): a warm-up (n_predict
0) and the completions after it must cut the extra context at the same token, or they share no prefix.
"""

from __future__ import annotations

from localllm.errors import LocalLLMError

N_BATCH = 2048  # llama.cpp's default batch size, which bounds the prefix and suffix it keeps
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"
GENERATION_ROOM = 128  # tokens; llama.vim's and llama.vscode's n_predict


def infill_tokens(engine, prefix: str, suffix: str, prompt: str = "", extra: list[dict] | None = None,
                  n_predict: int = GENERATION_ROOM) -> list[int]:
    tok = engine.tokenizer
    fim = tok.fim
    if not all(role in fim for role in ("pre", "suf", "mid")):
        raise LocalLLMError(f"{engine.name} has no fill-in-the-middle tokens: /infill needs a code model "
                            "trained for FIM (e.g. qwen2.5-coder)")

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special=False, parse_special=False)

    extra_tokens: list[int] = []
    if "rep" in fim:
        extra_tokens += [fim["rep"]] + encode("myproject\n")
    for chunk in extra or []:
        if "sep" in fim:
            extra_tokens += [fim["sep"]] + encode(chunk.get("filename", "tmp") + "\n")
        else:
            extra_tokens += encode(SNIPPET_SEPARATOR)
        extra_tokens += encode(chunk.get("text", ""))
    if "sep" in fim:
        extra_tokens += [fim["sep"]] + encode("filename\n")

    prefix_t, suffix_t, prompt_t = encode(prefix), encode(suffix), encode(prompt)
    n_batch = min(N_BATCH, engine.ctx // 2)
    n_prefix = min(len(prefix_t), 3 * (n_batch // 4))
    n_suffix = min(len(suffix_t), max(0, n_batch // 4 - (2 + len(prompt_t))))
    n_extra = min(max(0, engine.ctx - n_batch - 2 * max(n_predict, 0)), len(extra_tokens))

    head = [fim["pre"]] + prefix_t[len(prefix_t) - n_prefix:]
    tail = [fim["suf"]] + suffix_t[:n_suffix]
    if tok.add_bos and tok.bos_id is not None:
        head = [tok.bos_id] + head
    extra_part = extra_tokens[len(extra_tokens) - n_extra:] if n_extra else []
    return extra_part + head + tail + [fim["mid"]] + prompt_t


class IndentCut:
    """llama.cpp's `n_indent` for code completion: once a new line of the generated text starts with less
    indentation than n_indent (the cursor line's), the text is cut there and generation ends: the completion
    has left the block being written. (Blank lines are not judged: a block may contain them.)"""

    def __init__(self, n_indent: int):
        self.n_indent = n_indent
        self.text = ""
        self.line_start: int | None = None  # start of the first line not yet judged (after a newline)

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text to emit, stop?)"""
        start = len(self.text)
        self.text += piece
        while True:
            if self.line_start is None:
                nl = self.text.find("\n", start)
                if nl < 0:
                    return piece, False
                self.line_start = nl + 1
            pos = self.line_start
            while pos < len(self.text) and self.text[pos] in " \t":
                pos += 1
            if pos >= len(self.text):
                return piece, False  # only indentation so far: undecided
            if self.text[pos] != "\n" and pos - self.line_start < self.n_indent:
                cut = self.text[start:pos]
                self.text = self.text[:pos]
                return cut, True
            start, self.line_start = self.line_start, None
