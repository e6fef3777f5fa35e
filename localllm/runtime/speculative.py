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
* `Controller`: the adaptive draft length. It measures the per-token acceptance rate a (a forgetting average
  per draft kind, for the n-gram drafter per matched length, started from a prior worth two tokens, or from a
  shorter match's measured rate when that is higher, with a free "shadow" measurement while speculation is
  off: would its guess have been the token that came?), the wall time of a verify of n tokens with its
  sampling (a line a + b (n - 1) through one time per size timed; free drafts are verified at a second size
  early on, so the line is measured rather than assumed; one line per model for the whole process,
  `cost_line`) and, for a draft model, the wall time of its forwards the same way (before any is timed: the
  ratio of the two models' weights). It picks the k in 0..draft_max maximizing expected tokens per second,
  (1 - a^(k+1)) / (1 - a) / (verify(k + 1) + k draft_step + catch-up); k = 0 is plain decoding, so
  speculation switches itself off where it cannot pay. A draft model that missed tokens (speculation was
  off, or the lookup's draft was verified) evaluates them all in its next first forward: that catch-up is
  charged, spread over the rounds it buys, and a lookup draft verified while the model drafts is charged the
  catch-up it causes. While off, a draft model probes with one token a few rounds after switching off (the
  catch-up is still short), twice at most unless a probe turns speculation back on.
* `SpeculativeRun`: drives a `Generation` (engine.py) round by round. A round evaluates the pending token and
  k draft tokens in one forward (logits for every position; in the server, one segment of the scheduler's
  batched step: `plan` / `finish`), walks the draft with `Generation.step` (so the
  sampler's history, the detokenizer, stop strings, max_tokens, EOS and the context limit act exactly as in
  plain decoding), truncates the KV cache to what was accepted, and returns the round's events. In draft-model
  mode each round also looks the context up (free) and verifies that draft instead when the controller expects
  more tokens per second of it (a long copy); `SpeculationParams.lookup=False` keeps to the model.
  Under a grammar (structured output), a draft is cut before its first token the grammar rejects (the target's
  distribution is masked, so such a token could never be accepted), and a draft model drafts under a copy of
  the grammar's state (`Sampler.clone`).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field, replace

import numpy as np

from localllm.errors import LocalLLMError

MODES = ("ngram", "draft")


@dataclass
class SpeculationParams:
    mode: str = "ngram"  # "ngram" (prompt lookup) or "draft" (a draft model)
    draft_model: str | None = None  # catalog name or .gguf path, for mode "draft"
    # Most tokens drafted per verify (llama.cpp's default too); the controller drafts that long only where the
    # drafts' measured acceptance pays for the long verify. Against 8, interleaved in one process (the edit
    # workload, /work/bench/s16/dm_ab.py): qwen2.5-coder-1.5b n-gram tg128 1.77x -> 1.85x, the whole answer (1,075
    # tokens) 3.05x -> 3.13x, with the 0.5b draft model tg128 2.11x -> 2.22x; the 0.5b n-gram 3.21x -> 3.22x and
    # 3.29x -> 3.35x; prose 1.04x -> 1.03x.
    draft_max: int = 16
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
        # The last draft's forwards as (tokens evaluated, seconds, the draw after it included): the first one
        # also evaluates whatever the draft model missed since its last draft (a catch-up).
        self.forwards: list[tuple[int, float]] = []
        self.seq = engine.new_sequence()
        self.rng = np.random.Generator(np.random.PCG64([seed, 1]))
        self.temperature = temperature  # drafting temperature when sampling (None: the target's)

    def prefill(self, tokens: list[int]) -> None:
        self.seq.reuse_prefix(tokens)  # the draft model's KV pool caches prompts as the target's does
        self._sync(tokens)

    def _common(self, context: list[int]) -> int:
        have = self.seq.tokens
        limit = min(len(have), len(context))
        if limit and have[:limit] == context[:limit]:
            return limit
        common = 0
        while common < limit and have[common] == context[common]:
            common += 1
        return common

    def size_ratio(self, target) -> float:
        """The draft model's weights over the target's (file sizes): about what one forward costs next to the
        target's."""
        try:
            return self.engine.path.stat().st_size / target.path.stat().st_size
        except (AttributeError, OSError):
            return 0.0

    def lag(self, context: list[int]) -> int:
        """Tokens the next draft's first forward evaluates: those of `context` the draft model has not seen (at
        least one: the last token's logits are needed)."""
        return max(len(context) - self._common(context), 1)

    def _sync(self, context: list[int]) -> tuple[np.ndarray, int]:
        """Make the draft sequence hold `context`; return the last position's logits and how many tokens that
        evaluated."""
        seq = self.seq
        common = self._common(context)
        if common == len(context):  # nothing new to evaluate: step back one token to get its logits
            common -= 1
        if common < len(seq.tokens):
            seq.truncate(common)
        return self.engine.evaluate(seq, context[common:]), len(context) - common

    def draft(self, context: list[int], k: int, sampler) -> Draft:
        out = Draft()
        self.forwards = []
        if k <= 0:
            return out
        t0 = time.perf_counter()
        logits, n = self._sync(context)
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
            t1 = time.perf_counter()
            self.forwards.append((n, t1 - t0))
            if i + 1 < k:
                t0, n = t1, 1
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


class _LineFit:
    """Wall time of a forward of n tokens as a line, t(n) = a + b (n - 1), fitted by least squares through one
    time per size n measured (so that a size measured long ago keeps its point: the fit never falls back to the
    prior once two sizes were measured, however long one size is then repeated). Before two sizes were
    measured: the one measured size's time, with a prior slope relative to a one-token forward.

    A size's time falls at once to a faster observation and rises slowly (RISE of the way) to a slower one: on a
    shared machine a forward now and then takes twice its time (another process got the cores), and a size
    measured once, slowly, would otherwise keep the controller away from it for good (seen on
    qwen2.5-coder-1.5b: one 17-token verify timed at 8 one-token ones kept drafts at 1 token)."""

    RISE = 0.1

    def __init__(self, prior_slope: float):
        self.prior_slope = prior_slope
        self.at: dict[int, float] = {}  # n -> its time
        self.counts: dict[int, int] = {}  # n -> how many times it was measured
        self._line: tuple[float, float] | None = None  # (t(1), slope), refitted after each observation

    @property
    def measured(self) -> bool:
        return bool(self.at)

    @property
    def sizes(self) -> set[int]:
        """The sizes measured so far."""
        return set(self.at)

    def observe(self, n: int, seconds: float) -> None:
        t = self.at.get(n)
        self.at[n] = seconds if t is None or seconds < t else t + self.RISE * (seconds - t)
        self.counts[n] = self.counts.get(n, 0) + 1
        means = list(self.at.items())
        if len(means) < 2:
            size, t = means[0]
            base = t / (1 + self.prior_slope * (size - 1))
            self._line = (base, self.prior_slope * base)
            return
        # Each size counts once: the line is what the sizes say, not what the most repeated one says.
        mn = sum(size for size, _ in means) / len(means)
        mt = sum(t for _, t in means) / len(means)
        var = sum((size - mn) ** 2 for size, _ in means)
        slope = max(sum((size - mn) * (t - mt) for size, t in means) / var, 0.0)
        self._line = (mt - slope * (mn - 1), slope)

    def __call__(self, n: float) -> float:
        if self._line is None:
            return 1.0 + self.prior_slope * (n - 1)
        t1, slope = self._line
        return max(t1 + slope * (n - 1), 1e-6)


class Controller:
    """Chooses k, the tokens to draft for the next verify, from measured acceptance and measured costs.
    Acceptance is kept per draft kind: an n-gram draft from a 5-token match is right far more often than one
    from a 2-token match, so each match length gets its own rate (and its own draft length).

    Costs are wall times, measured as a line in the tokens a forward evaluates: a verify of n tokens (with the
    walk that samples and accepts at each of its positions) and, for a draft model, one of its forwards (with
    the draw after it). A draft of k tokens costs k one-token draft forwards in steady state; a draft model that
    missed tokens (speculation was off, or the lookup's draft was verified instead) first evaluates them all in
    its first forward: a catch-up, charged where it is paid (see `choose`)."""

    DECAY = 0.95  # forgetting per observation
    PRIOR_WEIGHT = 2.0  # the prior acceptance counts as this many tested tokens
    PRIOR_SLOPE = 0.35  # verify(n) / verify(1) - 1 per extra token, until two sizes were measured (see _explore)
    EXPLORE_TIMES = 3  # verifies timed at each of two sizes before the line is trusted (see _explore)
    PROBE_EVERY = 4  # a switched-off draft model probes after this many rounds off
    MAX_FRUITLESS = 2  # and stops after this many probes that left speculation off

    def __init__(self, draft_max: int, adaptive: bool = True, free_drafts: bool = True, prior_rate: float = 0.6,
                 draft_ratio: float = 0.0, verify_line: _LineFit | None = None, draft_line: _LineFit | None = None):
        self.draft_max, self.adaptive, self.free_drafts = draft_max, adaptive, free_drafts
        self.prior_rate = prior_rate
        # A draft model's forward / the target's, assumed until measured (the ratio of their weights' sizes: a
        # one-token forward reads every weight once).
        self.draft_ratio = draft_ratio
        self._seen: dict[int, list[float]] = {}  # per draft kind: forgetting sums of tokens accepted, tested
        # The cost lines are properties of the model on this machine, not of one request: a caller may pass lines
        # shared by every run of the same model (`cost_line`), so that only the first request pays to measure them.
        self._verify = verify_line if verify_line is not None else _LineFit(self.PRIOR_SLOPE)
        self._draft = draft_line if draft_line is not None else _LineFit(self.PRIOR_SLOPE)
        self.off_rounds = 0
        self.fruitless_probes = 0  # probes after which speculation stayed off
        self._probed = False

    def accept_rate(self, kind: int = 0) -> float:
        seen = self._seen.get(kind)
        return self._prior(kind) if seen is None else seen[0] / seen[1]

    def _prior(self, kind: int) -> float:
        """The acceptance assumed for a kind not yet measured: the prior, or, when a shorter match was measured
        more often right, the nearest such one's rate. A draft from a longer match is at least as good a bet (the
        n-gram drafter's kinds are matched lengths, up to 16 while a copy is followed): without this, each new
        length of a copy that goes on started from the prior, and on the edit workload the copy's agreement
        grew through 9, 12 and 15 tokens with drafts of 2 where 8 were then accepted each time."""
        below = [k for k in self._seen if 0 < k < kind]
        if not below:
            return self.prior_rate
        seen = self._seen[max(below)]
        return max(self.prior_rate, seen[0] / seen[1])

    @property
    def rates(self) -> dict[int, float]:
        return {kind: self.accept_rate(kind) for kind in self._seen}

    def observe_acceptance(self, drafted: int, accepted: int, kind: int = 0) -> None:
        """`drafted` tokens were checked and the first `accepted` of them kept. The rate is a forgetting average
        over the tokens tested, started from the prior counted as PRIOR_WEIGHT tokens: an optimistic start gets
        speculation tried, and two or three rejections are enough to show it was wrong."""
        seen = min(drafted, accepted + 1)  # tokens after the first rejection were never tested
        s = self._seen.get(kind)
        if s is None:
            s = self._seen[kind] = [self.PRIOR_WEIGHT * self._prior(kind), self.PRIOR_WEIGHT]
        for i in range(seen):
            s[0] = self.DECAY * s[0] + (1.0 if i < accepted else 0.0)
            s[1] = self.DECAY * s[1] + 1.0

    def observe_verify(self, n: int, seconds: float) -> None:
        self._verify.observe(n, seconds)

    def observe_draft(self, n: int, seconds: float) -> None:
        """A draft model's forward of n tokens (and its draw) took `seconds`."""
        self._draft.observe(n, seconds)

    def verify_cost(self, n: int) -> float:
        return self._verify(n)

    def draft_forward(self, n: int) -> float:
        """A draft model's forward of n tokens: measured, or before that, `draft_ratio` times the target's."""
        if self._draft.measured:
            return self._draft(n)
        return self.draft_ratio * self.verify_cost(1) * (1 + self.PRIOR_SLOPE * (n - 1))

    def draft_cost(self, k: int, kind: int = 0) -> float:
        """A draft model's k tokens in steady state: k one-token forwards, and when the target accepts them all,
        the last one is evaluated in the next draft's first forward (a second token there)."""
        if k <= 0:
            return 0.0
        return k * self.draft_forward(1) + self.accept_rate(kind) ** k * self.catchup_step

    @property
    def draft_step(self) -> float:
        """Seconds of a one-token draft forward (with its draw)."""
        return self.draft_forward(1)

    @property
    def catchup_step(self) -> float:
        """Seconds a draft model spends per token it missed, evaluating it in its next draft's first forward."""
        return self.draft_forward(2) - self.draft_forward(1)

    def expected_tokens(self, k: int, kind: int = 0) -> float:
        a = min(self.accept_rate(kind), 0.999)
        return (1 - a ** (k + 1)) / (1 - a)

    def expected_rate(self, k: int, kind: int = 0, free: bool = False, extra: float = 0.0) -> float:
        """Expected tokens per second of a verify with k drafted tokens (in units of the measured costs), plus
        `extra` seconds the round causes elsewhere."""
        cost = self.verify_cost(k + 1) + (0.0 if free else self.draft_cost(k, kind)) + extra
        return self.expected_tokens(k, kind) / cost

    def catchup(self, lag: int, room: float = float("inf")) -> float:
        """Seconds per round to charge a draft that first makes the draft model catch up on `lag` tokens: its
        forward's cost beyond a steady-state one (of up to 2 tokens, charged by `draft_cost`), spread over the
        rounds it buys (as many as the rates are measured over, 1 / (1 - DECAY), or as fit in the `room` left)."""
        if lag <= 2:
            return 0.0
        rounds = max(1.0, min(1 / (1 - self.DECAY), room / max(self.expected_tokens(1), 1.0)))
        return (self.draft_forward(lag) - self.draft_forward(2)) / rounds

    def choose(self, limit: int, kind: int = 0, free: bool = False, lag: int = 1,
               room: float = float("inf")) -> int:
        """The draft length for the next verify, at most `limit`. A draft model's `lag`: the tokens its first
        forward would evaluate (1 in steady state); `room`: tokens left to generate."""
        limit = min(limit, self.draft_max)
        if limit <= 0:
            return 0
        if not self.adaptive:
            return limit
        extra = 0.0 if free else self.catchup(lag, room)
        k = max(range(limit + 1), key=lambda k: self.expected_rate(k, kind, free, extra if k else 0.0))
        if k > 0 and (free or self.free_drafts):  # a draft model's tokens cost too much to explore with
            k = self._explore(k, limit)
        if not (free or self.free_drafts):
            if k == 0 and not self._draft.measured:
                return 1  # time one draft while the draft model is still in step with the prompt: no catch-up
            if self._probed:
                self.fruitless_probes = self.fruitless_probes + 1 if k == 0 else 0
                self._probed = False
            # A draft model's acceptance cannot be measured for free: probe with one token now and then. A probe
            # costs the draft model's catch-up on every token it missed (a forward of that many tokens, about
            # catchup_step each) for one tested token: probe soon after switching off, while the catch-up is
            # short, and after MAX_FRUITLESS probes that did not turn speculation back on, stop.
            if k == 0 and self.fruitless_probes < self.MAX_FRUITLESS:
                self.off_rounds += 1
                if self.off_rounds % self.PROBE_EVERY == 0:
                    self._probed = True
                    return 1
        return k

    def _explore(self, k: int, limit: int) -> int:
        """Until verifies of two sizes were timed EXPLORE_TIMES times each, the cost line is the prior's
        (verify(n) / verify(1) = 1 + 0.35 (n - 1)) or rests on one timing, and under it the same k always wins:
        the line would never be measured (or a slow first timing never corrected). So a free draft is verified
        at another size instead: one timed too few times (the longest), else, with no other size timed, the
        longest draft allowed, else a single token. On qwen2.5-coder-0.5b (2 cores) a 9-token verify costs
        2.84 one-token ones where the prior says 3.8: measured, the copy of an edited file drafts longer."""
        counts = self._verify.counts
        if k + 1 not in counts or sum(c >= self.EXPLORE_TIMES for c in counts.values()) >= 2:
            return k
        few = [n for n, c in counts.items() if n != k + 1 and c < self.EXPLORE_TIMES and n - 1 <= limit]
        if few:
            return max(few) - 1
        if len(counts) == 1:
            for other in (limit, 1):
                if other + 1 not in counts:
                    return other
        return k

    def probe_skipped(self) -> None:
        """The probe `choose` asked for was not made (a lookup draft was verified instead): it proved nothing."""
        self._probed = False


_COST_LINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def cost_line(engine, role: str) -> _LineFit:
    """The measured cost line of `engine`'s forwards in `role` ("verify": a target's verify with its sampling;
    "draft": a draft model's forward with its draw), shared by every speculative run of that engine in this
    process. Timing two verify sizes costs a request a few long verifies (on qwen2.5-coder-1.5b, the edit
    workload's first 128 tokens: two 9-token verifies that kept 1 and 2 tokens, about 80 ms of 1.66 s); measured
    once per model, later requests (a chat's next turn, a server's next client) start from the measured line."""
    lines = _COST_LINES.setdefault(engine, {})
    line = lines.get(role)
    if line is None:
        line = lines[role] = _LineFit(Controller.PRIOR_SLOPE)
    return line


# ---- driving a Generation ----------------------------------------------------------------------------------


class SpeculativeRun:
    """Speculative decoding of one `Generation` (localllm/runtime/generation.py), as the rounds its `Run` plans:
    `begin(logits)` once the prompt is read, then per round `plan()` (the pending token and a draft), one forward
    of the target (the driver's batched step, alone or beside other runs), and `finish(rows)` (the accepted
    events). Plain decoding (generation.py `Decoding`) has this interface with no draft."""

    def __init__(self, gen, spec: SpeculationParams, drafter):
        self.gen, self.spec, self.drafter = gen, spec, drafter
        self.engine, self.seq = gen.engine, gen.seq
        self.greedy = gen.params.sampling.greedy
        self.rng = np.random.Generator(np.random.PCG64([gen.sampler.seed, 2]))
        draft_engine = getattr(drafter, "engine", None)
        self.controller = Controller(spec.draft_max, spec.adaptive, drafter.free, drafter.prior_rate,
                                     getattr(drafter, "size_ratio", lambda target: 0.0)(self.engine),
                                     verify_line=cost_line(self.engine, "verify"),
                                     draft_line=None if draft_engine is None else cost_line(draft_engine, "draft"))
        self.pending = None  # the event whose token is chosen but not yet evaluated (nor handed out)
        self.lookup = (NGramDrafter(spec.ngram_max, spec.ngram_min)
                       if not drafter.free and spec.lookup and spec.adaptive else None)
        self.history: list[int] = []  # prompt and every token handed out (the n-gram drafter's text)
        self._round = None  # what `plan` decided, for `finish`: (event, base, draft, shadow, start time)

    def begin(self, logits: np.ndarray) -> None:
        """After the target read the prompt (`Generation.start_prefill`'s tokens; `logits`: its last
        position's): the drafter reads it too, and the first token is picked."""
        gen = self.gen
        self.drafter.prefill(gen.tokens)
        if self.lookup is not None:
            self.lookup.prefill(gen.tokens)
        gen.end_prefill()
        self.history = list(gen.tokens)
        self.pending = gen.step(logits)

    def plan(self) -> list[int] | None:
        """The round's tokens for the target to evaluate, with logits at every one of them: the pending token
        and the draft. None when the pending token ends the generation (`finish(None)` hands it out). A
        scheduler evaluates them with other sequences' tokens in one batched forward (bitwise the logits this
        sequence alone gets), then calls `finish`."""
        gen, seq, ctl, timings = self.gen, self.seq, self.controller, self.gen.timings
        event = self.pending
        if event.finish_reason is not None:
            return None
        s, base = event.token, len(seq.tokens)
        context = self.history + [s]
        # Never draft past max_tokens, nor so far that the context limit (a shift, or "length") would fall inside
        # the draft: there, k = 0 is exactly plain decoding.
        room = min(gen.limit - timings.predicted_n, self.engine.ctx - base - 3)
        limit = int(min(room, self.spec.draft_max))
        shadow = None  # (a draft token not verified, its kind): would it have been right? Measured for free
        if self.drafter.free:  # look first (it costs nothing), then decide how much of it to verify
            draft = self.drafter.draft(context, limit) if limit > 0 else Draft()
            k = ctl.choose(len(draft.tokens), draft.kind)
            if k == 0 and draft.tokens:
                shadow = draft.tokens[0], draft.kind
            draft = draft.cut(k)
        else:
            lag = self.drafter.lag(seq.tokens + [s])
            k = ctl.choose(limit, lag=lag, room=room)
            draft = None
            if self.lookup is not None and limit > 0:
                found = self.lookup.draft(context, limit)
                if found.tokens:
                    k_found = ctl.choose(len(found.tokens), found.kind, free=True)
                    # While the draft model drafts, every token the lookup's draft yields instead is one it
                    # will have to catch up on.
                    later = ctl.catchup_step * ctl.expected_tokens(k_found, found.kind) if k else 0.0
                    model = ctl.expected_rate(k, extra=ctl.catchup(lag, room) if k else 0.0)
                    if k_found and ctl.expected_rate(k_found, found.kind, True, later) >= model:
                        draft = found.cut(k_found)
                        ctl.probe_skipped()
                    else:
                        shadow = found.tokens[0], found.kind
            if draft is None:
                if k > 0:
                    draft = self.drafter.draft(seq.tokens + [s], k, gen.sampler)
                    for n_eval, seconds in self.drafter.forwards:
                        ctl.observe_draft(n_eval, seconds)
                else:
                    draft = Draft()
        grammar = gen.sampler.grammar
        if grammar is not None and draft.tokens:
            # A draft token the grammar rejects can never be accepted (the target's distribution is masked):
            # verify only the prefix it allows.
            draft = draft.cut(grammar.valid_prefix(draft.tokens))
        self._round = (event, base, draft, shadow, time.perf_counter())
        return [s] + draft.tokens

    def finish(self, rows: np.ndarray | None) -> list:
        """The round's events, from the logits of every token `plan` gave (rows, in order; None when it gave
        none): the pending token, each draft token the target accepts, and the next pending token is chosen
        (not handed out yet) unless generation ended."""
        gen, seq, ctl, timings = self.gen, self.seq, self.controller, self.gen.timings
        if rows is None:
            event = self.pending
            gen.record(event)
            return [event]
        event, base, draft, shadow, t1 = self._round
        self._round = None
        n = len(draft.tokens) + 1
        gen.record(event)
        out = [event]
        self.history.append(event.token)
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
        # The verify's cost: its forward (in a server, the step's batched forward it was part of), and the
        # sampling and acceptance at each position it walked.
        ctl.observe_verify(n, time.perf_counter() - t1)
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
