"""Several models behind one port: which models a server may run, which are loaded, and when they go.

`serve` with no model serves any model of the store; `serve --models A,B` serves those; `serve MODEL` serves one
(pinned, loaded before the port opens, as it always was). A request names its model in the `model` field (`?model=`
on llama.cpp's GET routes); one that names none gets the default (the first of --models, or the one model). A model
is loaded on its first request (in a worker thread: the event loop keeps serving the others) and kept while it is
used. Room for a new one is made by unloading the least recently used idle model: never one with requests in flight
(they hold a `Lease` until their response, streamed or not, has ended), never a pinned one (--pin, the single model,
or Ollama's keep_alive -1). Ollama's keep_alive sets how long a model stays after its last request (0: unloaded
once that request ends; -1: until told otherwise); an idle model past its time is unloaded by a sweep every second.

Unloading stops the model's scheduler thread (Scheduler.stop joins it), drops every reference to its engine (the
mapped GGUF closes with its last view) and hands freed heap pages back to the system (malloc_trim), so the server's
resident memory returns to what it was before the model came (tests/test_server_models.py measures it).
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import datetime as dt
import gc
import logging
import math
import os
import re
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from localllm import parameters
from localllm.errors import LocalLLMError
from localllm.server.app import ApiError, ServerState

log = logging.getLogger("localllm.server")

FOREVER = math.inf
SWEEP_S = 1.0  # how often idle models past their keep_alive are looked for
WAIT_FOR_ROOM_S = 600.0  # a request for a model that has no room waits this long for a loaded one to go idle
MEMORY_SHARE = 0.8  # of the memory available at start, what loaded models may take when --max-loaded is not given
NEVER = "2999-01-01T00:00:00Z"  # expires_at of a model that stays (Ollama shows a far future date too)

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"(-)?((?:\d+(?:\.\d*)?(?:ns|us|µs|ms|s|m|h))+)")
_PART = re.compile(r"(\d+(?:\.\d*)?)(ns|us|µs|ms|s|m|h)")


def parse_keep_alive(value, key: str = "keep_alive") -> float | None:
    """Ollama's keep_alive in seconds (FOREVER for a negative one), None when not given. A number is seconds; a
    string is a Go duration ("5m", "1h30m", "10s", "-1m") or a number of seconds ("300", "-1")."""
    if value is None:
        return None
    seconds = None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            m = _DURATION.fullmatch(text)
            if m:
                seconds = sum(float(n) * _UNITS[u] for n, u in _PART.findall(m.group(2)))
                seconds = -seconds if m.group(1) else seconds
        if seconds is not None and not math.isfinite(seconds):
            seconds = None
    if seconds is None:
        raise ApiError(400, f"'{key}' must be a duration such as \"5m\", \"30s\" or \"1h\", a number of seconds, 0 "
                            f"(unload after this request) or -1 (keep loaded); got {str(value)[:40]!r}", param=key)
    return FOREVER if seconds < 0 else seconds


def parse_duration_option(text: str) -> float:
    """--keep-alive's value: as keep_alive, a LocalLLMError when malformed."""
    try:
        return parse_keep_alive(text, "--keep-alive")
    except ApiError as e:
        raise LocalLLMError(e.message) from None


def iso(t: float) -> str:
    if t == FOREVER:
        return NEVER
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def estimate_bytes(path: Path, ctx: int | None, device: str = parameters.DEVICE) -> int:
    """What a model takes when loaded: its file (mapped, every page read once a forward has run) plus a full
    context of KV cache. Read from the GGUF's header only."""
    from localllm import backends
    from localllm.architectures import load_model_config
    from localllm.runtime.engine import DEFAULT_CTX
    from localllm.gguf_file import GGUFFile
    from localllm.runtime.kv_cache import KVPool

    size = path.stat().st_size
    try:
        with GGUFFile(path) as g:
            config = load_model_config(g)
        n = int(ctx) if ctx else min(config.context_length, DEFAULT_CTX)
        storage = backends.get(device).kv_storage()
        return size + n * KVPool.for_model(config, storage=storage).bytes_per_token
    except Exception:  # a file the loader will refuse with its own message: the file size is estimate enough
        return size


def release_memory() -> None:
    """Collect the dropped engine's cycles and give freed heap pages back to the system."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def file_key(path: Path) -> tuple:
    """One loaded engine per file: two names of one file (an alias made by /api/copy) share it."""
    try:
        st = path.stat()
        return (st.st_dev, st.st_ino)
    except OSError:
        return (str(path),)


def strip_latest(name: str) -> str:
    """Ollama clients add ':latest' to names that have no tag."""
    return name[: -len(":latest")] if name.endswith(":latest") else name


def request_name_problem(name: str) -> str | None:
    """Why a request's model name may not be looked up: a name is never a path on this machine (an absolute
    path, ~, a '..' part, a backslash, a control character) nor a URL other than the hub's."""
    if not name or len(name) > 400:
        return "a model name has 1 to 400 characters"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "a model name cannot hold control characters"
    if name.startswith(("/", "~", ".")) or "\\" in name or ".." in name.split("/"):
        return "a model name is not a path"
    scheme = name.partition("://")[0] if "://" in name else None
    if scheme is not None and scheme.lower() not in ("hf", "https", "http"):
        return f"{scheme}:// is not a model source"
    return None


@dataclass
class LoadedModel:
    name: str
    path: Path
    key: tuple
    size: int  # bytes it takes (estimate_bytes, then the file plus the engine's KV budget)
    state: ServerState | None = None  # the per-model view the API handlers get
    in_flight: int = 0
    last_used: float = field(default_factory=time.time)
    keep_alive: float = FOREVER
    pinned: bool = False  # --pin or the single model: only the operator's word unloads it
    ctx: int = 0
    n_vocab: int = 0
    held: bool = False  # a request's keep_alive -1: not unloaded for room until a request says otherwise
    gone: bool = False

    def expires_at(self) -> float:
        if self.pinned or self.keep_alive == FOREVER:
            return FOREVER
        return self.last_used + self.keep_alive if self.in_flight == 0 else time.time() + self.keep_alive


class Lease:
    """A request's hold on a loaded model: the model is not unloaded until every lease on it is released."""

    def __init__(self, registry: "ModelRegistry", model: LoadedModel, name: str):
        self.registry, self.model = registry, model
        # Responses name the model as the request did (an alias, a hub reference), as Ollama answers.
        self.state = dataclasses.replace(model.state, model_name=name) if name != model.state.model_name \
            else model.state
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.registry._release(self.model)


class ModelRegistry:
    def __init__(self, base: ServerState, *, loader, allowed: dict[str, Path] | None = None,
                 default: str | None = None, lenient: bool = False, max_loaded: int | None = None,
                 pins: list[str] = (), keep_alive: float = 300.0, ctx: int | None = None,
                 device: str = parameters.DEVICE, memory_budget: int | None = None):
        """`loader(path) -> (engine, scheduler)` loads a model (in a worker thread). `allowed`: the names this
        server serves and their files (None: any model of the store). `lenient` (one model): a name that is no
        model at all (clients send "gpt-4o", "claude-...") is answered by the default model; a name of another
        model still gets a 404. `memory_budget`: bytes loaded models may take (None: no limit)."""
        self.base = base
        self.loader = loader
        self.allowed = allowed
        self.default = default
        self.lenient = lenient
        self.max_loaded = max_loaded
        self.memory_budget = memory_budget
        self.pins = {strip_latest(p) for p in pins}
        self.keep_alive = keep_alive
        self.ctx, self.device = ctx, device
        self.models: dict[tuple, LoadedModel] = {}
        self._lock: asyncio.Lock | None = None  # one load or unload at a time (made on the server's loop)
        self._released: asyncio.Event | None = None
        self._sweeper: asyncio.Task | None = None
        self._pending: set[asyncio.Task] = set()

    # ---- names -------------------------------------------------------------------------------------------

    def available(self) -> dict[str, Path]:
        """The models this server serves: name -> file."""
        if self.allowed is not None:
            return dict(self.allowed)
        from localllm.store import local as store

        return {m.name: m.path for m in store.local_models()}

    def _listing(self) -> str:
        names = sorted(self.available())
        shown = ", ".join(names[:30]) + (f" and {len(names) - 30} more" if len(names) > 30 else "")
        return f"available: {shown}" if names else "the model store is empty (localllm pull MODEL)"

    def not_found(self, name: str, why: str = "") -> ApiError:
        return ApiError(404, f"model '{name[:200]}' not found{why}; {self._listing()}", param="model",
                        kind="invalid_request_error")

    def lookup(self, name) -> tuple[str, Path]:
        """(name, file) of the model a request names; a 404 that lists what exists when there is none."""
        from localllm.store import local as store

        if name is not None and not isinstance(name, str):
            raise ApiError(400, "'model' must be a string", param="model")
        if not name:
            if self.default is None:
                raise ApiError(400, f"'model' is required: this server runs several models ({self._listing()})",
                               param="model")
            name = self.default
        name = strip_latest(name)
        if self.allowed is not None:
            if name in self.allowed:
                return name, self.allowed[name]
            if self.lenient and not self._names_another_model(name):
                return self.default, self.allowed[self.default]
            raise self.not_found(name, " on this server")
        if problem := request_name_problem(name):
            raise self.not_found(name, f" ({problem})")
        try:
            path = store.resolve(name)
        except LocalLLMError as e:
            raise self.not_found(name, f" ({e})") from None
        models = store.paths.models_dir().resolve()
        if models not in path.resolve().parents:  # only files of the store, whatever resolve accepts
            raise self.not_found(name, " in the model store")
        return name, path

    def _names_another_model(self, name: str) -> bool:
        from localllm.store import catalog
        from localllm.store import local as store

        served = self.allowed[self.default]
        if store.has_model(name):
            try:
                return not os.path.samefile(store.model_path(name), served)
            except OSError:
                return True
        return name in catalog.entries() and Path(served).stem != name

    # ---- leases ------------------------------------------------------------------------------------------

    def loaded(self, name: str | None = None) -> LoadedModel | None:
        """A loaded model by name (None: the default if loaded, else the most recently used), without loading."""
        live = [m for m in self.models.values() if not m.gone]
        if name is None:
            if self.default is not None:
                hit = [m for m in live if m.name == self.default]
                if hit:
                    return hit[0]
            return max(live, key=lambda m: m.last_used, default=None)
        name = strip_latest(name)
        return next((m for m in live if m.name == name), None)

    async def acquire(self, name, keep_alive: float | None = None) -> Lease:
        from localllm.server.app import off_loop

        name, path = await off_loop(self.lookup, name)
        key = file_key(path)
        model = self.models.get(key)
        if model is None or model.gone:
            async with self._lock:  # (a model being unloaded is gone once the lock is free)
                model = self.models.get(key)
                if model is None:
                    model = await self._load(name, path, key)
                model.in_flight += 1  # under the lock: nothing unloads it before the request holds it
        else:
            model.in_flight += 1
        model.last_used = time.time()
        if keep_alive is not None:
            model.keep_alive = keep_alive
            model.held = keep_alive == FOREVER
        return Lease(self, model, name)

    def _release(self, model: LoadedModel) -> None:
        model.in_flight -= 1
        model.last_used = time.time()
        if self._released is not None:
            self._released.set()
        if model.in_flight == 0 and model.keep_alive == 0 and not model.pinned and not model.gone:
            task = asyncio.get_running_loop().create_task(self.unload(model))
            self._pending.add(task)  # held until done: the loop keeps only a weak reference to a task
            task.add_done_callback(self._pending.discard)

    # ---- loading and unloading ---------------------------------------------------------------------------

    def _evictable(self) -> list[LoadedModel]:
        return [m for m in self.models.values() if m.in_flight == 0 and not m.pinned and not m.held]

    def _full(self, size: int) -> bool:
        if not self.models:
            return False
        if self.max_loaded is not None and len(self.models) >= self.max_loaded:
            return True
        return self.memory_budget is not None and sum(m.size for m in self.models.values()) + size > \
            self.memory_budget

    async def _load(self, name: str, path: Path, key: tuple) -> LoadedModel:  # holding the lock
        size = await asyncio.to_thread(estimate_bytes, path, self.ctx, self.device)
        deadline = time.monotonic() + WAIT_FOR_ROOM_S
        while self._full(size):
            idle = self._evictable()
            if idle:
                await self._unload_now(min(idle, key=lambda m: m.last_used))
                continue
            if all(m.pinned or m.held for m in self.models.values()):
                pinned = ", ".join(sorted(m.name for m in self.models.values()))
                raise ApiError(503, f"no room to load {name}: the loaded models ({pinned}) are pinned (--pin or "
                                    "keep_alive -1); unload one with `localllm stop MODEL` or raise --max-loaded")
            self._released.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise ApiError(503, f"no room to load {name}: every loaded model is answering requests; retry later")
            try:
                await asyncio.wait_for(self._released.wait(), timeout=min(left, SWEEP_S))
            except asyncio.TimeoutError:
                pass
        log.info("loading %s (%s)", name, path)
        try:
            engine, scheduler = await asyncio.to_thread(self.loader, path)
        except LocalLLMError as e:
            raise ApiError(500, f"cannot load {name}: {e}") from None
        model = self._register(name, path, key, engine, scheduler)
        scheduler.start()
        return model

    def _register(self, name: str, path: Path, key: tuple, engine, scheduler) -> LoadedModel:
        state = dataclasses.replace(self.base, engine=engine, scheduler=scheduler, model_name=name,
                                    model_path=str(path), max_tokens=min(self.base.max_tokens, engine.ctx))
        model = LoadedModel(name, path, key, path.stat().st_size + engine.kv_pool.budget_bytes, state,
                            keep_alive=self.keep_alive, pinned=name in self.pins, ctx=engine.ctx,
                            n_vocab=engine.config.vocab_size)
        self.models[key] = model
        return model

    def preload(self, name: str) -> LoadedModel:
        """Load a model before the server starts (the single model, --pin): errors surface at once."""
        try:
            name, path = self.lookup(name)
        except ApiError as e:
            raise LocalLLMError(f"--pin: {e.message}") from None
        engine, scheduler = self.loader(path)
        return self._register(name, path, file_key(path), engine, scheduler)

    async def unload(self, model: LoadedModel) -> bool:
        """Unload `model` once it is idle; False if it is in use again or gone already."""
        async with self._lock:
            if model.gone or model.in_flight or self.models.get(model.key) is not model:
                return False
            await self._unload_now(model)
            return True

    async def _unload_now(self, model: LoadedModel) -> None:  # holding the lock; model idle
        model.gone = True  # no new lease; /api/ps lists it until its memory is back
        scheduler = model.state.scheduler
        engine = model.state.engine
        model.state = None
        log.info("unloading %s", model.name)
        await asyncio.to_thread(scheduler.stop)
        engine.gguf.close()
        alive = weakref.ref(engine)
        del engine, scheduler
        # The last request's task may still hold the engine for a moment after its lease was released (its
        # response object, its frame): collect until the engine is gone, so its memory is back when this returns.
        for _ in range(40):
            await asyncio.to_thread(gc.collect)
            if alive() is None:
                break
            await asyncio.sleep(0.05)
        else:
            log.warning("%s is still referenced after unloading; its memory stays until it is not", model.name)
        await asyncio.to_thread(release_memory)
        del self.models[model.key]

    async def stop_model(self, name) -> str:
        """`localllm stop` / keep_alive 0 with no prompt: unload a model now (after its requests end). Returns
        what was done: "unloaded", or "not loaded"."""
        name = strip_latest(name) if isinstance(name, str) else name
        name, path = self.lookup(name)
        model = self.models.get(file_key(path))
        if model is None:
            return "not loaded"
        if model.pinned:
            raise ApiError(400, f"{model.name} is pinned (serve --pin, or the one model of this server): it stays "
                                "loaded")
        model.keep_alive, model.held = 0, False
        if model.in_flight == 0:
            await self.unload(model)
        return "unloaded"

    # ---- life cycle --------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._lock = asyncio.Lock()
        self._released = asyncio.Event()
        for model in self.models.values():
            model.state.scheduler.start()
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            now = time.time()
            for model in list(self.models.values()):
                if model.in_flight == 0 and model.expires_at() <= now:
                    try:
                        await self.unload(model)
                    except Exception:  # the sweep must go on
                        log.exception("unloading %s failed", model.name)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for model in list(self.models.values()):
            if model.state is not None:
                await asyncio.to_thread(model.state.scheduler.stop)
        self.models.clear()

    def ps(self) -> list[LoadedModel]:
        return sorted(self.models.values(), key=lambda m: -m.last_used)
