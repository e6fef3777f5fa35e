"""Server metrics in Prometheus' text exposition format (GET /metrics).

The scheduler thread updates the counters and publishes a snapshot of the KV pool after every step; the
event loop only reads them, so /metrics never touches the engine.
"""

from __future__ import annotations

import bisect
import threading

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.buckets, value)] += 1
            self.sum += value
            self.count += 1

    def render(self, name: str, help_text: str) -> list[str]:
        with self._lock:
            counts, total, n = list(self.counts), self.sum, self.count
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        acc = 0
        for le, c in zip(self.buckets, counts):
            acc += c
            lines.append(f'{name}_bucket{{le="{le}"}} {acc}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {n}')
        lines.append(f"{name}_sum {total:.6f}")
        lines.append(f"{name}_count {n}")
        return lines


class Metrics:
    def __init__(self):
        self.prompt_tokens = 0  # prompt tokens evaluated (cache hits excluded)
        self.cached_tokens = 0  # prompt tokens reused from the KV cache
        self.generated_tokens = 0
        self.requests_done = 0
        self.requests_failed = 0
        self.cancelled = 0
        self.active = 0
        self.queued = 0
        self.live_sequences = 0
        self.kv_blocks_held = 0
        self.kv_blocks_idle = 0
        self.kv_blocks_retained = 0
        self.kv_bytes = 0
        self.kv_budget_bytes = 0
        self.draft_tokens = 0  # speculative decoding (serve --spec): tokens drafted, accepted, verify forwards
        self.draft_accepted = 0
        self.verifies = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TOKEN_BUCKETS)
        self.itl = Histogram(TOKEN_BUCKETS)

    def render(self) -> str:
        p = "localllm_"
        rows = [
            ("prompt_tokens_total", "counter", "Prompt tokens evaluated (cached ones excluded).", self.prompt_tokens),
            ("prompt_tokens_cached_total", "counter", "Prompt tokens reused from the KV cache.", self.cached_tokens),
            ("generation_tokens_total", "counter", "Tokens generated.", self.generated_tokens),
            ("requests_completed_total", "counter", "Requests that finished generating.", self.requests_done),
            ("requests_failed_total", "counter", "Requests that failed in the scheduler.", self.requests_failed),
            ("requests_cancelled_total", "counter", "Requests cancelled mid-generation (client gone).",
             self.cancelled),
            ("requests_running", "gauge", "Requests being decoded in the batch.", self.active),
            ("requests_waiting", "gauge", "Requests queued for a slot.", self.queued),
            ("sequences_live", "gauge", "Sequences holding KV cache blocks for a request.", self.live_sequences),
            ("kv_cache_blocks_held", "gauge", "KV blocks held by live sequences.", self.kv_blocks_held),
            ("kv_cache_blocks_idle", "gauge", "KV blocks kept cached for prefix reuse.", self.kv_blocks_idle),
            ("kv_cache_blocks_retained", "gauge", "KV blocks of finished requests kept whole for chunk reuse "
             "(--cache-reuse), held by no live sequence.", self.kv_blocks_retained),
            ("kv_cache_bytes", "gauge", "Bytes of KV cache storage allocated.", self.kv_bytes),
            ("kv_cache_budget_bytes", "gauge", "Storage the idle cached blocks may grow to.", self.kv_budget_bytes),
            ("draft_tokens_total", "counter", "Speculative tokens drafted and verified.", self.draft_tokens),
            ("draft_tokens_accepted_total", "counter", "Drafted tokens the model accepted.", self.draft_accepted),
            ("speculative_verifies_total", "counter", "Verify forwards of speculative decoding.", self.verifies),
        ]
        lines: list[str] = []
        for name, kind, help_text, value in rows:
            lines += [f"# HELP {p}{name} {help_text}", f"# TYPE {p}{name} {kind}", f"{p}{name} {value}"]
        lines += self.ttft.render(p + "time_to_first_token_seconds", "Time from request to its first token.")
        lines += self.tpot.render(p + "time_per_output_token_seconds",
                                  "Mean time per token after the first, per request.")
        lines += self.itl.render(p + "inter_token_latency_seconds", "Time between successive tokens of a stream.")
        return "\n".join(lines) + "\n"


def parse(text: str) -> dict[str, float]:
    """Samples of a Prometheus text page, {name{labels}: value} (for tests and bench-serve)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
