"""Client grammars and schemas compiled where they can be stopped: worker processes with a time and a memory
budget, behind a bounded queue.

llguidance's own limits (LLParserLimits) bound its lexer and parser, not the time a grammar takes to compile:
2,000 self-doubling GBNF rules (40 KB) take 28 s in its Rust code, which holds the calling thread and cannot be
interrupted; six such requests held every worker thread of the server. So a server compiles a client's grammar
in two steps:

1. In a worker process (`python -m localllm.chat.grammar_worker`, a few started on demand and kept): the grammar or
   schema is converted to llguidance's grammar text, validated, and built for a vocabulary of bytes (what
   fails only when built, such as llguidance's bound on grammar symbols, fails here), which is where a
   hostile grammar spends its time and memory. The process has COMPILE_MEMORY bytes of address space; one that
   takes longer than COMPILE_SECONDS, or whose client goes away, is killed (and another started when needed).
2. In the server, the validated text is built for the model's vocabulary on a thread pool of its own
   (`MATCHER_THREADS`), never the default pool that tokenization and the other off-loop work use.

At most WORKERS compiles run at once and QUEUE wait; a request beyond that is refused at once with
`GrammarBusy` (the server answers 503 with Retry-After). Messages: length-prefixed JSON over the worker's
stdin and stdout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import json
import os
import signal
import struct
import sys
import time

from localllm.errors import LocalLLMError

COMPILE_SECONDS = 10.0  # a grammar compiling longer than this in a worker is refused (400)
COMPILE_MEMORY = 2 << 30  # a worker's address space: python + llguidance is ~0.3 GB of it
WORKERS = 2  # compiles at once
QUEUE = 8  # compiles waiting for a worker; more are refused with 503
RETRY_AFTER = 2  # seconds, in the 503's Retry-After
MATCHER_THREADS = 2
MAX_MESSAGE = 64 << 20

_HEADER = struct.Struct("<I")


class ClientGone(LocalLLMError):
    """The request's client disconnected while its grammar compiled (the compile was stopped). A LocalLLMError, so
    the handler ends with an error response nobody reads, not an exception in the server's log."""


class GrammarBusy(LocalLLMError):
    """Every grammar worker is busy and the queue is full: try again in RETRY_AFTER seconds."""

    retry_after = RETRY_AFTER


# ---- the worker process ------------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """SIGKILL when the server exits, even mid-compile (Linux's PR_SET_PDEATHSIG)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _limit_memory() -> None:
    with contextlib.suppress(Exception):
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (COMPILE_MEMORY, COMPILE_MEMORY))


def _read(stream) -> dict | None:
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(head)
    return json.loads(stream.read(n))


def _write(stream, obj: dict) -> None:
    data = json.dumps(obj, ensure_ascii=True).encode()
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _validate(request: dict) -> dict:
    from localllm.chat.grammar import check_buildable, compile_grammar

    specials = tuple(request.pop("specials", ()))
    try:
        v = compile_grammar(None, 0, **request)
        if v is None:
            return {"none": True}
        check_buildable(v, specials)  # what fails only when built fails here, within the worker's budget
        return {"text": v.text, "kind": v.kind}
    except LocalLLMError as e:
        return {"error": str(e)}
    except MemoryError:
        return {"error": "the grammar needs more memory to compile than a client's grammar may have",
                "memory": True}
    except RecursionError:
        return {"error": "the grammar or schema is nested too deeply"}


def main() -> None:
    _die_with_parent()
    with contextlib.suppress(OSError):
        os.nice(19)  # a client's grammar yields the cores to the server's forward passes
    os.environ["RUST_BACKTRACE"] = "0"
    _limit_memory()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's Ctrl-C is the server's to handle
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write into the message stream
    import localllm.chat.grammar  # noqa: F401  (imported before the first request, not during it)

    _write(stdout, {"ready": True})
    while (request := _read(stdin)) is not None:
        _write(stdout, _validate(request))


# ---- the server's side --------------------------------------------------------------------------------------


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    @classmethod
    async def start(cls) -> "_Worker":
        env = {**os.environ, "RUST_BACKTRACE": "0", "RUST_LIB_BACKTRACE": "0", "PYTHONUNBUFFERED": "1"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "localllm.chat.grammar_worker", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=env, start_new_session=True)
        worker = cls(proc)
        try:
            ready = await asyncio.wait_for(worker._receive(), 60)
        except BaseException:
            worker.kill()
            raise
        if not ready or not ready.get("ready"):
            worker.kill()
            raise LocalLLMError("the grammar worker did not start")
        return worker

    async def _receive(self) -> dict | None:
        try:
            head = await self.proc.stdout.readexactly(_HEADER.size)
            (n,) = _HEADER.unpack(head)
            if n > MAX_MESSAGE:
                return None
            return json.loads(await self.proc.stdout.readexactly(n))
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            return None

    async def ask(self, request: dict) -> dict | None:
        """The worker's answer, or None if it died."""
        data = json.dumps(request, ensure_ascii=True).encode()
        try:
            self.proc.stdin.write(_HEADER.pack(len(data)) + data)
            await self.proc.stdin.drain()
        except (ConnectionError, RuntimeError):
            return None
        return await self._receive()

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, OSError):
            self.proc.kill()
        loop = self.proc._loop if hasattr(self.proc, "_loop") else None
        transport = getattr(self.proc, "_transport", None)
        if transport is not None and loop is not None and not loop.is_closed():
            # its pipes closed on its loop's thread (the loop reaps the process)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(transport.close)


class GrammarPool:
    """Worker processes for one event loop (the server's)."""

    def __init__(self, workers: int | None = None, queue: int | None = None, seconds: float | None = None):
        self.size = workers or WORKERS
        self.queue = QUEUE if queue is None else queue
        self._seconds = seconds
        self.idle: list[_Worker] = []
        self.active: set[_Worker] = set()
        self.running = 0  # compiles holding a slot
        self.waiting = 0
        self.slots = asyncio.Semaphore(self.size)
        self.matchers = concurrent.futures.ThreadPoolExecutor(MATCHER_THREADS, thread_name_prefix="grammar")
        self.closed = False

    @property
    def seconds(self) -> float:
        return self._seconds or COMPILE_SECONDS

    @property
    def busy(self) -> bool:
        """No compile would start now: every worker is busy and the queue is full."""
        return self.running >= self.size and self.waiting >= self.queue

    async def validate(self, request: dict, cancelled: asyncio.Future | None = None) -> dict:
        """The worker's answer for `request` (compile_grammar's keywords). Raises GrammarBusy when the queue is
        full, LocalLLMError when the compile runs out of time or memory, ClientGone when `cancelled`
        completes first (the client went away)."""
        if self.closed:
            raise LocalLLMError("the server is stopping")
        if self.running >= self.size and self.waiting >= self.queue:
            raise GrammarBusy(f"{self.running} grammars are compiling and {self.waiting} waiting: try again")
        self.waiting += 1
        acquiring = asyncio.ensure_future(self.slots.acquire())
        try:
            await self._wait(acquiring, cancelled)
        except BaseException:
            if acquiring.done() and not acquiring.cancelled() and acquiring.exception() is None:
                self.slots.release()  # acquired just as the client went
            raise
        finally:
            self.waiting -= 1
        self.running += 1
        if self.closed:
            self.running -= 1
            self.slots.release()
            raise LocalLLMError("the server is stopping")
        worker = None
        try:
            while self.idle and not self.idle[-1].alive:  # one that died idle (killed from outside)
                self.idle.pop().kill()
            worker = self.idle.pop() if self.idle else await self._wait(_Worker.start(), cancelled)
            self.active.add(worker)
            t0 = time.monotonic()
            try:
                answer = await self._wait(asyncio.wait_for(worker.ask(request), self.seconds), cancelled)
            except asyncio.TimeoutError:
                worker.kill()
                self.active.discard(worker)
                worker = None
                raise LocalLLMError(f"the grammar did not compile within {self.seconds:g} s: too complex for this "
                                    "server") from None
            if answer is None or answer.get("memory"):
                worker.kill()
                self.active.discard(worker)
                worker = None
                if self.closed:
                    raise LocalLLMError("the server is stopping")
                if answer is None:  # the worker died: out of memory is the likely cause
                    raise LocalLLMError(f"the grammar could not be compiled within {COMPILE_MEMORY >> 20} MiB of "
                                        f"memory (after {time.monotonic() - t0:.1f} s): too complex for this server")
            return answer
        except BaseException:
            if worker is not None:  # cancelled or failed mid-question: its state is unknown
                worker.kill()
                self.active.discard(worker)
                worker = None
            raise
        finally:
            self.active.discard(worker)
            if worker is not None and worker.alive and not self.closed:
                self.idle.append(worker)
            elif worker is not None:
                worker.kill()
            self.running -= 1
            self.slots.release()

    @staticmethod
    async def _wait(awaitable, cancelled: asyncio.Future | None):
        task = asyncio.ensure_future(awaitable)
        if cancelled is None:
            return await task
        try:
            done, _ = await asyncio.wait({task, cancelled}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        if task not in done:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise ClientGone("the client went away: its grammar's compile was stopped")
        return task.result()

    def close(self) -> None:
        """Kill every worker, compiling or idle (their compiles end with an error); safe from any thread."""
        self.closed = True
        for w in [*self.idle, *self.active]:
            w.kill()
        self.idle.clear()
        self.matchers.shutdown(wait=False, cancel_futures=True)


_pools: dict = {}


def pool() -> GrammarPool:
    """The running event loop's pool (made on first use)."""
    loop = asyncio.get_running_loop()
    p = _pools.get(loop)
    if p is None or p.closed:
        for other in [lp for lp in _pools if lp.is_closed()]:
            _pools.pop(other).close()
        p = _pools[loop] = GrammarPool()
    return p


def busy() -> bool:
    """Whether a grammar request would be refused now (for /health)."""
    with contextlib.suppress(RuntimeError):
        p = _pools.get(asyncio.get_running_loop())
        return p is not None and p.busy
    return False


# The request being answered (set by the server's endpoint wrapper): a compile stops when its client goes.
client_request: contextvars.ContextVar = contextvars.ContextVar("client_request", default=None)


async def _disconnected(request) -> None:
    """Returns when the client of `request` (whose body has been read) disconnects."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


_SPECIALS: dict = {}


def _specials(tokenizer, special_names) -> list[str]:
    """special_names(tokenizer), worked out once per tokenizer (a pass over its vocabulary)."""
    key = id(tokenizer)
    cached = _SPECIALS.get(key)
    if cached is None or cached[0] is not tokenizer:
        if len(_SPECIALS) > 16:
            _SPECIALS.clear()
        cached = _SPECIALS[key] = (tokenizer, special_names(tokenizer))
    return cached[1]


async def compile_bounded(tokenizer, n_vocab: int, **constraint):
    """compile_grammar(tokenizer, n_vocab, **constraint) for a client: the grammar or schema validated in a
    worker process (time and memory bounded, killed if the client of `client_request` goes away meanwhile),
    then built for the vocabulary on the pool's own threads. None when no constraint is given."""
    constraint = {k: v for k, v in constraint.items() if v is not None}
    if not constraint:
        return None
    from localllm.chat.grammar import Validated, matcher_for, special_names

    p = pool()
    request = client_request.get()
    gone = asyncio.ensure_future(_disconnected(request)) if request is not None else None
    try:
        # the model's special tokens go with it: a tool call's grammar names <tool_call>
        answer = await p.validate({**constraint, "specials": _specials(tokenizer, special_names)}, gone)
    finally:
        if gone is not None:
            gone.cancel()
    if "error" in answer:
        raise LocalLLMError(answer["error"])
    if answer.get("none"):
        return None
    validated = Validated(answer["text"], answer["kind"])
    loop = asyncio.get_running_loop()
    try:
        return await loop.run_in_executor(p.matchers, matcher_for, validated, tokenizer, n_vocab)
    except RuntimeError:  # the pool was closed meanwhile (the server is stopping)
        if p.closed:
            raise LocalLLMError("the server is stopping") from None
        raise


if __name__ == "__main__":
    main()
