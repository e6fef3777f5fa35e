"""The one scheduler that owns the engine: continuous batching of many requests over the paged KV cache.

The engine is not thread-safe, so it lives in one dedicated thread. HTTP handlers (asyncio) `submit` a
`Request` and read its events from a `Handle`; events cross from the engine thread to the event loop with
`loop.call_soon_threadsafe`. Each step, the scheduler:

  1. takes new requests into a FIFO queue and drops cancelled ones (queued or running: a running one's
     sequence is closed at once, so its KV blocks go back to the pool, still cached for prefix reuse);
  2. admits queued requests while fewer than `parallel` run: each gets a fresh `Sequence` and a `Run`
     (localllm/runtime/generation.py) whose prompt reuses the longest cached prefix;
  3. hands every run to the one generation driver (`Driver.step`, the same that `Engine.generate` runs with
     one run): each decoding request's pending token (and a speculative one's draft, logits wanted at each),
     plus a bounded chunk of the prompts still being read, is evaluated in ONE `Engine.evaluate_batch` call,
     so running streams keep flowing while a long prompt is read in, and each run turns its rows into events
     (a request's first token as soon as it is chosen, before the forward that feeds it back);
  4. delivers the events; finished requests leave the batch and close their sequence.

A request's error (a prompt that does not fit, a token id the model does not have, a sampler that has nothing
left to sample) ends that request only, and so does an unexpected exception while admitting it, sampling for it
or running its speculative round. When the batched forward of a step fails, each of its requests is evaluated
again alone (`Driver`): the ones that fail again end (400 for a clear error, 500 otherwise), the others go on
with exactly the logits the batch would have given them (the kernels are batch invariant).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from localllm.errors import LocalLLMError, ModelFileError
from localllm.runtime.engine import Engine
from localllm.runtime.generation import Driver, GenerationParams, Run, TokenEvent
from localllm.runtime.speculative import SpeculationParams
from localllm.server.metrics import Metrics

log = logging.getLogger("localllm.server")



@dataclass
class Request:
    tokens: list[int]
    params: GenerationParams
    slot: int = -1  # llama.cpp's id_slot: run in this slot when it is idle (see _pick_slot); -1: any


@dataclass
class Final:
    """The last item of a request's stream, after its final TokenEvent."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    stop_word: str | None
    timings: dict


class RequestFailed(Exception):
    """The scheduler could not run a request; the message is for the client."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class SlotBusy(RequestFailed):
    """A slot action asked for a slot that is running a request (the caller waits and asks again)."""


def _failure(e: Exception) -> RequestFailed:
    """What a request that raised `e` tells its client: a user-facing error's message (400, or 500 when the
    model itself is at fault, e.g. NaN logits), or, for anything else (a bug), a generic 500 with the
    traceback in the server's log."""
    if isinstance(e, LocalLLMError):
        return RequestFailed(str(e), 500 if isinstance(e, ModelFileError) else 400)
    log.error("a request failed", exc_info=e)
    return RequestFailed("internal error while generating", 500)


class Handle:
    """The event-loop side of one request: an async stream of TokenEvents, then a Final (or an exception)."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop, scheduler: "Scheduler"):
        self.request = request
        self.loop = loop
        self.scheduler = scheduler
        self.finished = False
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.submitted = time.perf_counter()
        self.slot = max(request.slot, 0)  # the slot it runs in, once admitted (llama.cpp's id_slot in answers)

    def cancel(self) -> None:
        """Stop generating (the client went away): the scheduler drops the request at its next step."""
        if not self.cancelled and not self.finished:
            self.cancelled = True
            self.scheduler.wake()

    def _put(self, item) -> None:  # engine thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is shutting down
            self.cancelled = True

    async def events(self):
        """Yields TokenEvents, then the Final. Raises RequestFailed if the request failed."""
        while True:
            item = await self.queue.get()
            if isinstance(item, Exception):
                self.finished = True
                raise item
            if isinstance(item, Final):
                self.finished = True
            yield item
            if isinstance(item, Final):
                return


@dataclass
class _Running:
    handle: Handle
    run: Run
    slot: int = 0
    t_first: float | None = None
    t_last: float | None = None

    @property
    def gen(self):
        return self.run.gen


class Scheduler:
    def __init__(self, engine: Engine, parallel: int = 4, max_queue: int = 256, metrics: Metrics | None = None,
                 speculation: SpeculationParams | None = None):
        self.engine = engine
        self.speculation = speculation
        self.parallel = max(1, int(parallel))
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        self._lock = threading.Condition()
        self._inbox: deque[Handle] = deque()
        self._waiting: deque[Handle] = deque()
        self._running: list[_Running] = []
        self._tasks: deque[tuple] = deque()  # (fn, future, loop): other engine work (embeddings), between steps
        self._stop = False
        self.live_sequences = 0
        # What each slot's last request left in the KV cache (its prompt and what it generated), and when it
        # finished: llama.cpp's slots, each holding one conversation. The blocks themselves are the pool's, shared
        # by every request that starts the same way; this record is what `/slots/N?action=save` writes and what
        # a new request without an id_slot is matched against (the free slot that shares the longest prefix
        # with its prompt, else the least recently used), so a conversation's turns keep to one slot.
        self.slot_tokens: list[list[int]] = [[] for _ in range(self.parallel)]
        self._slot_used = [0.0] * self.parallel
        self.driver = Driver(engine)
        self._thread = threading.Thread(target=self._loop, name="localllm-scheduler", daemon=True)
        self._publish()

    # ---- event-loop side -----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()
        self._thread.join(timeout=10)

    def submit(self, request: Request) -> Handle:
        if not -1 <= request.slot < self.parallel:
            raise RequestFailed(f"id_slot {request.slot}: the server has {self.parallel} slots (0 to "
                                f"{self.parallel - 1}; -1: any)")
        handle = Handle(request, asyncio.get_running_loop(), self)
        with self._lock:
            if len(self._inbox) + len(self._waiting) >= self.max_queue:
                raise RequestFailed(f"the server is busy ({self.max_queue} requests queued); retry later", 503)
            self._inbox.append(handle)
            self._lock.notify()
        self.metrics.queued = len(self._inbox) + len(self._waiting)
        return handle

    async def run(self, fn):
        """fn(engine) on the engine thread, between two steps (the running requests pause for it); its result,
        or its exception, comes back here."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if self._stop:
                raise RequestFailed("the server is shutting down", 503)
            if len(self._tasks) >= self.max_queue:
                raise RequestFailed(f"the server is busy ({self.max_queue} requests queued); retry later", 503)
            self._tasks.append((fn, future, loop))
            self._lock.notify()
        return await future

    def _run_tasks(self) -> None:  # engine thread
        while True:
            with self._lock:
                if not self._tasks:
                    return
                fn, future, loop = self._tasks.popleft()
            try:
                result, error = fn(self.engine), None
            except Exception as e:  # the task's caller gets it; the engine goes on
                result, error = None, e

            def settle(future=future, result=result, error=error):
                if future.cancelled():
                    return
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)

            loop.call_soon_threadsafe(settle)

    def slots(self) -> list[dict]:
        """What each of the `parallel` slots runs now (llama.cpp's GET /slots), read from the event loop: a
        snapshot, taken without stopping the engine thread."""
        running = {r.slot: r for r in list(self._running)}
        out = []
        for i in range(self.parallel):
            r = running.get(i)
            slot = {"id": i, "n_ctx": self.engine.ctx, "speculative": self.speculation is not None,
                    "is_processing": r is not None}
            if r is not None:
                t = r.gen.timings
                slot.update({"n_prompt_tokens": len(r.gen.tokens), "n_prompt_tokens_processed": t.prompt_n,
                             "n_prompt_tokens_cache": t.cache_n, "params": r.gen.params,
                             "next_token": [{"has_next_token": r.gen.finish_reason is None,
                                             "n_decoded": t.predicted_n}]})
            else:
                slot["n_past"] = len(self.slot_tokens[i])  # what the idle slot's cache holds
            out.append(slot)
        return out

    def busy_slots(self) -> set[int]:  # engine thread (a task run between steps)
        return {r.slot for r in self._running}

    # ---- slot files (llama.cpp's /slots/N?action=...): engine-thread tasks, run between two steps -------------

    def _idle_slot(self, slot: int) -> None:
        if not 0 <= slot < self.parallel:
            raise RequestFailed(f"no slot {slot}: the server has {self.parallel} (0 to {self.parallel - 1})")
        if slot in self.busy_slots():
            raise SlotBusy(f"slot {slot} is processing a request")

    def save_slot(self, slot: int, path) -> tuple[int, int]:
        """(tokens saved, bytes written): slot's cache written to `path` (session_file's format)."""
        from localllm.runtime import session_file

        self._idle_slot(slot)
        tokens = self.slot_tokens[slot]
        return len(tokens), session_file.save_tokens(self.engine, tokens, path)

    def restore_slot(self, slot: int, path) -> tuple[int, int]:
        """(tokens restored, bytes read): a saved cache loaded into the pool as slot's conversation, so the next
        request that starts with those tokens computes only what follows them."""
        import os

        from localllm.runtime import session_file

        self._idle_slot(slot)
        seq = session_file.load(self.engine, path)  # checked against the model before any byte is used
        self.slot_tokens[slot] = list(seq.tokens)
        self._slot_used[slot] = time.perf_counter()
        self.engine.retire(seq)  # kept as a finished request's sequence is (its blocks, the tail's too, cached)
        self._publish()
        return len(seq.tokens), os.path.getsize(path)

    def erase_slot(self, slot: int) -> int:
        """Forget slot's conversation; returns how many tokens it held. (Its blocks stay in the pool's cache,
        which every request shares, until the room is needed.)"""
        self._idle_slot(slot)
        n = len(self.slot_tokens[slot])
        self.slot_tokens[slot] = []
        return n

    def wake(self) -> None:
        with self._lock:
            self._lock.notify()

    # ---- engine thread -------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._inbox and not self._waiting and not self._running \
                        and not self._tasks:
                    self._lock.wait()
                if self._stop:
                    break
                self._waiting.extend(self._inbox)
                self._inbox.clear()
            self._run_tasks()
            if not self._waiting and not self._running:
                continue
            try:
                self._step()
            except Exception:  # a bug in a step must not stop the server: fail what was running
                log.exception("scheduler step failed")
                for r in self._running:
                    self._finish(r, RequestFailed("internal error while generating", 500))
                self._running.clear()
            self._publish()
        for r in self._running:
            self._finish(r, RequestFailed("the server is shutting down", 503))
        for h in list(self._waiting) + list(self._inbox):
            h._put(RequestFailed("the server is shutting down", 503))
        with self._lock:
            tasks, self._tasks = list(self._tasks), deque()
        for _, future, loop in tasks:
            loop.call_soon_threadsafe(lambda f=future: f.cancelled() or f.set_exception(
                RequestFailed("the server is shutting down", 503)))

    def _publish(self) -> None:
        pool = self.engine.kv_pool
        m = self.metrics
        m.active = len(self._running)
        m.queued = len(self._waiting) + len(self._inbox)
        m.live_sequences = self.live_sequences
        retained = self.engine.retained_only_blocks()
        m.kv_blocks_held = pool.blocks_held() - retained
        m.kv_blocks_idle = pool.blocks_idle()
        m.kv_blocks_retained = retained
        m.kv_bytes = pool.nbytes
        m.kv_budget_bytes = pool.budget_bytes

    def _finish(self, r: _Running, outcome) -> None:
        """Close the request's sequence and deliver its outcome (a Final or an exception), once."""
        r.run.close()  # the draft model's sequence, the donor's blocks
        if r.gen.seq is not None:
            if isinstance(outcome, Final) or getattr(outcome, "status", None) == 499:
                self.slot_tokens[r.slot] = list(r.gen.seq.tokens)
                self._slot_used[r.slot] = time.perf_counter()
                self.engine.retire(r.gen.seq)  # kept as a donor of chunks when cache reuse is on
            else:
                r.gen.seq.close()  # a failed forward: nothing of it is worth keeping
            self.live_sequences -= 1
        if outcome is not None:
            r.handle._put(outcome)

    def _pick_slot(self, request: Request, busy: set[int]) -> int | None:
        """The slot a waiting request runs in (None: none is free). The one it names if that is idle; when that
        one is busy, another idle one rather than waiting as llama-server does: the KV cache is the pool's, shared
        by every slot, so a request loses no cached prefix by running elsewhere, and llama.vim, which names slot 0
        in every request, keeps its warm-ups and keystrokes in one batched step."""
        free = [i for i in range(self.parallel) if i not in busy]
        if not free:
            return None
        if request.slot >= 0 and request.slot not in busy:
            return request.slot

        def common(i: int) -> int:
            a, b = self.slot_tokens[i], request.tokens
            n = min(len(a), len(b))
            k = 0
            while k < n and a[k] == b[k]:
                k += 1
            return k

        best = max(free, key=lambda i: (common(i), -self._slot_used[i]))
        return best if common(best) > 0 else min(free, key=lambda i: self._slot_used[i])

    def _admit(self) -> None:
        busy = self.busy_slots()
        while self._waiting and len(self._running) < self.parallel:
            handle = self._waiting.popleft()
            slot = self._pick_slot(handle.request, busy)
            busy.add(slot)
            handle.slot = slot
            seq = self.engine.new_sequence()
            self.live_sequences += 1
            try:
                run = Run(self.engine, handle.request.tokens, handle.request.params, seq, self.speculation)
            except Exception as e:  # this request only: the others are admitted as usual
                seq.close()
                self.live_sequences -= 1
                self.metrics.requests_failed += 1
                handle._put(_failure(e))
                continue
            self._running.append(_Running(handle, run, slot=slot))

    def _step(self) -> None:
        # Cancelled requests leave first: their blocks are back in the pool before anything else runs.
        for r in [r for r in self._running if r.handle.cancelled]:
            self._running.remove(r)
            self.metrics.cancelled += 1
            self._finish(r, RequestFailed("the request was cancelled", 499))
        for h in [h for h in self._waiting if h.cancelled]:
            self._waiting.remove(h)
            h._put(RequestFailed("the request was cancelled", 499))
        self._admit()
        if not self._running:
            return

        running = list(self._running)
        results = self.driver.step([r.run for r in running])
        now = time.perf_counter()
        for r, (events, error) in zip(running, results):
            if error is not None:
                self._running.remove(r)
                self.metrics.requests_failed += 1
                self._finish(r, _failure(error))
                continue
            self.metrics.prompt_tokens += r.run.prompt_read
            for event in events:
                self._deliver(r, event, now)
            if r.run.finished:
                self._running.remove(r)
                self.metrics.requests_done += 1
                t = r.gen.timings
                if r.run.speculative:
                    m = self.metrics
                    m.draft_tokens += t.draft_n
                    m.draft_accepted += t.draft_n_accepted
                    m.verifies += t.n_verifies
                # max_tokens 0 (llama.cpp's n_predict 0) is a cache warm-up: the prompt is in the KV cache now,
                # and closing the sequence leaves its blocks in the pool for the next request that starts so.
                final_reason = events[-1].finish_reason if events else "length"
                matched = r.gen.stops.matched if r.gen.stops.stopped else None
                self._finish(r, Final(final_reason, len(r.gen.tokens), t.predicted_n, t.cache_n, matched,
                                      t.to_dict()))

    def _deliver(self, r: _Running, event: TokenEvent, now: float) -> None:
        m = self.metrics
        m.generated_tokens += 1
        if r.t_first is None:
            r.t_first = now
            m.cached_tokens += r.gen.timings.cache_n
            m.ttft.observe(now - r.handle.submitted)
        else:
            m.itl.observe(now - r.t_last)
        r.t_last = now
        if event.finish_reason is not None and r.gen.timings.predicted_n > 1:
            m.tpot.observe((now - r.t_first) / (r.gen.timings.predicted_n - 1))
        r.handle._put(event)
