"""Whether the server would serve a request now (/health's answer), and a stop that takes at most STOP_SECONDS.

/health answers 503, as llama-server does while it cannot serve, when: the server is stopping; a model's
scheduler thread is not running or its queue is full (a request would be refused); or the worker threads that
tokenization, templates and the other off-loop work run on do not pick up a no-op within PROBE_SECONDS (a
request would wait behind them). The probe is a real hop through that pool, not a guess from counters.

SIGTERM and Ctrl-C: uvicorn stops accepting, lets requests end for its graceful timeout, then runs the
lifespan's shutdown; but the process also waits for every thread of the default pool to finish its task (a
tokenization of a huge prompt, a template render), and the scheduler for its step. `Server` arms a watchdog
on the first signal: if the process is still there STOP_SECONDS later, it exits at once (status 1), whatever
it was running.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import uvicorn

PROBE_SECONDS = 1.0
STOP_SECONDS = 4.0  # within the 5 s a stop may take, with room for the signal's delivery and the exit

_stopping = threading.Event()


def _schedulers(state) -> list:
    registry = getattr(state, "registry", None)
    if registry is not None:
        return [m.state.scheduler for m in list(registry.models.values()) if m.state.scheduler is not None]
    return [state.scheduler] if getattr(state, "scheduler", None) is not None else []


async def unavailable(state) -> str | None:
    """Why a request would not be served now, or None when it would."""
    if _stopping.is_set():
        return "the server is stopping"
    for s in _schedulers(state):
        thread = getattr(s, "_thread", None)
        if getattr(s, "_stop", False):
            return "the server is stopping"
        if thread is not None and thread.ident is not None and not thread.is_alive():
            return "the scheduler is not running"
        queued = len(getattr(s, "_inbox", ())) + len(getattr(s, "_waiting", ()))
        if queued >= s.max_queue:
            return f"the server is busy ({queued} requests queued)"
    try:
        await asyncio.wait_for(asyncio.to_thread(lambda: None), PROBE_SECONDS)
    except asyncio.TimeoutError:
        return "every worker thread is busy: requests would wait"
    return None


_armed = threading.Event()
_devnull = None


def _watchdog(sig: int) -> None:
    """faulthandler's timer: a C thread that needs no GIL (7 threads tokenizing held it long enough to make a
    Python timer thread 0.7 s late) and ends the process with _exit(1) when it fires."""
    global _devnull
    if _armed.is_set():
        return
    _armed.set()
    import faulthandler

    _devnull = open(os.devnull, "w")  # (the threads' stacks are not for the user's terminal)
    faulthandler.dump_traceback_later(STOP_SECONDS, exit=True, file=_devnull)


class Server(uvicorn.Server):
    """uvicorn's server, whose stop signals also arm the watchdog (see the module's docstring)."""

    def handle_exit(self, sig: int, frame) -> None:
        _stopping.set()
        if sig in (signal.SIGTERM, signal.SIGINT):
            _watchdog(sig)
        super().handle_exit(sig, frame)
