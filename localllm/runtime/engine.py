"""The engine: a loaded model (weights, tokenizer, chat template) and `generate()`, the one token stream that
the CLI, the TUI and the server all consume.

`generate()` is an iterator of `TokenEvent`s. Stopping early is simply not asking for the next event; the
final event carries the finish reason and the timings, named as llama.cpp's server names them.
A `Sequence` keeps a conversation's tokens and KV cache between calls, so the next turn only processes the
tokens that are new (its common prefix with the cached tokens is reused). All sequences draw their KV blocks
from the engine's `KVPool`, which also keeps the blocks of finished sequences: a new sequence whose prompt
starts with cached blocks (a shared system prompt, a regenerated answer) attaches them instead of recomputing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from localllm.architectures import for_context, load_model_config
from localllm import backends, parameters
from localllm.architectures.transformer import Transformer
from localllm.runtime.cache_reuse import Splice, find_splices
from localllm.errors import ContextOverflowError, LocalLLMError
from localllm.gguf_file import GGUFFile
from localllm.runtime.kv_cache import KV_TYPES, KVCache, KVPool
from localllm.chat.sampling import Sampler, SamplingParams
from localllm.runtime.speculative import SpeculationParams, SpeculativeRun, check_draft_engine, make_drafter
from localllm.chat.stop import StopMatcher
from localllm.tokenizer import Tokenizer
from localllm.runtime.warmup import warm_up

DEFAULT_CTX = 4096
# llama.cpp's LLAMA_POOLING_TYPE_* values a GGUF may carry in {arch}.pooling_type (0 none and 4 rank are not
# sentence embeddings: they fall back to the default).
POOLING_TYPES = {1: "mean", 2: "cls", 3: "last"}
# Decoder models carry no pooling type. Mean over the text's tokens, measured on the four catalog models (tests/
# test_embeddings.py): related sentences score above unrelated ones with mean pooling on all four.
POOLING_DEFAULT = "mean"
PROMPT_CHUNK = 256  # tokens per forward while processing a prompt: bounds attention-score memory


@dataclass
class GenerationParams:
    max_tokens: int | None = 256  # None: until end of generation or the context is full
    stop: list[str] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    ignore_eos: bool = False
    # At the context limit: "stop" finishes with "length"; "shift" drops the older half of the tokens after the
    # first n_keep and goes on, as llama.cpp's context shift does. n_keep < 0 keeps the whole prompt (--keep -1).
    context_overflow: str = "stop"
    n_keep: int = 0
    # Speculative decoding (n-gram or a draft model; see speculative.py); None = off. Lossless: greedy output is
    # token for token the same, sampled output keeps the target's distribution.
    speculation: SpeculationParams | None = None
    # llama.cpp's t_max_predict_ms (code completion): once this many ms have passed since the prompt was read,
    # the next generated text that holds a newline ends the answer ("length"), so a suggestion stays quick.
    t_max_predict_ms: float | None = None
    # A compiled constraint (grammar.py: JSON schema, GBNF, regex); each generation gets its own matcher, which
    # the sampler consults (sampling.py's stage 0b). The answer ends when the grammar is complete and the model
    # (or, when nothing else fits, the grammar) picks the end of generation.
    grammar: object | None = None


@dataclass
class Timings:
    """What llama.cpp's server reports as `timings`."""

    prompt_n: int = 0  # prompt tokens evaluated
    cache_n: int = 0  # prompt tokens reused from the cache
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    token_ms: list[float] = field(default_factory=list)  # wall time of each generated token
    n_shifts: int = 0  # context shifts during generation (context_overflow="shift")
    # Speculative decoding (llama.cpp's server names the first two): tokens drafted and checked, drafted tokens
    # the target accepted, and forwards that verified a draft.
    draft_n: int = 0
    draft_n_accepted: int = 0
    n_verifies: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.draft_n_accepted / self.draft_n if self.draft_n else 0.0

    @property
    def tokens_per_verify(self) -> float:
        """Tokens a verifying forward yielded on average: the accepted drafts and the target's own next token."""
        return (self.draft_n_accepted + self.n_verifies) / self.n_verifies if self.n_verifies else 0.0

    @property
    def prompt_per_second(self) -> float:
        return 1000.0 * self.prompt_n / self.prompt_ms if self.prompt_ms > 0 else 0.0

    @property
    def predicted_per_second(self) -> float:
        return 1000.0 * self.predicted_n / self.predicted_ms if self.predicted_ms > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "prompt_n": self.prompt_n,
            "cache_n": self.cache_n,
            "prompt_ms": round(self.prompt_ms, 3),
            "prompt_per_token_ms": round(self.prompt_ms / self.prompt_n, 3) if self.prompt_n else 0.0,
            "prompt_per_second": round(self.prompt_per_second, 3),
            "predicted_n": self.predicted_n,
            "predicted_ms": round(self.predicted_ms, 3),
            "predicted_per_token_ms": round(self.predicted_ms / self.predicted_n, 3) if self.predicted_n else 0.0,
            "predicted_per_second": round(self.predicted_per_second, 3),
            "n_shifts": self.n_shifts,
            "draft_n": self.draft_n,
            "draft_n_accepted": self.draft_n_accepted,
            "n_verifies": self.n_verifies,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_verify": round(self.tokens_per_verify, 3),
        }


@dataclass
class TokenEvent:
    token: int | None  # None on a final event that generated nothing new (e.g. flushed text)
    text: str  # text this step releases (may be "" while a character or a possible stop string is pending)
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (end of generation or a stop string) or "length"
    timings: Timings | None = None


class Sequence:
    """One conversation's state in the engine: the tokens in its KV cache, and the cache."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.tokens: list[int] = []

    def reuse_prefix(self, tokens: list[int]) -> int:
        """Keep the longest cached prefix of `tokens`: from this sequence's own history, or from blocks the pool
        still caches when those go further. At least one token is always left to evaluate, since the forward
        pass must produce the logits of the last prompt position. Returns how many are reused."""
        common = 0
        limit = min(len(self.tokens), len(tokens) - 1)
        while common < limit and self.tokens[common] == tokens[common]:
            common += 1
        if not self.cache.can_truncate(common):
            common = 0  # a sliding-window layer already dropped keys this position would need
        if self.cache.cached_length(tokens[: len(tokens) - 1]) > common:
            self.cache.truncate(0)
            common = self.cache.attach_prefix(tokens[: len(tokens) - 1])
        else:
            self.cache.truncate(common)
        self.tokens[:] = tokens[:common]
        return common

    def block_list(self, gi: int) -> np.ndarray:
        """The blocks this sequence holds in layer group gi (kept once computed: for finished sequences only)."""
        cached = getattr(self, "_blocks", None)
        if cached is None or cached[0] != self.cache.length:
            cached = (self.cache.length, [np.asarray([b for b in t if b is not None], np.int64)
                                          for t in self.cache.tables])
            self._blocks = cached
        return cached[1][gi]

    def fork(self) -> "Sequence":
        """A read-only twin holding the same KV blocks (refcounts, no copy): this sequence's history kept as a
        donor of chunks (`Engine.cache_reuse`) while this one is rewritten."""
        twin = Sequence(self.cache.fork())
        twin.tokens = list(self.tokens)
        return twin

    def truncate(self, n: int) -> None:
        """Roll back to the first n tokens (rejected speculative tokens leave the KV cache)."""
        self.cache.truncate(n)
        del self.tokens[n:]

    def close(self) -> None:
        """Give the KV blocks back to the engine's pool (they stay cached for other sequences)."""
        self.cache.release()
        self.tokens.clear()


class Engine:
    def __init__(self, path: str | Path, ctx: int | None = None, quiet: bool = False,
                 kv_type: str = parameters.KV_TYPE, backend: str = parameters.DEVICE, warm: str = "all"):
        """`backend`: where the model runs, as `--device` names it ("cpu", "opencl[:PLATFORM:DEVICE]").

        `warm`: what to compile before returning. "all": every kernel the model can use (a server's batched steps,
        embeddings, scoring run op by op). "first-token": only what one sequence's generation needs, when the
        backend has a whole-forward override (run, chat, bench): on a cold start the op-by-op kernels are most
        of the compile time (smollm2 on 2 cores: ~12 of the 16 compile items), and a one-sequence session never
        calls them; anything else compiles on its first use."""
        self.path = Path(path)
        device = backends.get(backend)  # first: its start-up work (the CPU's load probe) overlaps reading the file
        self.gguf = GGUFFile(self.path)
        meta = self.gguf.metadata
        # Every hyperparameter, tensor shape and type and the tokenizer's arrays, before any kernel sees them.
        self.config = load_model_config(self.gguf)
        self.tokenizer = Tokenizer.from_metadata(meta)
        self._template = None  # built on first use (the `template` property)
        if kv_type not in device.kv_storage().kv_types:
            raise LocalLLMError(f"KV cache type {kv_type!r} is not available on {device.name} "
                                f"(it has: {', '.join(device.kv_storage().kv_types)})")
        self.ctx = int(ctx) if ctx else min(self.config.context_length, DEFAULT_CTX)
        if self.ctx < 8:
            raise LocalLLMError(f"context size {self.ctx} is too small")
        # LongRoPE (phi3): the long factors for a context above the original one, as llama.cpp picks them
        self.config = for_context(self.config, self.ctx)
        kv_per_token = KVPool.for_model(self.config, kv_type=kv_type, storage=device.kv_storage()).bytes_per_token
        device.check_fits(sum(device.weight_bytes(t) for t in self.gguf.tensors.values()), self.ctx * kv_per_token)
        self.model = Transformer(self.gguf, self.config, device)
        from localllm.store import hub

        self.name = (hub.provenance(self.path) or {}).get("name") or self.path.stem  # a hub model: its reference
        # Idle cached blocks may keep up to one full context's worth of KV before they are recycled.
        if kv_type not in KV_TYPES:
            raise LocalLLMError(f"KV cache type {kv_type!r}: use one of {', '.join(KV_TYPES)}")
        if kv_type == "q8_0" and (self.config.head_dim % 32 or self.config.value_dim % 32):
            raise LocalLLMError(f"a q8_0 KV cache needs head sizes that are multiples of 32; this model's are "
                                f"{self.config.head_dim} and {self.config.value_dim} (use --kv-type f32)")
        self.kv_pool = self.model.new_pool(kv_type=kv_type)
        self.kv_pool.budget_bytes = self.ctx * self.kv_pool.bytes_per_token
        self.kv_type = kv_type
        self.device = backend
        self._draft_engines: dict[str, Engine] = {}
        # Chunk-level KV reuse (llama.cpp's --cache-reuse N; cache_reuse.py): chunks of at least this many tokens
        # of a new prompt are taken, shifted, from a donor sequence that holds them at other positions. 0: off,
        # every answer bitwise what a fresh forward of its prompt gives. `retain` keeps up to `retained_max`
        # finished sequences whole as donors (llama.cpp's slots keep their caches likewise).
        self.cache_reuse = 0
        self.retained_max = 1
        self.retained: list[Sequence] = []
        if warm not in ("all", "first-token"):
            raise ValueError(f"warm={warm!r}")
        calls = self.model.warm_up_calls(kv_type)
        if warm == "all" or not self.model.fused_available:
            calls = self.model.backend.warm_up_calls(self.model.weights(), kv_type=kv_type) + calls
        warm_up(calls, quiet=quiet, where=self.model.backend.device_label)

    @classmethod
    def load(cls, name_or_path: str, ctx: int | None = None, quiet: bool = False,
             kv_type: str = parameters.KV_TYPE, device: str = parameters.DEVICE, warm: str = "all") -> "Engine":
        from localllm.store import local as store

        return cls(store.resolve(name_or_path), ctx=ctx, quiet=quiet, kv_type=kv_type, backend=device, warm=warm)

    def draft_engine(self, name_or_path: str) -> "Engine":
        """A draft model for speculative decoding (loaded once, same context size and KV type)."""
        key = str(name_or_path)
        if key not in self._draft_engines:
            draft = Engine.load(key, ctx=self.ctx, quiet=True, kv_type=self.kv_type, device=self.device,
                                warm="first-token")
            check_draft_engine(self, draft)
            self._draft_engines[key] = draft
        return self._draft_engines[key]

    # ---- building blocks -------------------------------------------------------------------------------

    @property
    def template(self):
        """The model's chat template (localllm.chat.template.ChatTemplate), made on first use: importing jinja2
        took 13 ms of the 0.5 s a warm `localllm run` of smollm2 needs to its first token, which renders none."""
        if self._template is None:
            from localllm.chat.template import ChatTemplate

            self._template = ChatTemplate.from_metadata(self.gguf.metadata, model_name=self.path.stem)
        return self._template

    def new_sequence(self) -> Sequence:
        return Sequence(self.kv_pool.new_cache(self.ctx))

    # ---- chunk-level KV reuse (cache_reuse.py) ---------------------------------------------------------

    def retire(self, seq: Sequence) -> None:
        """A finished sequence: kept whole as a donor of chunks while cache reuse is on (the oldest kept one
        goes when more than `retained_max` are), else closed (its named blocks stay cached in the pool, its last
        partial block too: the next turn of its conversation starts with all of it)."""
        seq.cache.remember_tail(seq.tokens)
        if self.cache_reuse <= 0 or not seq.tokens:
            seq.close()
            return
        self.retained.append(seq)
        while len(self.retained) > self.retained_max:
            self.retained.pop(0).close()

    def retained_only_blocks(self) -> int:
        """KV blocks that only retained sequences hold (no live sequence does): what cache reuse keeps."""
        if not self.retained:
            return 0
        total = 0
        for gi, g in enumerate(self.kv_pool.groups):
            # A retained sequence's tables never change (it is finished; a donor is read through a fork), so its
            # blocks are listed once: the server publishes this after every step (~20 us, not ~0.5 ms).
            held = np.concatenate([seq.block_list(gi) for seq in self.retained])
            counts = np.bincount(held, minlength=len(g.refs))
            total += int(((counts > 0) & (g.refs == counts)).sum())
        return total

    def drop_retained(self) -> None:
        while self.retained:
            self.retained.pop().close()

    def take_donor(self, tokens: list[int], n_past: int,
                   extra: list[Sequence] = ()) -> tuple[Sequence | None, list[Splice]]:
        """The donor (a fork of a retained sequence, or one of `extra`) that lets the most of tokens[n_past:-1] be
        spliced instead of computed, and its splices; (None, []) when none has a chunk of at least `cache_reuse`
        tokens. The last prompt token is always computed (its logits). The caller closes the donor."""
        if self.cache_reuse <= 0:
            return None, []
        best, best_splices, best_n = None, [], 0
        for donor in list(extra) + self.retained[::-1]:
            splices = find_splices(tokens, n_past, len(tokens) - 1, donor.tokens[: donor.cache.length],
                                   donor.cache.held_from(), self.cache_reuse)
            n = sum(s.n for s in splices)
            if n > best_n:
                best, best_splices, best_n = donor, splices, n
        if best is not None and best in self.retained:
            # It stays retained (a keystroke's request is the best donor for the one after a ring update too);
            # the generation reads a fork of it, the most recently used one goes last.
            self.retained.remove(best)
            self.retained.append(best)
            best = best.fork()
        return best, best_splices

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.template.render(messages, add_generation_prompt=add_generation_prompt)

    def tokenize_prompt(self, prompt: str, chat: bool = False) -> list[int]:
        """Tokens for a raw prompt (BOS added as the model wants) or an already templated chat prompt (whose
        template may have written the BOS itself: never two)."""
        tokens = self.tokenizer.encode(prompt, add_special=True, parse_special=True)
        bos = self.tokenizer.bos_id
        if chat and bos is not None and len(tokens) > 1 and tokens[0] == tokens[1] == bos:
            tokens = tokens[1:]
        return tokens

    def check_fits(self, n_prompt: int, room: int = 1) -> None:
        """The prompt plus `room` tokens to generate must fit the context (scoring needs no room)."""
        if n_prompt + room > self.ctx:
            raise ContextOverflowError(
                f"the prompt is {n_prompt} tokens but the context holds {self.ctx} "
                f"(the model supports up to {self.config.context_length}; raise it with --ctx, or shorten the prompt)"
            )
        if n_prompt == 0:
            raise LocalLLMError("the prompt is empty")

    def check_tokens(self, tokens: list[int]) -> None:
        """Token ids from outside (an API's token array, a saved session) must be rows of the embedding: the
        kernels index with them."""
        n = self.config.vocab_size
        bad = next((t for t in tokens if not 0 <= t < n), None)
        if bad is not None:
            raise LocalLLMError(f"token id {bad} is not a token of this model (0..{n - 1})")

    def evaluate(self, seq: Sequence, tokens: list[int], logit_positions=None, precise: bool = False,
                 observe=None) -> np.ndarray:
        """Append `tokens` to the sequence. Returns the logits of the last token, or, with `logit_positions`
        (indices into `tokens`, ascending), a (len(logit_positions), vocab) array for those positions only.
        `precise`: float32 activations (see Transformer.forward); for scoring only. `observe`: sees every
        weight product's input (Transformer.forward_batch; importance matrices)."""
        wanted = np.asarray([len(tokens) - 1] if logit_positions is None else logit_positions, dtype=np.int64)
        outs = []
        for start in range(0, len(tokens), PROMPT_CHUNK):
            chunk = tokens[start : start + PROMPT_CHUNK]
            rows = wanted[(wanted >= start) & (wanted < start + len(chunk))] - start
            outs.append(self.model.forward(chunk, seq.cache, output_rows=rows, precise=precise, observe=observe))
            seq.tokens.extend(chunk)
            seq.cache.remember(seq.tokens)
        logits = np.concatenate(outs)
        return logits[-1] if logit_positions is None else logits

    def keep_count(self, params: GenerationParams, prompt: list[int]) -> int:
        """Tokens a context shift keeps at the start: params.n_keep (the whole prompt if < 0), and at least
        the BOS, as llama.cpp keeps it (a model that saw no BOS first drifts)."""
        n_keep = len(prompt) if params.n_keep < 0 else params.n_keep
        if prompt and self.tokenizer.bos_id is not None and prompt[0] == self.tokenizer.bos_id:
            n_keep = max(n_keep, 1)
        # The shift happens at ctx - 1 tokens and must discard at least one.
        if n_keep > self.ctx - 3:
            raise LocalLLMError(f"--keep {n_keep} leaves nothing to discard in a {self.ctx}-token context")
        return n_keep

    def shift_context(self, seq: Sequence, n_keep: int) -> None:
        """Make room as llama.cpp does: drop the older half of the tokens after the first n_keep."""
        n_discard = (len(seq.tokens) - n_keep) // 2
        self.model.shift_cache(seq.cache, n_keep, n_discard)
        del seq.tokens[n_keep : n_keep + n_discard]

    # ---- generation ------------------------------------------------------------------------------------

    def generate(self, prompt: str | list[int], params: GenerationParams | None = None,
                 seq: Sequence | None = None, chat: bool = False) -> Iterator[TokenEvent]:
        """Stream the answer to `prompt` token by token. Stopping early is not asking for the next event."""
        params = params or GenerationParams()
        tokens = self.tokenize_prompt(prompt, chat=chat) if isinstance(prompt, str) else list(prompt)
        if seq is None:
            # A one-off sequence: when generation ends (or the caller stops iterating) its blocks go back to the
            # pool, still cached for the next prompt that starts the same way.
            seq = self.new_sequence()
            try:
                yield from self.generate(tokens, params, seq)
            finally:
                seq.close()
            return
        gen = Generation(self, tokens, params, seq)
        try:
            if params.speculation is not None:
                yield from self.generate_speculative(gen)
                return
            logits = gen.prefill()
            while True:
                event = gen.step(logits)
                if event.finish_reason is None:
                    logits = self.evaluate(seq, [event.token])
                gen.record(event)
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            gen.release_donor()  # a prefill that failed midway still gives the donor's blocks back

    def generate_speculative(self, gen: "Generation") -> Iterator[TokenEvent]:
        """generate() with speculative decoding: each round is one forward that verifies a draft and hands out
        every token it accepted (speculative.py). A scheduler drives a `speculative_run` itself instead, its
        verifies part of its batched forwards."""
        run = self.speculative_run(gen)
        try:
            run.start()
            while True:
                for event in run.round():
                    yield event
                    if event.finish_reason is not None:
                        return
        finally:
            run.close()

    def speculative_run(self, gen: "Generation") -> SpeculativeRun:
        """The speculative decoding of `gen` (its params.speculation), with its drafter (a draft model is
        loaded on first use)."""
        spec = gen.params.speculation.validated()
        return SpeculativeRun(gen, spec, make_drafter(self, spec, gen.sampler.seed))

    def evaluate_batch(self, items: list[tuple]) -> list[np.ndarray]:
        """Append tokens to several sequences in one forward (each weight read once for all of them). Items are
        (seq, tokens), whose result is the last token's logits, or (seq, tokens, logit_positions) (indices into
        tokens, ascending: a speculative verify's draft), whose result is a (len(logit_positions), vocab) array.
        Each sequence's result is bitwise what `evaluate` alone gives it (batch invariance: an answer never
        depends on which other requests share its step)."""
        segments, wanted, heads = [], [], []
        for seq, tokens, *rest in items:
            positions = np.asarray(rest[0] if rest else [len(tokens) - 1], dtype=np.int64)
            head = None
            if len(tokens) > PROMPT_CHUNK:  # a long prompt goes ahead alone, its last chunk joins the batch
                cut = (len(tokens) - 1) // PROMPT_CHUNK * PROMPT_CHUNK
                head = self.evaluate(seq, tokens[:cut], logit_positions=positions[positions < cut])
                tokens, positions = tokens[cut:], positions[positions >= cut] - cut
            segments.append((tokens, seq.cache, positions if rest else None))
            wanted.append(bool(rest))
            heads.append(head)
        logits = self.model.forward_batch(segments)
        out = []
        for (seq, *_), (tokens, _, _), rows, full, head in zip(items, segments, logits, wanted, heads):
            seq.tokens.extend(tokens)
            seq.cache.remember(seq.tokens)
            if not full:
                out.append(rows[0])
            else:
                out.append(rows if head is None or not len(head) else np.concatenate([head, rows]))
        return out

    # ---- scoring ---------------------------------------------------------------------------------------

    @property
    def pooling(self) -> str:
        """How `embed` pools a text's hidden states: the file's `{arch}.pooling_type` (llama.cpp's enum: 1 mean,
        2 cls, 3 last) where it names one, else "mean" (decoder models carry none; see POOLING_DEFAULT)."""
        value = self.gguf.get(f"{self.config.architecture}.pooling_type")
        return POOLING_TYPES.get(value, POOLING_DEFAULT) if isinstance(value, int) else POOLING_DEFAULT

    def embed(self, texts: list[list[int]], pooling: str | None = None, normalize: bool = True) -> np.ndarray:
        """One vector (n_embd,) per text (token lists, BOS included as tokenize_prompt gives it): the final
        hidden states after the output norm, pooled (mean over the text's tokens, its first token's (cls) or its
        last's), L2-normalized unless `normalize` is False (llama.cpp's embd_normalize 2 and -1). Texts are
        evaluated several per forward (up to PROMPT_CHUNK tokens); every kernel computes each row alone, so a
        text's vector is bitwise the same alone or in any batch. Each text must fit the context."""
        pooling = pooling or self.pooling
        if pooling not in ("mean", "cls", "last"):
            raise LocalLLMError(f"pooling {pooling!r}: use mean, cls or last")
        for tokens in texts:
            self.check_fits(len(tokens), room=0)
            self.check_tokens(tokens)
        out = np.empty((len(texts), self.config.n_embd), np.float32)

        def rows_of(n: int) -> np.ndarray:
            return np.arange(n) if pooling == "mean" else np.array([0 if pooling == "cls" else n - 1])

        def pooled(h: np.ndarray) -> np.ndarray:
            v = h.astype(np.float64).mean(axis=0) if pooling == "mean" else h[0].astype(np.float64)
            if normalize:
                norm = np.sqrt(np.sum(v * v))
                v = v / norm if norm > 0 else v
            return v.astype(np.float32)

        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        batch: list[int] = []

        def flush() -> None:
            seqs = [self.new_sequence() for _ in batch]
            try:
                segments = [(texts[i], seq.cache, rows_of(len(texts[i]))) for i, seq in zip(batch, seqs)]
                for i, h in zip(batch, self.model.forward_batch(segments, hidden=True)):
                    out[i] = pooled(h)
            finally:
                for seq in seqs:
                    seq.close()
            batch.clear()

        for i in order:
            n = len(texts[i])
            if n > PROMPT_CHUNK:  # alone, in chunks: attention-score memory stays bounded
                seq = self.new_sequence()
                try:
                    parts = []
                    for start in range(0, n, PROMPT_CHUNK):
                        chunk = texts[i][start:start + PROMPT_CHUNK]
                        rows = rows_of(n) - start
                        rows = rows[(rows >= 0) & (rows < len(chunk))]
                        parts.append(self.model.forward_batch([(chunk, seq.cache, rows)], hidden=True)[0])
                    out[i] = pooled(np.concatenate(parts))
                finally:
                    seq.close()
                continue
            if batch and sum(len(texts[j]) for j in batch) + n > PROMPT_CHUNK:
                flush()
            batch.append(i)
        if batch:
            flush()
        return out

    def log_probs(self, tokens: list[int], positions=None, precise: bool = True) -> np.ndarray:
        """Teacher forcing (scoring, perplexity): log-softmax of the logits at `positions` of `tokens` (default:
        all), from an empty cache. Scoring has no batch to be invariant to, so it takes float32 activations by
        default, the closer estimate of the model's own distribution (98% top-1 agreement with llama.cpp on
        smollm2 where 8-bit activations give 96.5%: its disagreements are near-ties either way);
        `precise=False` scores exactly as generation computes (8-bit activations)."""
        self.check_fits(len(tokens), room=0)
        positions = np.arange(len(tokens)) if positions is None else positions
        seq = self.new_sequence()
        try:
            logits = self.evaluate(seq, tokens, logit_positions=positions, precise=precise)
        finally:
            seq.close()
        logits -= logits.max(axis=1, keepdims=True)
        logits -= np.log(np.exp(logits).sum(axis=1, keepdims=True))
        return logits


class Generation:
    """One answer being generated: its sampler, detokenizer, stop strings, context handling and timings.

    `Engine.generate()` drives one; the server's scheduler drives many, batching their forwards with
    `Engine.evaluate_batch`. The protocol: `logits = gen.prefill()`, then repeatedly `event = gen.step(logits)`;
    unless `event.finish_reason` is set, evaluate `[event.token]` on `gen.seq` to get the next logits, then
    `gen.record(event)` (after the forward, so a token's time includes it) and hand the event out.
    """

    def __init__(self, engine: Engine, tokens: list[int], params: GenerationParams, seq: Sequence):
        engine.check_fits(len(tokens))
        engine.check_tokens(tokens)
        if params.context_overflow not in ("stop", "shift"):
            raise LocalLLMError(f"context overflow {params.context_overflow!r}: use 'stop' or 'shift'")
        self.shift = params.context_overflow == "shift"
        if self.shift and not engine.model.can_shift:
            raise LocalLLMError(f"{engine.name} has sliding-window layers, which keep only their window: a context "
                                "shift cannot keep the first tokens there (use --context-overflow stop)")
        self.engine, self.tokens, self.params, self.seq = engine, tokens, params, seq
        self.n_keep = engine.keep_count(params, tokens) if self.shift else 0
        self.timings = Timings()
        self.sampler = Sampler(params.sampling, engine.config.vocab_size, vocab=engine.tokenizer,
                               grammar=params.grammar)
        self.decoder = engine.tokenizer.stream_decoder()
        self.stops = StopMatcher(params.stop)
        # No max_tokens: until the context is full, or, when shifting, until the model stops (as llama.cpp's -n -1).
        self.limit = params.max_tokens if params.max_tokens is not None else (
            float("inf") if self.shift else engine.ctx)
        self.finish_reason: str | None = None
        self._t_gen = self._t_tok = 0.0
        self.donor: Sequence | None = None  # chunk-level KV reuse: where spliced chunks come from (start_prefill)
        self.splices: list[Splice] = []

    def prefill(self) -> np.ndarray:
        """Reuse the cached prefix, evaluate the rest of the prompt; returns the last prompt token's logits."""
        t0 = time.perf_counter()
        logits = self.read_prompt()
        self.end_prefill()
        self.timings.prompt_ms = 1000 * (time.perf_counter() - t0)
        return logits

    def read_prompt(self) -> np.ndarray:
        """`start_prefill`, then its tokens evaluated (and chunks spliced) on this sequence alone; returns the
        last prompt token's logits."""
        left = self.start_prefill()
        while True:
            left = left[self.splice_due() :]
            n = min(len(left), self.until_splice())
            logits = self.engine.evaluate(self.seq, left[:n])
            left = left[n:]
            if not left:
                return logits

    def start_prefill(self) -> list[int]:
        """The prompt tokens after the longest cached prefix (for callers that batch the prompt's forward
        themselves; `prefill()` does it all). With the engine's cache reuse on, some of them may be spliced
        from a donor instead: before each forward call `splice_due()` (then drop that many tokens from the
        front) and evaluate at most `until_splice()` tokens."""
        own = self.seq.fork() if self.engine.cache_reuse > 0 and self.seq.tokens else None
        self.timings.cache_n = self.seq.reuse_prefix(self.tokens)
        self.donor, self.splices = self.engine.take_donor(self.tokens, self.timings.cache_n,
                                                          [own] if own is not None else [])
        if own is not None and own is not self.donor:
            own.close()
        if self.donor is None:
            self.splices = []
        spliced = sum(s.n for s in self.splices)
        new = self.tokens[self.timings.cache_n :]
        self.timings.cache_n += spliced  # as llama.cpp counts a reused chunk: cached, not processed
        self.timings.prompt_n = len(new) - spliced
        return new

    def splice_due(self) -> int:
        """Splice in the donor's chunks that start where the sequence now ends; how many tokens they hold."""
        done = 0
        while self.splices and self.splices[0].dst == len(self.seq.tokens):
            s = self.splices.pop(0)
            self.seq.cache.splice(self.donor.cache, s.src, s.n, self.engine.model.rotate_keys)
            self.seq.tokens.extend(self.tokens[s.dst : s.dst + s.n])
            done += s.n
        if not self.splices:
            self.release_donor()
        return done

    def until_splice(self) -> int | float:
        """Tokens to evaluate before the next chunk is spliced in."""
        return self.splices[0].dst - len(self.seq.tokens) if self.splices else float("inf")

    def release_donor(self) -> None:
        """Give back the donor's blocks (prefill done, or the request ended early)."""
        if self.donor is not None:
            self.donor.close()
            self.donor, self.splices = None, []

    def end_prefill(self) -> None:
        # As llama.cpp's server does: the prompt counts for repetition penalties.
        self.release_donor()
        self.sampler.accept_prompt(self.tokens)
        self._t_gen = time.perf_counter()

    def step(self, logits: np.ndarray, token: int | None = None, n_past: int | None = None) -> TokenEvent:
        """Pick the next token from `logits`; decide whether generation ends here. Speculative decoding may
        give the `token` its acceptance rule chose, and `n_past`, the tokens before this one (the sequence then
        still holds draft tokens after it)."""
        self._t_tok = time.perf_counter()
        picked = self.sampler.sample(logits, token=token)
        self.sampler.accept(picked.id)
        finish = None
        # With a grammar, an end-of-generation token is where the grammar ended: nothing may follow, ignore_eos or not.
        if self.engine.tokenizer.is_eog(picked.id) and (not self.params.ignore_eos or self.params.grammar is not None):
            text, finish = self.decoder.flush(), "stop"
        else:
            text = self.decoder.feed(picked.id)
        text, stopped = self.stops.feed(text)
        if stopped:
            finish = "stop"
        self.timings.predicted_n += 1
        if finish is None and self.timings.predicted_n >= self.limit:
            finish = "length"
        t_max = self.params.t_max_predict_ms
        if (finish is None and t_max is not None and t_max > 0 and "\n" in text
                and 1000 * (time.perf_counter() - self._t_gen) > t_max):
            finish = "length"
        if finish is None and (len(self.seq.tokens) if n_past is None else n_past) + 1 >= self.engine.ctx:
            # The context is full (as llama.cpp's server decides it): this token is the last that fits.
            if self.shift:
                self.engine.shift_context(self.seq, self.n_keep)
                self.timings.n_shifts += 1
            else:
                finish = "length"
        if finish is not None and not stopped:
            # Release what was held back: a partial character (at "length") and a possible stop-string start.
            tail, stopped = self.stops.feed(self.decoder.flush() if finish == "length" else "")
            text += tail + ("" if stopped else self.stops.flush())
        self.finish_reason = finish
        return TokenEvent(picked.id, text, picked.logprob, picked.top_logprobs, finish, self.timings)

    def record(self, event: TokenEvent) -> None:
        """Account the token's wall time (sampling, and the forward that followed it)."""
        now = time.perf_counter()
        self.timings.token_ms.append(1000 * (now - self._t_tok))
        self.timings.predicted_ms = 1000 * (now - self._t_gen)
