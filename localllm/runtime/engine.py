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
from localllm.runtime.generation import PROMPT_CHUNK, Driver, Generation, GenerationParams, Run, TokenEvent
from localllm.runtime.speculative import SpeculativeRun, check_draft_engine, make_drafter
from localllm.tokenizer import Tokenizer
from localllm.runtime.warmup import warm_up
from localllm.kernels.top_logits import TopLogits

DEFAULT_CTX = 4096
# llama.cpp's LLAMA_POOLING_TYPE_* values a GGUF may carry in {arch}.pooling_type (0 none and 4 rank are not
# sentence embeddings: they fall back to the default).
POOLING_TYPES = {1: "mean", 2: "cls", 3: "last"}
# Decoder models carry no pooling type. Mean over the text's tokens, measured on the four catalog models (tests/
# test_embeddings.py): related sentences score above unrelated ones with mean pooling on all four.
POOLING_DEFAULT = "mean"


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
        """Stream the answer to `prompt` token by token: the one generation driver (generation.py) with this one
        run, so an answer here is bitwise the one the server's batched steps give it. Stopping early is not
        asking for the next event. max_tokens 0 (llama.cpp's -n 0): the prompt is read into the cache, and one
        final event without a token says so."""
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
        run = Run(self, tokens, params, seq)
        try:
            yield from Driver(self).run_alone(run)
            if params.max_tokens == 0:
                yield TokenEvent(None, "", finish_reason="length", timings=run.gen.timings)
        finally:
            run.close()  # a prompt that failed midway still gives the donor's blocks back

    def speculative_run(self, gen: Generation) -> SpeculativeRun:
        """The speculative decoding of `gen` (its params.speculation), with its drafter (a draft model is
        loaded on first use)."""
        spec = gen.params.speculation.validated()
        return SpeculativeRun(gen, spec, make_drafter(self, spec, gen.sampler.seed))

    def evaluate_batch(self, items: list[tuple], tops: list[int] | None = None) -> list:
        """Append tokens to several sequences in one forward (each weight read once for all of them). Items are
        (seq, tokens), whose result is the last token's logits, or (seq, tokens, logit_positions) (indices into
        tokens, ascending: a speculative verify's draft), whose result is a (len(logit_positions), vocab) array.
        Each sequence's result is bitwise what `evaluate` alone gives it (batch invariance: an answer never
        depends on which other requests share its step). `tops`: per item, 0 or the top k its sampler needs
        (Transformer.forward_batch's `top`): that item's result may then be a TopLogits."""
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
        logits = self.model.forward_batch(segments, top=tops)
        out = []
        for (seq, *_), (tokens, _, _), rows, full, head in zip(items, segments, logits, wanted, heads):
            seq.tokens.extend(tokens)
            seq.cache.remember(seq.tokens)
            if isinstance(rows, TopLogits):
                out.append(rows)
            elif not full:
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

