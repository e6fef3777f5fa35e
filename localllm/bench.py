"""`localllm bench`: prompt-processing and generation speed, measured the way llama-bench measures them.

pp N: process N prompt tokens from an empty KV cache (one pass through the engine's prompt path).
tg N: generate N tokens one forward at a time from an empty cache (no sampling cost, as llama-bench).
Each test runs once to warm up, then `reps` times; we report mean and standard deviation of tokens/s.
"""

from __future__ import annotations

import statistics
import time

import numpy as np


def _tokens(engine, n: int, seed: int = 0) -> list[int]:
    # llama-bench feeds random token ids; any ids exercise the same arithmetic.
    rng = np.random.default_rng(seed)
    return rng.integers(0, engine.config.vocab_size, size=n).tolist()


def time_prompt(engine, n: int) -> float:
    seq = engine.new_sequence()
    tokens = _tokens(engine, n)
    t = time.perf_counter()
    engine.evaluate(seq, tokens)
    return time.perf_counter() - t


def time_generation(engine, n: int) -> float:
    seq = engine.new_sequence()
    tokens = _tokens(engine, n, seed=1)
    t = time.perf_counter()
    for tok in tokens:
        engine.evaluate(seq, [tok])
    return time.perf_counter() - t


def chat_turn(engine, history: int = 1500, new: int = 20, n_gen: int = 32) -> dict:
    """A chat's next turn: time to first token with the conversation's cache reused, against the same
    history processed cold (a fresh KV pool, so nothing is found cached), and time per output token."""
    from localllm.engine import GenerationParams
    from localllm.kv_cache import KVPool
    from localllm.sampling import SamplingParams

    tokens = _tokens(engine, history + new, seed=2)
    greedy = SamplingParams(temperature=0)
    seq = engine.new_sequence()
    engine.evaluate(seq, tokens[:history])  # the conversation so far
    t = time.perf_counter()
    events = engine.generate(tokens, GenerationParams(max_tokens=n_gen, ignore_eos=True, sampling=greedy), seq=seq)
    first = next(events)
    ttft = time.perf_counter() - t
    rest = list(events)
    tpot = (time.perf_counter() - t - ttft) / max(len(rest), 1)
    warm_pool = engine.kv_pool
    engine.kv_pool = KVPool.for_model(engine.config, warm_pool.budget_bytes, kv_type=warm_pool.kv_type)
    try:
        t = time.perf_counter()
        cold = next(engine.generate(tokens, GenerationParams(max_tokens=1, sampling=greedy)))
        cold_ttft = time.perf_counter() - t
    finally:
        engine.kv_pool = warm_pool
    return {"history": history, "ttft_ms": 1000 * ttft, "cold_ttft_ms": 1000 * cold_ttft,
            "ttft_ratio": ttft / cold_ttft, "tpot_ms": 1000 * tpot, "reused": first.timings.cache_n,
            "cold_reused": cold.timings.cache_n}


def run(engine, n_prompt: int = 512, n_gen: int = 128, reps: int = 3) -> dict:
    result = {"model": engine.name, "params": sum(w.rows * w.cols for w in engine.model.weights()),
              "size": engine.path.stat().st_size}
    for key, n, fn in (("pp", n_prompt, time_prompt), ("tg", n_gen, time_generation)):
        if n <= 0:
            continue
        if n >= engine.ctx:
            raise ValueError(f"{key}{n} does not fit the context of {engine.ctx} tokens")
        fn(engine, min(n, 16))  # warm-up
        speeds = [n / fn(engine, n) for _ in range(reps)]
        result[key] = statistics.fmean(speeds)
        result[f"{key}_sd"] = statistics.stdev(speeds) if len(speeds) > 1 else 0.0
        result[f"{key}_n"] = n
    return result


def format_rows(results: list[dict], threads: int) -> str:
    lines = [f"| {'model':<30} | {'size':>9} | {'threads':>7} | {'test':>6} | {'t/s':>16} |",
             f"| {'-' * 30} | {'-' * 9}:| {'-' * 7}:| {'-' * 6}:| {'-' * 16}:|"]
    for r in results:
        for key in ("pp", "tg"):
            if key in r:
                speed = f"{r[key]:.2f} ± {r[key + '_sd']:.2f}"
                lines.append(f"| {r['model']:<30} | {r['size'] / 2**20:>5.0f} MiB | {threads:>7} | "
                             f"{key}{r[key + '_n']:<4} | {speed:>16} |")
    return "\n".join(lines)
