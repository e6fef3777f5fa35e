"""Speculative decoding for batch-1 latency: guess a few tokens cheaply, check them all in one forward of the
target model, keep the ones the target agrees with. Lossless: the output is exactly what plain decoding gives
(greedy: token for token) or follows exactly the target's distribution (sampling).

Pieces, each small:

* Drafters (one interface, `draft(context, k, sampler) -> Draft`):
  - `NGramDrafter`: prompt lookup. A dict from every n-gram (n = 2..5) of the token history to the position
    after its latest occurrence, updated incrementally as tokens arrive; the draft is what followed the longest
    n-gram that ends the context. No model, about 10 µs a draft. Its draft is a point mass (q = 1).
  - `DraftModelDrafter`: a smaller model with the same vocabulary (qwen2.5-coder-0.5b for -1.5b) and its own
    KV cache, kept in step with the target's by its common prefix (rejected tokens are rolled back, the tokens
    the target chose instead are evaluated in the next draft's first forward). Its draft carries q.
* `accept_token`: the acceptance rule. Greedy: the target's own pick (the sampler's argmax) must equal the
  draft token. Sampling: accept draft d with probability min(1, p(d)/q(d)), else draw from (p - q)+ normalized,
  which leaves every emitted token distributed exactly as p (Leviathan et al. 2023, Chen et al. 2023).
* `Controller`: the adaptive draft length. It measures the per-token acceptance rate a (an exponential
  average per draft kind, for the n-gram drafter per matched length, with a free "shadow" measurement while
  speculation is off: would its guess have been the token that came?) and the wall time of a verify of n tokens (a line a + b (n - 1), fitted with
  forgetting), plus the drafter's own time per drafted token. It picks the k in 0..draft_max maximizing
  expected tokens per second, (1 - a^(k+1)) / (1 - a) / (verify(k + 1) + k draft_step); k = 0 is plain
  decoding, so speculation switches itself off where it cannot pay.
* `SpeculativeRun`: drives a `Generation` (engine.py) round by round. A round evaluates the pending token and
  k draft tokens in one forward (logits for every position), walks the draft with `Generation.step` (so the
  sampler's history, the detokenizer, stop strings, max_tokens, EOS and the context limit act exactly as in
  plain decoding), truncates the KV cache to what was accepted, and returns the round's events. In draft-model
  mode each round also looks the context up (free) and verifies that draft instead when the controller expects
  more tokens per second of it (a long copy); `SpeculationParams.lookup=False` keeps to the model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np

from localllm.errors import LocalLLMError

MODES = ("ngram", "draft")


@dataclass
class SpeculationParams:
    mode: str = "ngram"  # "ngram" (prompt lookup) or "draft" (a draft model)
    draft_model: str | None = None  # catalog name or .gguf path, for mode "draft"
    draft_max: int = 8  # most tokens drafted per verify
    adaptive: bool = True  # False: always draft draft_max tokens (tests, measurements)
    # With a draft model: also look the context up in the text so far (free), and verify that draft instead
    # when its measured acceptance makes it the better bet (a long copy). Only when adaptive.
    lookup: bool = True
    ngram_max: int = 5
    ngram_min: int = 2

    def validated(self) -> "SpeculationParams":
        if self.mode not in MODES:
            raise LocalLLMError(f"speculation {self.mode!r}: use one of {', '.join(MODES)}")
        if self.mode == "draft" and not self.draft_model:
            raise LocalLLMError("speculation with a draft model needs --draft-model MODEL")
        if not 1 <= self.draft_max <= 32:
            raise LocalLLMError(f"--draft-max must be in 1..32, got {self.draft_max}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise LocalLLMError("n-gram sizes: need 1 <= ngram_min <= ngram_max")
        return self


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    # Per token, the distribution it was drawn from as (ids, probs), or None for a point mass (q(d) = 1).
    q: list[tuple[np.ndarray, np.ndarray] | None] = field(default_factory=list)
    kind: int = 0  # what the controller keeps a separate acceptance rate for (n-gram: the matched length)

    def cut(self, k: int) -> "Draft":
        return Draft(self.tokens[:k], self.q[:k], self.kind)


# ---- drafters ----------------------------------------------------------------------------------------------


class NGramDrafter:
    """Prompt lookup: drafts are copied from what followed the latest earlier occurrence of the context's last
    n tokens (longest n first) in the history (prompt and generated text). While the text goes on copying one
    place (an edited file, a quoted passage), the draft goes on from where the last one was copied, as long as
    the context agrees with that place over at least as many tokens as a fresh lookup matches: a line that
    repeats earlier in the copy does not send the draft there."""

    MAX_AGREE = 16

    free = True  # drafting costs next to nothing: the controller may shadow-draft while speculation is off
    prior_rate = 0.6  # acceptance assumed before any is measured

    def __init__(self, n_max: int = 5, n_min: int = 2):
        self.n_max, self.n_min = n_max, n_min
        self.history: list[int] = []
        self.index: dict[tuple, int] = {}  # n-gram -> position right after its latest occurrence
        self._indexed = 0  # n-grams ending before this position are indexed (their continuation exists)
        self._source: tuple[int, int] | None = None  # (position the last draft was copied from, history length then)

    def prefill(self, tokens: list[int]) -> None:
        self.history, self.index, self._indexed, self._source = [], {}, 0, None
        self._extend(tokens)

    def _follow(self) -> tuple[int, int]:
        """Where the last draft's source continues now, and over how many tokens it agrees with the context."""
        if self._source is None:
            return 0, 0
        h, (pos, length) = self.history, self._source
        at = pos + len(h) - length
        m = 0
        while m < self.MAX_AGREE and m < at < len(h) and h[at - 1 - m] == h[len(h) - 1 - m]:
            m += 1
        return at, m

    def _longest(self, context: list[int]) -> int:
        for n in range(min(self.n_max, len(context)), self.n_min - 1, -1):
            if tuple(context[-n:]) in self.index:
                return n
        return 0

    def _extend(self, context: list[int]) -> None:
        """The history only grows (rejected drafts never enter it); take the new tail of `context`."""
        h = self.history
        if len(context) < len(h) or context[: len(h)][-self.n_max :] != h[-self.n_max :]:
            h[:] = []  # a different history (a context shift or a new prompt): start over
            self.index, self._indexed, self._source = {}, 0, None
        h.extend(context[len(h) :])
        # Index the n-grams that end at positions _indexed .. len - 2 (each has a next token to draft).
        for end in range(self._indexed + 1, len(h)):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.index[tuple(h[end - n : end])] = end
        self._indexed = max(self._indexed, len(h) - 1)

    def lookup(self, context: list[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens, and the length of the first match (0: none). A continuation that runs into the end
        of the history is extended by looking up again."""
        h, out, first = self.history, [], 0
        at, agree = self._follow()
        if agree >= self.n_min and agree >= self._longest(context):
            out, first = h[at : at + k], agree
            self._source = (at, len(h))
        while len(out) < k:
            tail = context + out if out else context
            for n in range(min(self.n_max, len(tail)), self.n_min - 1, -1):
                pos = self.index.get(tuple(tail[-n:]))
                if pos is not None:
                    if not out:
                        self._source = (pos, len(h))
                    out += h[pos : pos + k - len(out)]
                    first = first or n
                    break
            else:
                break
        return out, first

    def draft(self, context: list[int], k: int, sampler=None) -> Draft:
        self._extend(context)
        tokens, matched = self.lookup(context, k)
        return Draft(tokens, [None] * len(tokens), kind=matched)

    def close(self) -> None:
        pass


class DraftModelDrafter:
    """A smaller model with the target's vocabulary drafts autoregressively with the target's sampler settings
    (greedy: its argmax; sampling: a draw from its own final distribution, which is the q of the acceptance
    rule). Its sequence follows the target's context by their common prefix."""

    free = False
    prior_rate = 0.8  # a smaller model of the same family agrees with the target most of the time

    def __init__(self, engine, seed: int = 0, temperature: float | None = None):
        self.engine = engine
        self.catchup_seconds = 0.0  # time the last draft spent catching up with tokens beyond the usual one or two
        self.seq = engine.new_sequence()
        self.rng = np.random.Generator(np.random.PCG64([seed, 1]))
        self.temperature = temperature  # drafting temperature when sampling (None: the target's)

    def prefill(self, tokens: list[int]) -> None:
        self.seq.reuse_prefix(tokens)  # the draft model's KV pool caches prompts as the target's does
        self._sync(tokens)

    def _sync(self, context: list[int]) -> np.ndarray | None:
        """Make the draft sequence hold `context`; return the last position's logits when it evaluated some."""
        seq, have = self.seq, self.seq.tokens
        common, limit = 0, min(len(have), len(context))
        if limit and have[:limit] == context[:limit]:
            common = limit
        else:
            while common < limit and have[common] == context[common]:
                common += 1
        if common == len(context):  # nothing new to evaluate: step back one token to get its logits
            common -= 1
        if common < len(have):
            seq.cache.truncate(common)
            del have[common:]
        if common < len(context):
            t0 = time.perf_counter()
            logits = self.engine.evaluate(seq, context[common:])
            # After speculation was off a while, the draft model evaluates what it missed: not a per-token cost.
            self.catchup_seconds = time.perf_counter() - t0 if len(context) - common > 2 else 0.0
            return logits
        self.catchup_seconds = 0.0
        return None

    def draft(self, context: list[int], k: int, sampler) -> Draft:
        out = Draft()
        if k <= 0:
            return out
        logits = self._sync(context)
        greedy = sampler.params.greedy
        local = sampler.clone()  # the target's penalty history, extended by the draft tokens
        if self.temperature is not None and not greedy:
            local.params = replace(local.params, temperature=self.temperature)
        for i in range(k):
            if greedy:
                d = local.sample(logits).id
                out.q.append(None)
            else:
                ids, probs = local.distribution(logits)
                d = int(ids[_draw(probs, self.rng)])
                out.q.append((ids, probs))
            out.tokens.append(d)
            local.accept(d)
            if i + 1 < k:
                logits = self.engine.evaluate(self.seq, [d])
        return out

    def close(self) -> None:
        self.seq.close()


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    cum = np.cumsum(probs)
    return min(int(np.searchsorted(cum, rng.random() * cum[-1], side="right")), len(probs) - 1)


# ---- the acceptance rule -----------------------------------------------------------------------------------


def accept_token(p: tuple[np.ndarray, np.ndarray], d: int, q: tuple[np.ndarray, np.ndarray] | None,
                 rng: np.random.Generator) -> tuple[int, bool]:
    """Speculative sampling for one position: the target's final distribution p = (ids, probs), the draft token
    d drawn from q = (ids, probs) (None: a point mass on d). Returns (token, accepted): d with probability
    min(1, p(d)/q(d)), else a draw from the residual max(p - q, 0) normalized. The token is distributed as p."""
    p_ids, p_probs = p
    where = np.flatnonzero(p_ids == d)
    p_d = float(p_probs[where[0]]) if where.size else 0.0
    if q is None:
        q_d = 1.0
    else:
        qw = np.flatnonzero(q[0] == d)
        q_d = float(q[1][qw[0]]) if qw.size else 0.0
    if q_d > 0 and rng.random() * q_d < p_d:  # u < p/q, without dividing
        return d, True
    residual = p_probs.copy()
    if q is None:
        if where.size:
            residual[where[0]] = 0.0
    else:
        q_on_p = np.zeros(len(p_ids))
        order = np.argsort(q[0])
        pos = np.searchsorted(q[0], p_ids, sorter=order)
        pos = np.minimum(pos, len(order) - 1)
        hit = q[0][order[pos]] == p_ids
        q_on_p[hit] = q[1][order[pos[hit]]]
        residual = np.maximum(residual - q_on_p, 0.0)
    total = residual.sum()
    if total <= 0:  # p == q up to rounding: the rejection had probability ~0; p itself is the right law
        residual, total = p_probs, p_probs.sum()
    return int(p_ids[_draw(residual / total, rng)]), False


# ---- the adaptive draft length -----------------------------------------------------------------------------


class Controller:
    """Chooses k, the tokens to draft for the next verify, from measured acceptance and measured costs.
    Acceptance is kept per draft kind: an n-gram draft from a 5-token match is right far more often than one
    from a 2-token match, so each match length gets its own rate (and its own draft length)."""

    DECAY = 0.95  # forgetting per observation
    PRIOR_SLOPE = 0.35  # verify(n) / verify(1) - 1 per extra token, before two sizes were measured

    def __init__(self, draft_max: int, adaptive: bool = True, free_drafts: bool = True, prior_rate: float = 0.6):
        self.draft_max, self.adaptive, self.free_drafts = draft_max, adaptive, free_drafts
        self.prior_rate = prior_rate
        self.rates: dict[int, float] = {}  # acceptance rate per draft kind
        self._fit = np.zeros(5)  # forgetting sums for the fit of verify time on n: w, w n, w n^2, w t, w n t
        self.draft_step = 0.0  # seconds per drafted token (EWMA)
        self.off_rounds = 0
        self.fruitless_probes = 0  # probes after which speculation stayed off
        self._probed = False

    def accept_rate(self, kind: int = 0) -> float:
        return self.rates.get(kind, self.prior_rate)  # optimistic start: speculation is tried, then measured

    def observe_acceptance(self, drafted: int, accepted: int, kind: int = 0) -> None:
        """`drafted` tokens were checked and the first `accepted` of them kept."""
        seen = min(drafted, accepted + 1)  # tokens after the first rejection were never tested
        a = self.accept_rate(kind)
        for i in range(seen):
            a = self.DECAY * a + (1 - self.DECAY) * (1.0 if i < accepted else 0.0)
        self.rates[kind] = a

    def observe_verify(self, n: int, seconds: float) -> None:
        self._fit = self.DECAY * self._fit + np.array([1.0, n, n * n, seconds, n * seconds])

    def observe_draft(self, k: int, seconds: float) -> None:
        if k > 0:
            per = seconds / k
            self.draft_step = per if self.draft_step == 0 else 0.8 * self.draft_step + 0.2 * per

    def verify_cost(self, n: int) -> float:
        w, sn, snn, st, snt = self._fit
        if w == 0:
            return 1.0 + self.PRIOR_SLOPE * (n - 1)
        var = snn / w - (sn / w) ** 2
        if var < 0.05:  # one size measured so far: its mean, with the prior slope
            base = st / w / (1 + self.PRIOR_SLOPE * (sn / w - 1))
            return base * (1 + self.PRIOR_SLOPE * (n - 1))
        slope = max((snt / w - sn / w * st / w) / var, 0.0)
        mean_n, mean_t = sn / w, st / w
        return max(mean_t + slope * (n - mean_n), 1e-6)

    def expected_rate(self, k: int, kind: int = 0, free: bool = False) -> float:
        """Expected tokens per second of a verify with k drafted tokens (in units of the measured costs)."""
        a = min(self.accept_rate(kind), 0.999)
        tokens = (1 - a ** (k + 1)) / (1 - a)
        return tokens / (self.verify_cost(k + 1) + (0.0 if free else k * self.draft_step))

    def choose(self, limit: int, kind: int = 0, free: bool = False) -> int:
        limit = min(limit, self.draft_max)
        if limit <= 0:
            return 0
        if not self.adaptive:
            return limit
        k = max(range(limit + 1), key=lambda k: self.expected_rate(k, kind, free))
        if not (free or self.free_drafts):
            if self._probed:
                self.fruitless_probes = self.fruitless_probes + 1 if k == 0 else 0
                self._probed = False
            # A draft model's acceptance cannot be measured for free: probe with two tokens now and then. Each
            # probe first makes the draft model catch up with every token it missed, which costs about as much
            # as drafting them would have: after three probes that did not turn speculation back on, stop.
            if k == 0 and self.fruitless_probes < 3:
                self.off_rounds += 1
                if self.off_rounds % 8 == 0:
                    self._probed = True
                    return min(2, limit)
        return k


# ---- driving a Generation ----------------------------------------------------------------------------------


class SpeculativeRun:
    """Speculative decoding of one `Generation` (see engine.py): `start()` after the prompt, then `round()`
    until an event carries a finish reason. Each round is one forward of the target."""

    def __init__(self, gen, spec: SpeculationParams, drafter):
        self.gen, self.spec, self.drafter = gen, spec, drafter
        self.engine, self.seq = gen.engine, gen.seq
        self.greedy = gen.params.sampling.greedy
        self.rng = np.random.Generator(np.random.PCG64([gen.sampler.seed, 2]))
        self.controller = Controller(spec.draft_max, spec.adaptive, drafter.free, drafter.prior_rate)
        self.pending = None  # the event whose token is chosen but not yet evaluated (nor handed out)
        self.lookup = (NGramDrafter(spec.ngram_max, spec.ngram_min)
                       if not drafter.free and spec.lookup and spec.adaptive else None)
        self.history: list[int] = []  # prompt and every token handed out (the n-gram drafter's text)

    def start(self) -> None:
        """Prompt processing for the target and the drafter; picks the first token."""
        gen = self.gen
        t0 = time.perf_counter()
        new = gen.start_prefill()
        logits = self.engine.evaluate(self.seq, new)
        self.drafter.prefill(gen.tokens)
        if self.lookup is not None:
            self.lookup.prefill(gen.tokens)
        gen.end_prefill()
        gen.timings.prompt_ms = 1000 * (time.perf_counter() - t0)
        self.history = list(gen.tokens)
        self.pending = gen.step(logits)

    def round(self) -> list:
        gen, seq, ctl, timings = self.gen, self.seq, self.controller, self.gen.timings
        event = self.pending
        if event.finish_reason is not None:
            gen.record(event)
            return [event]
        s, base = event.token, len(seq.tokens)
        context = self.history + [s]
        # Never draft past max_tokens, nor so far that the context limit (a shift, or "length") would fall inside
        # the draft: there, k = 0 is exactly plain decoding.
        room = min(gen.limit - timings.predicted_n, self.engine.ctx - base - 3)
        limit = int(min(room, self.spec.draft_max))
        shadow = None  # (a draft token not verified, its kind): would it have been right? Measured for free
        t0 = time.perf_counter()
        if self.drafter.free:  # look first (it costs nothing), then decide how much of it to verify
            draft = self.drafter.draft(context, limit) if limit > 0 else Draft()
            k = ctl.choose(len(draft.tokens), draft.kind)
            if k == 0 and draft.tokens:
                shadow = draft.tokens[0], draft.kind
            draft = draft.cut(k)
        else:
            k = ctl.choose(limit)
            draft = None
            if self.lookup is not None and limit > 0:
                found = self.lookup.draft(context, limit)
                if found.tokens:
                    k_found = ctl.choose(len(found.tokens), found.kind, free=True)
                    if k_found and ctl.expected_rate(k_found, found.kind, True) >= ctl.expected_rate(k):
                        draft = found.cut(k_found)
                    else:
                        shadow = found.tokens[0], found.kind
            if draft is None:
                draft = self.drafter.draft(seq.tokens + [s], k, gen.sampler) if k > 0 else Draft()
                ctl.observe_draft(len(draft.tokens),
                                  time.perf_counter() - t0 - getattr(self.drafter, "catchup_seconds", 0.0))
        t1 = time.perf_counter()
        n = len(draft.tokens) + 1
        rows = self.engine.evaluate(seq, [s] + draft.tokens, logit_positions=range(n))
        ctl.observe_verify(n, time.perf_counter() - t1)
        gen.record(event)
        out = [event]
        self.history.append(s)
        accepted = 0
        for i, d in enumerate(draft.tokens):
            n_past = base + 1 + i
            if self.greedy:
                nxt = gen.step(rows[i], n_past=n_past)
                ok = nxt.token == d
            else:
                token, ok = accept_token(gen.sampler.distribution(rows[i]), d, draft.q[i], self.rng)
                nxt = gen.step(rows[i], token=token, n_past=n_past)
            if ok:
                accepted += 1
            if not ok or nxt.finish_reason is not None:
                seq.truncate(n_past)  # d and every draft token after it leave the KV cache
                self.pending = nxt
                break
            gen.record(nxt)
            out.append(nxt)
            self.history.append(d)
        else:
            self.pending = gen.step(rows[n - 1])
        if draft.tokens:
            timings.draft_n += len(draft.tokens)
            timings.draft_n_accepted += accepted
            timings.n_verifies += 1
            ctl.observe_acceptance(len(draft.tokens), accepted, draft.kind)
        if shadow is not None:
            came = out[1].token if len(out) > 1 else self.pending.token
            ctl.observe_acceptance(1, int(came == shadow[0]), shadow[1])
        return out

    def close(self) -> None:
        self.drafter.close()


def make_drafter(engine, spec: SpeculationParams, seed: int):
    if spec.mode == "ngram":
        return NGramDrafter(spec.ngram_max, spec.ngram_min)
    draft_engine = engine.draft_engine(spec.draft_model)
    return DraftModelDrafter(draft_engine, seed)


def check_draft_engine(target, draft) -> None:
    """A draft model must speak the target's vocabulary: same size, same token pieces."""
    tv, dv = target.tokenizer, draft.tokenizer
    if target.config.vocab_size != draft.config.vocab_size:
        raise LocalLLMError(f"draft model {draft.name} has a vocabulary of {draft.config.vocab_size} tokens, "
                            f"{target.name} has {target.config.vocab_size}: a draft model must share the vocabulary")
    n = target.config.vocab_size
    if any(tv.piece_bytes(t) != dv.piece_bytes(t) for t in range(0, n, max(1, n // 512))):
        raise LocalLLMError(f"draft model {draft.name} tokenizes differently from {target.name}")


__all__ = ["SpeculationParams", "Draft", "NGramDrafter", "DraftModelDrafter", "accept_token", "Controller",
           "SpeculativeRun", "make_drafter", "check_draft_engine", "MODES"]
