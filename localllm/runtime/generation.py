"""Generation: one answer's state (`Generation`), the rounds that produce it (`Run`), and the one driver that
evaluates every round (`Driver`).

Every answer, whoever asks for it, is produced the same way: a `Run` is asked, round after round, which tokens
its sequence needs evaluated (`plan`: a chunk of the prompt, the token just chosen, or that token and a
speculative draft), the `Driver` evaluates the plans of all the runs of a step in ONE `Engine.evaluate_batch`
call, and each run turns its rows of logits into events (`finish`). `Engine.generate` is the driver with one
run; the server's scheduler (localllm/server/scheduler.py) is the driver with every running request. Plain
decoding is speculative decoding whose draft is always empty (`Decoding` has `SpeculativeRun`'s interface), so
the two share every line of the round above them. The kernels are batch invariant, so an answer is bitwise the
same whichever runs share its steps.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import numpy as np

from localllm.chat.sampling import Sampler, SamplingParams
from localllm.chat.stop import StopMatcher
from localllm.errors import LocalLLMError
from localllm.runtime.cache_reuse import Splice
from localllm.runtime.speculative import SpeculationParams

log = logging.getLogger("localllm.generation")

# Prompt tokens evaluated per step: a lone prompt's chunk, or the budget the prompts being read share in a server
# step. It bounds attention-score memory (rows x keys floats per head), and in a server it bounds how long the
# streams already decoding wait for one step.
PROMPT_CHUNK = 256


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


class Generation:
    """One answer being generated: its sampler, detokenizer, stop strings, context handling and timings.

    It evaluates nothing itself: a `Run` (below) decides what each round's forward evaluates for it, and the
    `Driver` runs that forward, for one run (`Engine.generate`) or for the server's many in one batched call.
    """

    def __init__(self, engine, tokens: list[int], params: GenerationParams, seq):
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
        self.donor = None  # chunk-level KV reuse: where spliced chunks come from (start_prefill)
        self.splices: list[Splice] = []

    def start_prefill(self) -> list[int]:
        """The prompt tokens after the longest cached prefix (`Run` evaluates them, in chunks). With the engine's
        cache reuse on, some of them may be spliced from a donor instead: before each forward call `splice_due()`
        (then drop that many tokens from the front) and evaluate at most `until_splice()` tokens."""
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


class Decoding:
    """Plain decoding as a round of `SpeculativeRun`'s interface with no draft: `begin(logits)` after the
    prompt, `plan()` (the pending token, or None when it ends the answer), `finish(logits)` (the pending event
    handed out, the next one chosen)."""

    def __init__(self, gen: Generation):
        self.gen = gen
        self.pending: TokenEvent | None = None

    def begin(self, logits: np.ndarray) -> None:
        self.gen.end_prefill()
        self.pending = self.gen.step(logits)

    def plan(self) -> list[int] | None:
        return None if self.pending.finish_reason is not None else [self.pending.token]

    def finish(self, logits: np.ndarray | None) -> list[TokenEvent]:
        event = self.pending
        self.gen.record(event)  # after the forward that evaluated its token: a token's time includes it
        if logits is not None:
            self.pending = self.gen.step(logits)
        return [event]

    def close(self) -> None:
        pass


class Run:
    """One answer as rounds: `plan(budget)` names the tokens this round evaluates on `seq` (None: no forward, the
    pending event ends the answer), then `finish(logits)` takes the forward's result and returns the events to
    hand out. Phases: the prompt (chunks of at most `budget` tokens, chunks a donor holds spliced in instead),
    then decoding, plain (`Decoding`) or speculative (`SpeculativeRun`). The first token is handed out as soon as
    it is chosen, before the forward that feeds it back: the time to first token is the prompt's alone. Every
    later token goes out after its forward. `finished` once the final event is out (or, with max_tokens 0, once
    the prompt is read: llama.cpp's n_predict 0 warms the cache and generates nothing).

    Creating a run reads nothing yet: it checks the prompt, reuses the sequence's cached prefix and picks a donor.
    `close()` gives back what the run holds besides its sequence (the draft model's sequence, the donor)."""

    def __init__(self, engine, tokens: list[int], params: GenerationParams, seq,
                 speculation: SpeculationParams | None = None):
        if speculation is not None and params.speculation is None and params.max_tokens != 0:
            params = replace(params, speculation=speculation)  # the server's --spec, for requests without their own
        self.gen = gen = Generation(engine, tokens, params, seq)
        self.seq = seq
        self.decoding = engine.speculative_run(gen) if params.speculation is not None else Decoding(gen)
        try:
            self.prompt = gen.start_prefill()  # the prompt tokens still to read
        except BaseException:
            self.decoding.close()
            raise
        self.t_start = time.perf_counter()
        self.finished = False
        self.prompt_logits: np.ndarray | None = None  # the last prompt token's, once the prompt is read
        self._early: TokenEvent | None = None  # the first event, handed out before its forward
        self._chunk = 0
        self._positions = None
        self.prompt_read = 0  # prompt tokens the last round evaluated

    @property
    def reading_prompt(self) -> bool:
        return bool(self.prompt)

    @property
    def speculative(self) -> bool:
        return not isinstance(self.decoding, Decoding)

    def plan(self, budget: int = PROMPT_CHUNK) -> tuple | None:
        """This round's evaluation as an `Engine.evaluate_batch` item (seq, tokens) or (seq, tokens, logit
        positions); None when there is nothing to evaluate (the final event is due: `finish(None)`), or when the
        prompt waits for a budget (`budget` 0)."""
        self.prompt_read = 0
        if self.prompt:
            if budget <= 0:
                return None
            self.prompt = self.prompt[self.gen.splice_due():]  # chunks a donor holds are copied in, not computed
            chunk = self.prompt[: min(budget, self.gen.until_splice())]
            self._chunk = len(chunk)
            return (self.seq, chunk)
        tokens = self.decoding.plan()
        if tokens is None:
            return None
        self._positions = None if isinstance(self.decoding, Decoding) else range(len(tokens))
        return (self.seq, tokens) if self._positions is None else (self.seq, tokens, self._positions)

    def top_needed(self) -> int:
        """For this round's plan: how many of its row's largest logits the next pick needs (Sampler.top_needed), 0
        for the whole row: a prompt (its last logits are kept: prompt_logits) and a speculative round (its
        acceptance rule reads whole distributions) always take the row."""
        if self.prompt or self.speculative:
            return 0
        return self.gen.sampler.top_needed()

    def finish(self, logits) -> list[TokenEvent]:
        """The events of this round, from the rows the driver got for its plan (None when `plan` gave none; a
        TopLogits where the round's top_needed allowed it)."""
        if self.prompt:
            self.prompt = self.prompt[self._chunk:]
            self.prompt_read = self._chunk
            if self.prompt:
                return []
            self.prompt_logits = logits
            gen = self.gen
            if gen.params.max_tokens == 0:
                gen.end_prefill()
                gen.timings.prompt_ms = 1000 * (time.perf_counter() - self.t_start)
                self.finished = True
                return []
            self.decoding.begin(logits)  # a drafter reads the prompt too; the first token is picked
            gen.timings.prompt_ms = 1000 * (time.perf_counter() - self.t_start)
            first = self.decoding.pending
            if first.finish_reason is not None:
                return []  # the next round hands it out (no forward)
            self._early = first
            return [first]
        events = self.decoding.finish(logits)
        if events and events[0] is self._early:
            events = events[1:]
            self._early = None
        if events and events[-1].finish_reason is not None:
            self.finished = True
        return events

    def close(self) -> None:
        self.decoding.close()
        self.gen.release_donor()


class Driver:
    """Evaluates a step of runs: every run's plan in one `Engine.evaluate_batch` call (prompt chunks sharing a
    budget of PROMPT_CHUNK tokens, in the runs' order), then each run's `finish`. A run's failure (in its plan,
    its finish, or its part of the forward) is that run's alone: when the batched forward fails, each run's
    item is evaluated again by itself, after rolling its sequence back, and only the ones that fail again fail,
    the others with exactly the logits the batch would have given them."""

    def __init__(self, engine):
        self.engine = engine

    def step(self, runs: list[Run]) -> list[tuple[list[TokenEvent], BaseException | None]]:
        """(events, error) per run, in order."""
        out: list = [([], None) for _ in runs]
        items, owners, tops = [], [], []
        decode = [i for i, r in enumerate(runs) if not r.reading_prompt]
        prompt = [i for i, r in enumerate(runs) if r.reading_prompt]
        budget = PROMPT_CHUNK
        for i in decode + prompt:
            r = runs[i]
            try:
                item = r.plan(budget)
            except Exception as e:
                out[i] = ([], e)
                continue
            if item is None:
                if not r.reading_prompt:
                    out[i] = self._finish(r, None)
                continue
            if r.reading_prompt:
                budget -= len(item[1])
            items.append(item)
            owners.append(i)
            tops.append(r.top_needed())
        for i, logits in zip(owners, self._evaluate(items, owners, out, tops)):
            if out[i][1] is None:
                out[i] = self._finish(runs[i], logits)
        return out

    @staticmethod
    def _finish(run: Run, logits) -> tuple[list[TokenEvent], BaseException | None]:
        try:
            return run.finish(logits), None
        except Exception as e:
            return [], e

    def _evaluate(self, items: list, owners: list[int], out: list, tops: list[int]) -> list:
        if not items:
            return []
        lengths = [len(item[0].tokens) for item in items]
        try:
            return self.engine.evaluate_batch(items, tops)
        except Exception as e:
            if len(items) == 1:
                out[owners[0]] = ([], e)
                return [None]
            log.warning("a batched forward of %d requests failed; running them one by one", len(items),
                        exc_info=True)
        results = []
        for item, n, i, top in zip(items, lengths, owners, tops):
            seq = item[0]
            try:
                if len(seq.tokens) != n:
                    seq.truncate(n)
                results.append(self.engine.evaluate_batch([item], [top])[0])
            except Exception as e:
                out[i] = ([], e)
                results.append(None)
        return results

    def run_alone(self, run: Run):
        """Drive one run to its end: its events as they come; the run's error, if it fails, raised here."""
        while not run.finished:
            [(events, error)] = self.step([run])
            if error is not None:
                raise error
            yield from events

    def read_prompt(self, run: Run) -> np.ndarray:
        """Drive one run through its prompt (its first token is then chosen, not yet evaluated); returns the last
        prompt token's logits (scoring a continuation from there, measuring what a prompt cost)."""
        while run.reading_prompt:
            [(_, error)] = self.step([run])
            if error is not None:
                raise error
        return run.prompt_logits
