"""Token sampling: llama.cpp's default sampler chain over a model's logits.

The stages and their semantics follow llama.cpp (`src/llama-sampling.cpp`), and their order follows the chain
`common/sampling.cpp` builds by default (`common_sampler_init`: logit bias first, then `params.samplers`, whose
default is penalties, dry, top-n-sigma, top-k, typical-p, top-p, min-p, xtc, temperature, then dist). We
implement the stages that have parameters here, in this order:

  0. token mask     (`set_token_mask`: disallowed tokens -> -inf)
  0b. grammar       (`Sampler(..., grammar=)`, grammar.py: JSON schema, GBNF, regex), llama.cpp's way: the token
                    is drawn from the chain without the grammar first and kept if the grammar allows it; only
                    when it does not is the grammar's full mask computed (0.1-0.2 ms on a 49k vocabulary) and
                    applied as stage 0, and the token drawn again. Greedy picks exactly the masked argmax; a
                    sampled token follows llama.cpp's approximation of the masked distribution. With n_probs > 0
                    or a `token` given, the mask is always applied, so reported logprobs are under it.
  1. logit bias     logit[t] += bias[t]; a bias of -inf bans t
  2. penalties      over the last `repeat_last_n` accepted tokens (0 disables, < 0 = all of them), for each
                    token t seen c > 0 times: logit /= repeat_penalty if logit > 0 else logit *= repeat_penalty;
                    then logit -= c * frequency_penalty + presence_penalty
  2b. DRY           ("don't repeat yourself", llama.cpp's `dry` sampler, off unless dry_multiplier > 0, dry_base >= 1
                    and dry_penalty_last_n != 0), over the last `dry_penalty_last_n` accepted tokens (-1: all):
                    rep_limit is the distance back to the newest sequence breaker (any token whose text contains
                    one of `dry_sequence_breakers`, or a token whose text ends with a breaker's start followed by
                    the tokens of the breaker's rest); nothing happens if rep_limit < dry_allowed_length. For each
                    earlier position, the length of the longest suffix of the history that also ends there
                    (capped at rep_limit); the token that followed such a match of length n >= dry_allowed_length
                    would repeat it, and gets logit -= dry_multiplier * dry_base ** (n - dry_allowed_length), the
                    exponent clamped so the penalty stays a finite float, n the longest such match; a token that is
                    itself a single-token breaker is never penalized
  3. top-k          keep the k largest logits (k <= 0 disables)
  4. top-p          softmax over the candidates; keep the smallest prefix (by decreasing probability) whose
                    cumulative probability reaches p (p >= 1 disables)
  5. min-p          keep tokens with p >= min_p * p_max, i.e. logit >= max_logit + log(min_p) (0 disables)
  5a. XTC           (off unless xtc_probability > 0 and xtc_threshold <= 0.5; llama.cpp's `xtc`): with probability
                    xtc_probability (a draw from a generator of its own), if two or more candidates have softmax
                    probability >= xtc_threshold, all of them but the least likely are removed
  5b. infill        (off unless `infill`; llama.cpp's `infill` sampler, which code-completion plugins ask for)
                    over the candidates' softmax: if 3 * p(end of generation) * n >= p(text), keep only the
                    end-of-generation tokens; else fold each token whose text is a prefix of another's into the
                    likelier of the two, drop text tokens under p 0.2 (none left: end of text), then those under
                    1 / (n_text + 1) of what is left
  6. temperature    logits /= temperature
  7. dist           softmax over what is left, one draw from a numpy Generator (PCG64)

Stages 3-5b are small objects (`TopK`, `TopP`, `MinP`, `Xtc`, `InfillStage`), each narrowing a `Candidates` in
its `apply(candidates, sampler)`; a sampler holds the list of those its parameters turn on. A new stage is such a
class, its row in localllm/parameters.py (type, range, defaults, flag, label) and its field in SamplingParams.

Greedy (temperature <= 0): the argmax of the logits after stages 0-2b (mask, bias, penalties, DRY), ties broken by
the lowest token id. llama.cpp gets the same token by keeping only the max in its temperature stage.

Reported log-probabilities (`SampledToken.logprob`, `.top_logprobs`) are the log-softmax over the whole
vocabulary of the logits after the mask and the logit bias (stages 0-1), before penalties, truncation and
temperature: "what the model thinks, under the constraints the user imposed". Banned/masked tokens have
-inf and never appear in `top_logprobs`.

Ties: top-k keeps, among tokens tied at the boundary, the lowest ids; candidate lists are ordered by
decreasing logit, then increasing id, so a seeded run is reproducible bit for bit.

Cost on a large vocabulary: stages work on a short candidate list as early as possible. Top-k picks its
candidates without a full sort: the k-th largest value of a strided subsample is a lower bound for the k-th
largest value overall, so `logits >= that bound` is a small superset of the top k that a partition then
finishes (argpartition-style selection, O(vocab) with a small constant). With top-k disabled, top-p first tries
the top 256 tokens (as llama.cpp does) and sorts everything only if those do not reach p.
Measured per token (2-core CPU, numpy 2.4, one thread): default chain 0.70 ms at a 262k vocabulary and 0.45 ms
at 152k (about 0.35 ms of it is the full-vocabulary log-softmax behind the reported logprob); greedy 0.53 / 0.32
ms; with n_probs=5 or penalties + bias about +0.1 ms.
"""

from __future__ import annotations

import copy
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from localllm import parameters
from localllm.errors import LocalLLMError, ModelFileError
from localllm.chat.loop_guard import DRY_SEQUENCE_BREAKERS
from localllm.kernels.top_logits import TOP_LOGITS_MAX, TopLogits

__all__ = ["SamplingParams", "SampledToken", "Sampler", "top_k_ids"]

# top-k selection: subsample when the vocabulary is at least this big
_SUBSAMPLE_MIN_VOCAB = 16384
_SUBSAMPLE_MIN_SIZE = 4096
# top-p without top-k: candidates tried before falling back to a full sort (llama.cpp uses 256)
_TOP_P_FIRST_TRY = (256, 4096)
# llama.cpp's bounds on DRY sequence breakers (llama_sampler_init_dry)
_DRY_MAX_CHAR_LEN = 40
_DRY_MAX_SEQ_LEN = 20
_FLOAT_MAX_LOG = 88.7228391


_D = parameters.defaults()  # llama.cpp's defaults, from the one table of sampling parameters


@dataclass
class SamplingParams:
    temperature: float = _D["temperature"]  # <= 0 means greedy
    top_k: int = _D["top_k"]  # <= 0 disables
    top_p: float = _D["top_p"]  # 1.0 disables
    min_p: float = _D["min_p"]  # 0 disables
    repeat_penalty: float = _D["repeat_penalty"]  # 1.0 disables
    repeat_last_n: int = _D["repeat_last_n"]  # 0 disables penalties, < 0 = whole history
    presence_penalty: float = _D["presence_penalty"]
    frequency_penalty: float = _D["frequency_penalty"]
    logit_bias: dict[int, float] = field(default_factory=dict)  # -inf bans a token
    seed: int | None = None  # None: fresh entropy (the seed used is in Sampler.seed)
    n_probs: int = 0  # how many top logprobs to report per token
    # each sampled token's log-probability (SampledToken.logprob): a log-sum-exp over the whole vocabulary, 0.3 ms
    # per token of qwen2.5's 152k, 2.3 ms of each step of 8 sequences; the server asks for it only where a request
    # wants logprobs (False: logprob is None; n_probs > 0 computes it anyway)
    logprob: bool = True
    infill: bool = False  # stage 5b (needs the vocabulary: Sampler(..., vocab=tokenizer))
    # stage 2b, DRY (llama.cpp's names and defaults: off at multiplier 0); the breakers need Sampler(vocab=)
    dry_multiplier: float = _D["dry_multiplier"]
    dry_base: float = _D["dry_base"]
    dry_allowed_length: int = _D["dry_allowed_length"]
    dry_penalty_last_n: int = _D["dry_penalty_last_n"]  # -1: the whole history (which the context bounds), 0: off
    dry_sequence_breakers: tuple[str, ...] = DRY_SEQUENCE_BREAKERS
    # stage 5a, XTC (llama.cpp's names and defaults: off at probability 0)
    xtc_probability: float = _D["xtc_probability"]
    xtc_threshold: float = _D["xtc_threshold"]

    @property
    def dry_on(self) -> bool:
        return self.dry_multiplier != 0.0 and self.dry_base >= 1.0 and self.dry_penalty_last_n != 0

    @property
    def xtc_on(self) -> bool:
        return self.xtc_probability > 0.0 and self.xtc_threshold <= 0.5

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


@dataclass
class SampledToken:
    id: int
    logprob: float | None  # log-softmax of the (masked, biased) logits (module docstring); None: not asked for
    top_logprobs: list[tuple[int, float]]  # the n_probs most likely (id, logprob), most likely first


def _check_params(p: SamplingParams, vocab_size: int) -> None:
    def bad(msg: str) -> LocalLLMError:
        return LocalLLMError(f"invalid sampling parameter: {msg}")

    # Types from the table of parameters; the ranges below are the sampler's own (what its stages can run with),
    # wider than the table's for requests, flags and settings (a library caller may ask for a negative
    # temperature: greedy, as llama.cpp).
    for param in parameters.SAMPLING:
        v = getattr(p, param.name)
        if param.kind is float and (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)):
            raise bad(f"{param.name} must be a finite number, got {v!r}")
        if param.kind is int and (not isinstance(v, (int, np.integer)) or isinstance(v, bool)):
            raise bad(f"{param.name} must be an integer, got {v!r}")
    if not isinstance(p.n_probs, (int, np.integer)) or isinstance(p.n_probs, bool):
        raise bad(f"n_probs must be an integer, got {p.n_probs!r}")
    if not 0.0 < p.top_p <= 1.0:
        raise bad(f"top_p must be in (0, 1], got {p.top_p}")
    if not 0.0 <= p.min_p <= 1.0:
        raise bad(f"min_p must be in [0, 1], got {p.min_p}")
    if p.repeat_penalty <= 0:
        raise bad(f"repeat_penalty must be > 0, got {p.repeat_penalty}")
    if p.dry_penalty_last_n < -1:
        raise bad(f"dry_penalty_last_n must be >= -1 (-1: the whole context, 0: off), got {p.dry_penalty_last_n}")
    if isinstance(p.dry_sequence_breakers, str) or not all(isinstance(b, str) for b in p.dry_sequence_breakers):
        raise bad("dry_sequence_breakers must be a list of strings")
    if p.n_probs < 0:
        raise bad(f"n_probs must be >= 0, got {p.n_probs}")
    if p.seed is not None and (not isinstance(p.seed, (int, np.integer)) or p.seed < 0):
        raise bad(f"seed must be a non-negative integer, got {p.seed!r}")
    for tok, b in p.logit_bias.items():
        if not isinstance(tok, (int, np.integer)) or isinstance(tok, bool) or not 0 <= tok < vocab_size:
            raise bad(f"logit_bias token {tok!r} is not a token id of this model (0..{vocab_size - 1})")
        if not isinstance(b, (int, float)) or isinstance(b, bool) or math.isnan(b) or b == math.inf:
            raise bad(f"logit_bias for token {tok} must be a finite number or -inf, got {b!r}")


def _keep_lowest_ties(cand: np.ndarray, vals: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Of candidates `cand` (ascending ids) with values `vals`, keep the k largest values; among the tokens tied
    at the boundary value, the lowest ids. Keeps ascending id order."""
    c = cand.shape[0]
    if c <= k:
        return cand, vals
    kth = np.partition(vals, c - k)[c - k]
    above = vals > kth
    need = k - int(np.count_nonzero(above))
    tied = vals == kth
    keep = above | (tied & (np.cumsum(tied) <= need))
    return cand[keep], vals[keep]


def _top_k_few_finite(x: np.ndarray, k: int) -> np.ndarray | None:
    """top_k_ids when fewer than k values are finite (a grammar masked all but a few tokens): the finite ones by
    decreasing value then id, then the lowest ids of the -inf ones. Without it, every -inf token ties at the
    boundary and the tie-break sorts the whole vocabulary (15 ms a draw on qwen2.5's 152k, measured).
    None when at least k values are finite."""
    fin = np.flatnonzero(x > -np.inf)
    if fin.shape[0] >= k:
        return None
    order = np.lexsort((fin, -x[fin].astype(np.float64)))
    rest = np.flatnonzero(x == -np.inf)[: k - fin.shape[0]]
    return np.concatenate([fin[order], rest])


def top_k_ids(x: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest values of the 1-D array x, by decreasing value then increasing id.

    O(len(x)) without a full sort: a strided subsample's k-th largest value t is <= the k-th largest value
    overall, so {x >= t} contains the top k; it is usually ~k * stride elements, which a partition finishes.
    """
    n = x.shape[0]
    k = min(int(k), n)
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    cand = None
    if n >= _SUBSAMPLE_MIN_VOCAB:
        stride = n // max(_SUBSAMPLE_MIN_SIZE, 16 * k)
        if stride >= 4:
            sub = x[::stride]
            m = sub.shape[0]
            t = np.partition(sub, m - k)[m - k]
            if t == -np.inf:  # mostly banned (a grammar's mask): no partition over the whole vocabulary
                few = _top_k_few_finite(x, k)
                if few is not None:
                    return few
            cand = np.flatnonzero(x >= t)
            if cand.shape[0] > n // 4:  # degenerate (e.g. mostly -inf or constant): plain selection is cheaper
                cand = None
    if cand is None:
        if k == n:
            cand = np.arange(n)
        else:
            part = np.argpartition(x, n - k)
            kth = x[part[n - k]]
            if kth == -np.inf:
                few = _top_k_few_finite(x, k)
                if few is not None:
                    return few
            cand = np.flatnonzero(x >= kth)  # ascending ids, includes every tie at the boundary
    cand, vals = _keep_lowest_ties(cand, x[cand], k)
    order = np.lexsort((cand, -vals.astype(np.float64)))
    return cand[order]


class Sampler:
    """A sampler chain with its state (penalty history, RNG, token mask).

    `sample(logits)` picks a token; it does not record it: call `accept(token)` for every generated token that
    enters the context, as llama.cpp's common_sampler_accept, and `accept_prompt(tokens)` for the prompt's (if
    penalties should see them; a grammar does not).
    """

    def __init__(self, params: SamplingParams, vocab_size: int, vocab=None, grammar=None):
        if vocab_size <= 0:
            raise ValueError("vocab_size must be positive")
        _check_params(params, vocab_size)
        self.params = params
        self.vocab_size = int(vocab_size)
        self._infill = InfillStage(vocab) if params.infill else None
        self._bias_ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64, count=len(params.logit_bias))
        self._bias_vals = np.fromiter(params.logit_bias.values(), dtype=np.float32, count=len(params.logit_bias))
        last_n = params.repeat_last_n
        self._penalties_on = last_n != 0 and (
            params.repeat_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0)
        self._history: deque[int] = deque(maxlen=last_n if last_n > 0 else None)
        self._counts: dict[int, int] = {}
        self._dry = _DryStage(params, vocab) if params.dry_on else None
        self._xtc_rng: np.random.Generator | None = None
        # Stages 3-5b on the candidates, in the chain's order; each is on only where its setting asks for it.
        # XTC never runs for a greedy pick (llama.cpp's temperature stage keeps the max of what is left).
        self._stages: list = [stage for on, stage in (
            (0 < params.top_k < self.vocab_size, TopK()), (params.top_p < 1.0, TopP()), (params.min_p > 0.0, MinP()),
            (params.xtc_on and not params.greedy, Xtc()), (self._infill is not None, self._infill)) if on]
        self._disallowed: np.ndarray | None = None
        # Stage 0b: this sequence's own matcher (a mask never depends on other sequences: batch invariance).
        self._grammar = grammar.matcher() if grammar is not None else None
        self._buf = np.empty(self.vocab_size, dtype=np.float32)
        self._ebuf = np.empty(self.vocab_size, dtype=np.float32)
        self.seed: int = 0
        self._rng: np.random.Generator
        self._reseed()

    # ---------------------------------------------------------------- state

    def _reseed(self) -> None:
        seed = self.params.seed
        if seed is None:
            seed = int(np.random.SeedSequence().entropy)  # fresh OS entropy, kept so a run can be replayed
        self.seed = int(seed)
        self._rng = np.random.Generator(np.random.PCG64(self.seed))
        # XTC draws from a generator of its own (as llama.cpp's xtc sampler), so that turning it on does not
        # change the draws of the final stage
        self._xtc_rng = (np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, 0x787463])))
                         if self.params.xtc_on else None)

    def reset(self) -> None:
        """Forget the penalty history and restart the RNG (same seed if one was given, else fresh entropy) and
        the grammar. The token mask is kept."""
        if self._grammar is not None:
            self._grammar.reset()
        self._history.clear()
        self._counts.clear()
        if self._dry is not None:
            self._dry.tokens.clear()
        self._reseed()

    def clone(self) -> "Sampler":
        """An independent copy with the same history, mask and RNG state (draws continue identically)."""
        other = copy.copy(self)
        other._history = deque(self._history, maxlen=self._history.maxlen)
        other._counts = dict(self._counts)
        other._rng = copy.deepcopy(self._rng)
        other._xtc_rng = copy.deepcopy(self._xtc_rng)
        if self._dry is not None:
            other._dry = copy.copy(self._dry)
            other._dry.tokens = deque(self._dry.tokens, maxlen=self._dry.tokens.maxlen)
        if self._grammar is not None:
            other._grammar = self._grammar.clone()
        other._buf = np.empty_like(self._buf)
        other._ebuf = np.empty_like(self._ebuf)
        return other

    def accept(self, token_id: int) -> None:
        """Record a generated token that entered the context (penalty history; the grammar advances)."""
        if self._grammar is not None:
            self._grammar.consume(token_id)
        self._record(token_id)

    def accept_prompt(self, token_ids) -> None:
        """Record prompt tokens (penalty history only: the grammar constrains what is generated)."""
        for t in token_ids:
            self._record(t)

    @property
    def grammar(self):
        """This sequence's grammar matcher (grammar.GrammarMatcher), or None."""
        return self._grammar

    def _record(self, token_id: int) -> None:
        if self._dry is not None:
            self._dry.tokens.append(int(token_id))
        if self.params.repeat_last_n == 0:
            return
        token_id = int(token_id)
        hist = self._history
        if hist.maxlen is not None and len(hist) == hist.maxlen:
            old = hist[0]
            c = self._counts[old] - 1
            if c:
                self._counts[old] = c
            else:
                del self._counts[old]
        hist.append(token_id)
        self._counts[token_id] = self._counts.get(token_id, 0) + 1

    def accept_many(self, token_ids) -> None:
        for t in token_ids:
            self.accept(t)

    def set_token_mask(self, mask: np.ndarray | None) -> None:
        """Restrict sampling to the tokens where `mask` is True (bool, shape (vocab,)); None lifts it.
        Applied before every other stage; the reported logprobs are over the allowed tokens."""
        if mask is None:
            self._disallowed = None
            return
        mask = np.asarray(mask)
        if mask.dtype != np.bool_ or mask.shape != (self.vocab_size,):
            raise ValueError(f"token mask must be a bool array of shape ({self.vocab_size},), "
                             f"got {mask.dtype} {mask.shape}")
        self._disallowed = np.logical_not(mask)

    # ---------------------------------------------------------------- stages

    def _constrained(self, logits: np.ndarray) -> np.ndarray:
        """Stages 0-1 (mask, bias). Returns the caller's array itself when there is nothing to do."""
        x = np.asarray(logits)
        if x.shape != (self.vocab_size,):
            raise ValueError(f"logits must have shape ({self.vocab_size},), got {x.shape}")
        if x.dtype != np.float32 or self._disallowed is not None or self._bias_ids.size:
            np.copyto(self._buf, x, casting="same_kind")
            x = self._buf
            if self._disallowed is not None:
                np.copyto(x, np.float32(-np.inf), where=self._disallowed)
            if self._bias_ids.size:
                x[self._bias_ids] += self._bias_vals
        return x

    @staticmethod
    def _check_finite_max(x: np.ndarray) -> float:
        """x's max, after the checks every sample makes (a NaN anywhere makes the max NaN)."""
        m = float(x.max())
        if math.isnan(m):
            # Weights or hyperparameters that overflow (a corrupt or hostile file): the user's problem to
            # hear about, not a traceback.
            raise ModelFileError("the model computed NaN logits: its weights or hyperparameters are broken")
        if m == -math.inf:
            raise LocalLLMError("no token can be sampled: every token is masked or banned")
        return m

    def _log_normalizer(self, x: np.ndarray) -> tuple[float, float]:
        """(max, log-sum-exp) of x over the whole vocabulary."""
        m = self._check_finite_max(x)
        e = self._ebuf
        np.subtract(x, np.float32(m), out=e)
        np.exp(e, out=e)
        return m, m + math.log(float(e.sum(dtype=np.float64)))

    def _penalize(self, x: np.ndarray, original: np.ndarray) -> tuple[np.ndarray, dict[int, float]]:
        """Stages 2 and 2b (penalties, DRY), in a private buffer. Returns the penalized logits and the
        pre-penalty value of every token they changed."""
        x, changed = self._repeat_penalties(x, original)
        if self._dry is None:
            return x, changed
        ids, amounts = self._dry.penalties(self.vocab_size)
        if ids.size == 0:
            return x, changed
        if x is original:
            np.copyto(self._buf, x)
            x = self._buf
        before = x[ids]
        for t, v in zip(ids.tolist(), before.tolist()):
            changed.setdefault(t, v)
        x[ids] = before - amounts
        return x, changed

    def _repeat_penalties(self, x: np.ndarray, original: np.ndarray) -> tuple[np.ndarray, dict[int, float]]:
        """Stage 2."""
        if not self._penalties_on or not self._counts:
            return x, {}
        if x is original:  # never write into the caller's array
            np.copyto(self._buf, x)
            x = self._buf
        p = self.params
        ids = np.fromiter(self._counts.keys(), dtype=np.int64, count=len(self._counts))
        cnt = np.fromiter(self._counts.values(), dtype=np.float32, count=len(self._counts))
        ids_ok = ids < self.vocab_size
        ids, cnt = ids[ids_ok], cnt[ids_ok]
        before = x[ids]
        v = np.where(before <= 0, before * np.float32(p.repeat_penalty), before / np.float32(p.repeat_penalty))
        v = v - (cnt * np.float32(p.frequency_penalty) + np.float32(p.presence_penalty))
        x[ids] = v.astype(np.float32)
        return x, dict(zip(ids.tolist(), before.tolist()))

    def _final(self, x: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """Stages 3-6 on penalized logits -> (ids, unnormalized weights) the draw is made from;
        ids None means the whole vocabulary (weights indexed by token id)."""
        p = self.params
        if p.greedy and self._infill is None:
            return np.array([int(np.argmax(x))], dtype=np.int64), np.ones(1)
        c = Candidates(x)
        for stage in self._stages:
            stage.apply(c, self)
        if self._infill is not None and p.greedy:  # llama.cpp's temperature stage keeps the max the infill left
            i = int(np.argmax(c.vals))
            return c.ids[i : i + 1], np.ones(1)
        if c.ids is None:  # no truncation: stay in float32 over the whole vocabulary
            w = self._ebuf
            np.subtract(x, np.float32(x.max()), out=w)
            if p.temperature != 1.0:
                np.multiply(w, np.float32(1.0 / p.temperature), out=w)
            np.exp(w, out=w)
            return None, w
        vals = c.vals / p.temperature
        return c.ids, np.exp(vals - vals.max())

    # ---------------------------------------------------------------- API

    def distribution(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The final distribution (candidate ids, float64 probabilities summing to 1) that `sample` would draw
        from. Without truncation the candidates are the whole vocabulary (zero-probability tokens included).
        Does not advance the RNG. With a grammar, its full mask applies."""
        user = self._disallowed
        xtc_rng = copy.deepcopy(self._xtc_rng)  # XTC's draw here is not one of the sequence's
        if self._grammar is not None:
            banned = np.logical_not(self._grammar.allowed())
            self._disallowed = banned if user is None else (banned | user)
        try:
            return self._distribution(logits)
        finally:
            self._disallowed = user
            self._xtc_rng = xtc_rng

    def _distribution(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        original = np.asarray(logits)
        x = self._constrained(original)
        if float(x.max()) == -math.inf:
            raise LocalLLMError("no token can be sampled: every token is masked or banned")
        x, _ = self._penalize(x, original)
        ids, w = self._final(x)
        if ids is None:
            ids = np.arange(self.vocab_size)
        probs = w.astype(np.float64)
        probs /= probs.sum()
        return ids, probs

    def top_needed(self) -> int:
        """How many of the largest logits this sampler's next pick needs, when it needs no others: k where the
        chain is greedy (1) or starts with top-k (then top-p and min-p at most), with no mask, bias, penalty,
        DRY, XTC or infill stage and at most k log-probabilities asked for; 0 when it needs the whole row. A
        backend may then reduce the row on its device (`TopLogits`), and `sample` takes that in its place."""
        p = self.params
        if (self._grammar is not None or self._disallowed is not None or self._bias_ids.size or self._penalties_on
                or self._dry is not None or self._infill is not None):
            return 0
        if p.greedy:
            k = 1
        elif self._stages and isinstance(self._stages[0], TopK) and all(
                isinstance(stage, (TopK, TopP, MinP)) for stage in self._stages):
            k = p.top_k
        else:
            return 0
        k = max(k, p.n_probs)
        return k if k <= TOP_LOGITS_MAX else 0

    def sample(self, logits, token: int | None = None) -> SampledToken:
        """Pick the next token from the model's raw logits (float32, shape (vocab,)), or from their reduction to
        the top `top_needed()` (`TopLogits`: the same pick and the same draw). Does not `accept` it.
        With `token`, no draw: that token (chosen elsewhere, e.g. by speculative decoding's acceptance rule) is
        returned with its logprobs."""
        if isinstance(logits, TopLogits):
            return self._sample_top(logits, token)
        g = self._grammar
        if g is None:
            return self._sample(logits, token)
        if token is None and self.params.n_probs == 0:
            picked = self._sample(logits, None)  # without the grammar first (llama.cpp's trick)
            if g.allows(picked.id):
                return picked
        user = self._disallowed
        banned = np.logical_not(g.allowed())
        self._disallowed = banned if user is None else (banned | user)
        try:
            return self._sample(logits, token)
        finally:
            self._disallowed = user

    def _sample(self, logits: np.ndarray, token: int | None) -> SampledToken:
        original = np.asarray(logits)
        x = self._constrained(original)
        if self.params.logprob or self.params.n_probs > 0 or token is not None:
            _, lse = self._log_normalizer(x)
        else:
            self._check_finite_max(x)
            lse = None
        top: list[tuple[int, float]] = []
        if self.params.n_probs > 0:
            top_ids = top_k_ids(x, self.params.n_probs)
            top_vals = x[top_ids]
            top = [(int(t), float(v) - lse) for t, v in zip(top_ids, top_vals) if v != -np.inf]
        x, changed = self._penalize(x, original)
        if token is not None:
            token = int(token)
            raw = changed.get(token, float(x[token]))
            return SampledToken(id=token, logprob=float(raw) - lse, top_logprobs=top)
        ids, w = self._final(x)
        if w.shape[0] == 1:
            i = 0
        else:
            cum = np.cumsum(w, dtype=np.float64)
            target = self._rng.random() * cum[-1]
            i = min(int(np.searchsorted(cum, target, side="right")), w.shape[0] - 1)
        token = i if ids is None else int(ids[i])
        if lse is None:
            return SampledToken(id=token, logprob=None, top_logprobs=top)
        raw = changed.get(token)
        if raw is None:
            raw = float(x[token])
        return SampledToken(id=token, logprob=float(raw) - lse, top_logprobs=top)


    def _sample_top(self, t: TopLogits, token: int | None) -> SampledToken:
        """sample() on a row reduced to its top k (top_needed): the whole row's chain, stage for stage, on the
        candidates it would have cut the row to (top-k keeps exactly these, in this order), and its
        log-probabilities against the whole row's log-sum-exp."""
        p = self.params
        k = self.top_needed()
        if token is not None or not k or len(t) < min(k, t.vocab) or t.vocab != self.vocab_size:
            raise ValueError(f"a row reduced to its top {len(t)} cannot serve this sampler (it needs {k or 'all'})")
        if t.nans or math.isnan(t.max):
            raise ModelFileError("the model computed NaN logits: its weights or hyperparameters are broken")
        if t.max == -math.inf:
            raise LocalLLMError("no token can be sampled: every token is masked or banned")
        lse = t.lse if p.logprob or p.n_probs > 0 else None
        top = [(int(i), float(v) - lse) for i, v in zip(t.ids[:p.n_probs], t.vals[:p.n_probs]) if v != -np.inf]
        if p.greedy:
            i, ids = 0, t.ids
        else:
            c = Candidates(None)
            c.ids, c.vals, c.is_sorted = t.ids[:p.top_k], t.vals[:p.top_k].astype(np.float64), True
            for stage in self._stages[1:]:
                stage.apply(c, self)
            vals = c.vals / p.temperature
            w = np.exp(vals - vals.max())
            i, ids = 0, c.ids
            if w.shape[0] > 1:  # one candidate: no draw, as in _sample
                cum = np.cumsum(w, dtype=np.float64)
                target = self._rng.random() * cum[-1]
                i = min(int(np.searchsorted(cum, target, side="right")), w.shape[0] - 1)
        token = int(ids[i])
        raw = float(t.vals[int(np.flatnonzero(t.ids == token)[0])])
        return SampledToken(id=token, logprob=None if lse is None else raw - lse, top_logprobs=top)


class Candidates:
    """What stages 3-5b pass along: the penalized logits `x` over the whole vocabulary, and the candidates left
    (`ids`, their logits `vals` as float64; ids None: every token, values x). Sorted candidates are ordered by
    decreasing logit then increasing id; unsorted ones by id."""

    __slots__ = ("x", "ids", "vals", "is_sorted")

    def __init__(self, x: np.ndarray):
        self.x, self.ids, self.vals, self.is_sorted = x, None, None, False

    def all(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, vals), the whole vocabulary spelled out where no stage has cut it yet."""
        if self.ids is None:
            return np.arange(self.x.shape[0]), self.x.astype(np.float64)
        return self.ids, self.vals


class TopK:
    """Stage 3: keep the k largest logits (llama.cpp's `top_k`)."""

    def apply(self, c: Candidates, sampler: "Sampler") -> None:
        c.ids = top_k_ids(c.x, sampler.params.top_k)
        c.vals = c.x[c.ids].astype(np.float64)
        c.is_sorted = True


class TopP:
    """Stage 4: the smallest prefix, by decreasing probability, whose softmax mass reaches top_p (`top_p`)."""

    def apply(self, c: Candidates, sampler: "Sampler") -> None:
        top_p = sampler.params.top_p
        if c.ids is not None:
            keep = _top_p_count(c.vals, top_p)
            c.ids, c.vals = c.ids[:keep], c.vals[:keep]
        else:
            c.ids, c.vals, c.is_sorted = self.full(c.x, top_p, sampler._ebuf)

    @staticmethod
    def full(x: np.ndarray, top_p: float, e: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
        """Top-p over the whole vocabulary. Like llama.cpp, first try the best few hundred tokens; if they do
        not reach p, sort the values (not the ids: a value sort is several times faster than an argsort) to
        find the cut, then collect the ids above it (returned unsorted, by id). `e`: a vocabulary-sized buffer."""
        n = x.shape[0]
        m = float(x.max())
        np.subtract(x, np.float32(m), out=e)
        np.exp(e, out=e)
        total = float(e.sum(dtype=np.float64))
        for k in _TOP_P_FIRST_TRY:
            if k >= n:
                break
            ids = top_k_ids(x, k)
            vals = x[ids].astype(np.float64)
            cum = np.cumsum(np.exp(vals - m)) / total
            if cum[-1] >= top_p:
                keep = int(np.searchsorted(cum, top_p, side="left")) + 1
                return ids[:keep], vals[:keep], True
        sv = np.sort(x)[::-1]
        np.subtract(sv, np.float32(m), out=e)
        np.exp(e, out=e)
        cum = np.cumsum(e, dtype=np.float64)
        cum /= cum[-1]
        keep = min(int(np.searchsorted(cum, top_p, side="left")) + 1, n)
        boundary = sv[keep - 1]
        cand = np.flatnonzero(x >= boundary)
        cand, vals = _keep_lowest_ties(cand, x[cand], keep)
        return cand, vals.astype(np.float64), False


class MinP:
    """Stage 5: keep tokens with p >= min_p * p_max, i.e. logit >= max logit + log(min_p) (`min_p`)."""

    def apply(self, c: Candidates, sampler: "Sampler") -> None:
        min_p = sampler.params.min_p
        if c.ids is None:
            thr = np.float32(float(c.x.max()) + math.log(min_p))
            c.ids = np.flatnonzero(c.x >= thr)
            c.vals = c.x[c.ids].astype(np.float64)
        elif c.is_sorted:
            thr = c.vals[0] + math.log(min_p)
            keep = max(1, int(np.count_nonzero(c.vals >= thr)))
            c.ids, c.vals = c.ids[:keep], c.vals[:keep]
        else:
            sel = c.vals >= c.vals.max() + math.log(min_p)
            c.ids, c.vals = c.ids[sel], c.vals[sel]


class Xtc:
    """Stage 5a, XTC ("exclude top choices"), as llama.cpp's llama_sampler_xtc_apply: with probability
    xtc_probability (a draw from the sampler's XTC generator), of the candidates whose softmax probability is
    >= xtc_threshold, all but the least likely are removed (nothing happens when fewer than two reach it)."""

    def apply(self, c: Candidates, sampler: "Sampler") -> None:
        p = sampler.params
        n = c.x.shape[0] if c.ids is None else c.ids.shape[0]
        if n < 2 or float(sampler._xtc_rng.random()) > p.xtc_probability:
            return
        ids, vals = c.all()
        probs = np.exp(vals - vals.max())
        probs /= probs.sum()
        above = np.flatnonzero(probs >= p.xtc_threshold)
        if above.shape[0] < 2:
            return
        # llama.cpp sorts by decreasing probability and keeps from the last one above the threshold on; ties
        # by id keep it reproducible
        order = np.lexsort((ids[above], -vals[above]))
        drop = np.zeros(ids.shape[0], dtype=bool)
        drop[above[order[:-1]]] = True
        keep = ~drop
        c.ids, c.vals = ids[keep], vals[keep]


class InfillStage:
    """Stage 5b: llama.cpp's `infill` sampler (src/llama-sampler.cpp, llama_sampler_infill_apply) for fill-in-the-middle:
    end the middle when the model leans to ending it, and otherwise keep only the few tokens it is sure of.
    It works on the candidates earlier stages left (llama.vim and llama.vscode put it after top-k 40 and
    top-p); without such a cut, prefixes are folded among the 256 likeliest tokens only (llama.cpp compares
    every pair, which on a whole vocabulary takes minutes per token)."""

    MAX_FOLD = 256

    def __init__(self, vocab):
        if vocab is None:
            raise LocalLLMError("the infill sampler needs the model's vocabulary")
        self.eog = np.fromiter(sorted(vocab.eog_ids), dtype=np.int64)
        end = vocab.eot_id if vocab.eot_id is not None else vocab.eos_id
        if end is None:
            raise LocalLLMError("the infill sampler needs an end-of-text token, and this model has none")
        self.end = int(end)
        self._piece = vocab.piece_bytes
        self._pieces: dict[int, bytes] = {}

    def piece(self, t: int) -> bytes:
        b = self._pieces.get(t)
        if b is None:
            b = self._pieces[t] = self._piece(t, False)  # control tokens are empty, as llama.cpp renders them
        return b

    def apply(self, c: Candidates, sampler: "Sampler") -> None:
        """The candidates -> what is left of them."""
        c.ids, c.vals = self.keep(*c.all(), c.is_sorted and c.ids is not None)
        c.is_sorted = True

    def keep(self, ids: np.ndarray, vals: np.ndarray, is_sorted: bool) -> tuple[np.ndarray, np.ndarray]:
        """(candidate ids, their logits as float64) -> what is left of them."""
        if not is_sorted:  # llama.cpp sorts by decreasing logit; ties by id keep it reproducible
            order = np.lexsort((ids, -vals))
            ids, vals = ids[order], vals[order]
        live = vals > -np.inf  # banned tokens are not candidates (llama.cpp counts them in n, at p = 0)
        if not live.all():
            ids, vals = ids[live], vals[live]
        p = np.exp(vals - vals[0])
        p /= p.sum()
        eog = np.isin(ids, self.eog)
        p_eog = float(p[eog].sum())
        if 3.0 * p_eog * ids.shape[0] > float(p.sum()) - p_eog:
            return ids[eog], vals[eog]
        # Fold tokens whose text starts another's into the likelier one (llama.cpp's order of comparisons).
        m = min(ids.shape[0], self.MAX_FOLD)
        pieces = [self.piece(int(t)) for t in ids[:m]]
        gone = np.zeros(ids.shape[0], dtype=bool)
        for i0 in range(m):
            for i1 in range(m):
                if gone[i0]:
                    break
                if i0 == i1 or gone[i1]:
                    continue
                a, b = pieces[i0], pieces[i1]
                if a and len(a) <= len(b) and b.startswith(a):
                    dst, src = (i1, i0) if p[i1] > p[i0] else (i0, i1)
                    p[dst] += p[src]
                    p[src] = 0.0
                    gone[src] = True
        keep = ~gone & ((p >= 0.2) | eog)
        n_text = int(np.count_nonzero(keep & ~eog))
        if n_text == 0:
            return np.array([self.end], dtype=np.int64), np.ones(1)
        q = np.where(keep, p, 0.0)
        q /= q.sum()
        keep &= (q >= 1.0 / (n_text + 1)) | eog
        return ids[keep], vals[keep]


def _top_p_count(sorted_vals: np.ndarray, top_p: float) -> int:
    """How many of the candidates (sorted by decreasing logit) top-p keeps: the smallest prefix whose softmax
    mass reaches top_p (at least one)."""
    probs = np.exp(sorted_vals - sorted_vals[0])
    cum = np.cumsum(probs)
    cum /= cum[-1]
    keep = int(np.searchsorted(cum, top_p, side="left")) + 1
    return min(max(keep, 1), sorted_vals.shape[0])


class _DryStage:
    """llama.cpp's DRY sampler (src/llama-sampling.cpp, llama_sampler_dry_apply; from koboldcpp): the state is
    the last dry_penalty_last_n accepted tokens; `penalties` gives the logit decrements for the next draw."""

    def __init__(self, params: SamplingParams, vocab):
        self.multiplier = float(params.dry_multiplier)
        self.base = float(params.dry_base)
        self.allowed = int(params.dry_allowed_length)
        last_n = int(params.dry_penalty_last_n)
        self.tokens: deque[int] = deque(maxlen=None if last_n < 0 else last_n)
        # max_exponent as llama.cpp computes it (an int: the float quotient truncated)
        self.max_exponent = int(_FLOAT_MAX_LOG / math.log(self.base)) if self.base > 1.000001 else 0
        # head token -> the tails (token tuples) that complete a breaker after it; () is a whole breaker
        self.breakers: dict[int, list[tuple[int, ...]]] = (
            dry_breakers(vocab, params.dry_sequence_breakers) if vocab is not None else {})
        self.single = np.fromiter((h for h, tails in self.breakers.items() if () in tails), dtype=np.int64)

    def rep_limit(self, toks: list[int]) -> int:
        """Step 1: how far back a repeat may reach: to just after the newest breaker."""
        n = len(toks)
        last = n - 1
        for i in range(n):
            tails = self.breakers.get(toks[last - i])
            if tails is None:
                continue
            longest = -1
            for tail in tails:
                k = len(tail)
                if longest < k <= i and all(tail[o] == toks[last - i + o + 1] for o in range(k)):
                    longest = k
            if longest >= 0:
                return i - longest
        return n

    def penalties(self, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, float32 amounts to subtract from their logits)."""
        none = (np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32))
        n = len(self.tokens)
        if n <= self.allowed:
            return none
        toks = list(self.tokens)
        limit = self.rep_limit(toks)
        if limit < self.allowed:
            return none
        # Step 2: count[j] = min(length of the longest common suffix of toks[:j+1] and toks, limit), what
        # llama.cpp's reversed Z-algorithm computes. Lengths past allowed + max_exponent give the same (clamped)
        # penalty, so the search stops there.
        cap = limit if self.max_exponent <= 0 else min(limit, max(self.allowed, 0) + self.max_exponent)
        a = np.asarray(toks, dtype=np.int64)
        last = n - 1
        count = np.zeros(n, dtype=np.int64)
        active = np.flatnonzero(a[:last] == a[last]) if cap > 0 else np.empty(0, dtype=np.int64)
        d = 0
        while active.size:
            count[active] = d + 1
            d += 1
            if d >= cap:
                break
            active = active[active >= d]
            active = active[a[active - d] == a[last - d]]
        # Step 3: the token after each match of length >= allowed would extend it; keep the longest per token.
        pos = np.flatnonzero(count[:last] >= self.allowed)
        if pos.size == 0:
            return none
        nxt = a[pos + 1]
        lens = count[pos]
        order = np.lexsort((lens, nxt))
        nxt, lens = nxt[order], lens[order]
        last_of = np.flatnonzero(np.r_[nxt[1:] != nxt[:-1], True])
        ids, lens = nxt[last_of], lens[last_of]
        # Step 4: a single-token breaker is never penalized.
        ok = (ids >= 0) & (ids < vocab_size)
        if self.single.size:
            ok &= ~np.isin(ids, self.single)
        ids, lens = ids[ok], lens[ok]
        exp = lens - self.allowed
        if self.max_exponent > 0:
            exp = np.minimum(exp, self.max_exponent)
        amounts = (self.multiplier * np.power(self.base, exp.astype(np.float64))).astype(np.float32)
        return ids, amounts


def dry_breakers(vocab, breakers) -> dict[int, list[tuple[int, ...]]]:
    """llama.cpp's processing of DRY sequence breakers (get_overlapping_token_sequences): every token whose text
    contains a breaker is a whole breaker by itself; a token whose text ends with the start of a breaker is a
    head, with the rest of the breaker tokenized (at most 20 tokens) as its tail. Breakers are cut to 40 bytes;
    empty ones are skipped. Cached on the vocabulary (a pass over every token's text)."""
    key = tuple(breakers)
    cache = getattr(vocab, "_dry_breakers_cache", None)
    if cache is None:
        cache = {}
        try:
            vocab._dry_breakers_cache = cache
        except AttributeError:
            pass
    hit = cache.get(key)
    if hit is not None:
        return hit
    pieces = getattr(vocab, "_dry_pieces", None)
    if pieces is None:
        pieces = [vocab.piece_bytes(t, True) for t in range(vocab.vocab_size)]
        try:
            vocab._dry_pieces = pieces
        except AttributeError:
            pass
    out: dict[int, list[tuple[int, ...]]] = {}
    for b in key:
        s = b.encode("utf-8")[:_DRY_MAX_CHAR_LEN]
        if not s:
            continue
        first = s[:1]
        for t, word in enumerate(pieces):
            if s in word:
                tails = out.setdefault(t, [])
                if () not in tails:
                    tails.append(())
                continue
            pos = word.find(first)
            while pos != -1:
                # the word's end, from pos, is a prefix of the breaker
                rest = len(word) - pos
                if rest < len(s) and word[pos:] == s[:rest]:
                    tail = tuple(vocab.encode(s[rest:].decode("utf-8", errors="replace"), add_special=False,
                                              parse_special=False)[:_DRY_MAX_SEQ_LEN])
                    tails = out.setdefault(t, [])
                    if tail not in tails:
                        tails.append(tail)
                pos = word.find(first, pos + 1)
    cache[key] = out
    return out
