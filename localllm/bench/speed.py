"""`localllm bench`: prompt-processing and generation speed, measured the way llama-bench measures them.

pp N: process N prompt tokens from an empty KV cache (one pass through the engine's prompt path).
tg N: generate N tokens one forward at a time from an empty cache (no sampling cost, as llama-bench).
Each test runs once to warm up, then `reps` times; we report mean and standard deviation of tokens/s.

Beside them: the weight bandwidth tg achieves (weight bytes read per token x tokens/s, against the machine's
streaming-read bandwidth, the ceiling of batch-1 decode), the cost of a k-token forward against a 1-token one
(what speculative verification pays), and a chat turn's time to first token and time per output token.
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


def _timed_at_depth(engine, depth: int, reps: int, step) -> list[float]:
    """`step(seq)` timed after `depth` tokens of context (llama-bench -d): the context is evaluated once, then each
    repetition runs `step` and the sequence is cut back to `depth` (llama-bench re-evaluates the context before
    every repetition; the timed part is the same). One warm-up repetition first. A model with sliding-window layers
    (gemma3) has let go of keys the context's end needs by then: its context is evaluated again instead."""
    context = _tokens(engine, depth, seed=5)
    seq = None
    try:
        times = []
        for _ in range(reps + 1):
            if seq is None:
                seq = engine.new_sequence()
                engine.evaluate(seq, context)
            t = time.perf_counter()
            step(seq)
            times.append(time.perf_counter() - t)
            if seq.cache.can_truncate(depth):
                seq.truncate(depth)
            else:
                seq.close()
                seq = None
        return times[1:]
    finally:
        if seq is not None:
            seq.close()


def time_generation_at_depth(engine, n: int, depth: int, reps: int) -> list[float]:
    """tg n after `depth` tokens of context: n tokens decoded one forward at a time."""
    tokens = _tokens(engine, n, seed=1)

    def decode(seq):
        for tok in tokens:
            engine.evaluate(seq, [tok])

    return _timed_at_depth(engine, depth, reps, decode)


def time_prompt_at_depth(engine, n: int, depth: int, reps: int) -> list[float]:
    """pp n after `depth` tokens of context (llama-bench -p n -d depth): n prompt tokens in one pass."""
    tokens = _tokens(engine, n, seed=2)
    return _timed_at_depth(engine, depth, reps, lambda seq: engine.evaluate(seq, tokens))


def chat_turn(engine, history: int = 1500, new: int = 20, n_gen: int = 32) -> dict:
    """A chat's next turn: time to first token with the conversation's cache reused, against the same
    history processed cold (a fresh KV pool, so nothing is found cached), and time per output token."""
    from localllm.runtime.engine import GenerationParams
    from localllm.chat.sampling import SamplingParams

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
    engine.kv_pool = engine.model.new_pool(budget_bytes=warm_pool.budget_bytes, kv_type=warm_pool.kv_type)
    try:
        t = time.perf_counter()
        cold = next(engine.generate(tokens, GenerationParams(max_tokens=1, sampling=greedy)))
        cold_ttft = time.perf_counter() - t
    finally:
        engine.kv_pool = warm_pool
    return {"history": history, "ttft_ms": 1000 * ttft, "cold_ttft_ms": 1000 * cold_ttft,
            "ttft_ratio": ttft / cold_ttft, "tpot_ms": 1000 * tpot, "reused": first.timings.cache_n,
            "cold_reused": cold.timings.cache_n}


def weight_bytes_per_token(engine) -> int:
    """Weight bytes a decode step reads: every matrix once, but only one row of the token embedding (unless it
    doubles as the output head, which is read whole), and of a mixture of experts' experts the share a token
    uses (expert_used_count of expert_count per layer)."""
    model = engine.model
    total = sum(w.nbytes for w in model.weights()[2:])  # the layers' matrices
    total -= model.unread_expert_bytes  # a mixture of experts reads only the chosen ones
    total += model.output.nbytes
    if model.output is not model.token_embd:
        total += model.token_embd.nbytes // model.token_embd.rows  # one row (either backend's weights)
    return total


def k_token_ratios(engine, ks=(2, 4, 8), context: int = 512, reps: int = 5) -> dict:
    """time(a k-token forward) / time(a 1-token forward) after `context` tokens, best of `reps` each: the
    price of verifying k speculated tokens in one pass (1.0 would be free)."""
    seq = engine.new_sequence()
    try:
        engine.evaluate(seq, _tokens(engine, context, seed=3))
        extra = _tokens(engine, max(ks), seed=4)

        def best(k: int) -> float:
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                engine.evaluate(seq, extra[:k])
                times.append(time.perf_counter() - t)
                seq.truncate(context)
            return min(times)

        one = best(1)
        return {k: best(k) / one for k in ks}
    finally:
        seq.close()


def run(engine, n_prompt: int = 512, n_gen: int = 128, reps: int = 3, depth: int = 0) -> dict:
    result = {"model": engine.name, "device": engine.model.backend.name,
              "params": sum(w.rows * w.cols for w in engine.model.weights()),
              "size": engine.path.stat().st_size}
    for key, n, fn in (("pp", n_prompt, time_prompt), ("tg", n_gen, time_generation)):
        if n <= 0:
            continue
        if n >= engine.ctx:
            raise ValueError(f"{key}{n} does not fit the context of {engine.ctx} tokens")
        fn(engine, n)  # warm-up, as llama-bench runs each test once before timing it
        speeds = [n / fn(engine, n) for _ in range(reps)]
        result[key] = statistics.fmean(speeds)
        result[f"{key}_sd"] = statistics.stdev(speeds) if len(speeds) > 1 else 0.0
        result[f"{key}_n"] = n
    for key, n, fn in (("pp_depth", n_prompt, time_prompt_at_depth), ("tg_depth", n_gen, time_generation_at_depth)):
        if not (depth and n):
            continue
        if depth + n >= engine.ctx:
            raise ValueError(f"{key[:2]}{n} at depth {depth} does not fit the context of {engine.ctx} tokens")
        speeds = [n / t for t in fn(engine, n, depth, reps)]
        result[key] = statistics.fmean(speeds)
        result[f"{key}_sd"] = statistics.stdev(speeds) if len(speeds) > 1 else 0.0
        result[f"{key}_n"] = n
        result["depth"] = depth
    if "tg" in result:
        result["weight_bytes_per_token"] = weight_bytes_per_token(engine)
        result["bandwidth_gbs"] = result["weight_bytes_per_token"] * result["tg"] / 1e9
    return result


def reset_peak_rss() -> None:
    """Start the process's peak resident size (VmHWM) over from its current size, where Linux lets a process
    (/proc/self/clear_refs); elsewhere the peak stays the process's whole life's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss() -> int | None:
    """The process's peak resident size in bytes since reset_peak_rss (VmHWM), None where /proc has none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def format_extras(r: dict) -> list[str]:
    """The lines under the table for one model: load time and peak memory, bandwidth, k-token ratios, chat turn."""
    lines = []
    if "load_s" in r:
        line = f"{r['model']}: loaded in {r['load_s']:.1f} s (mapping, checks, weight tiling, a first token)"
        if r.get("rss_peak_bytes"):
            mib = 2**20
            other = r["rss_peak_bytes"] - r["size"] - r["kv_bytes"]
            line += (f"; peak RSS {r['rss_peak_bytes'] / mib:.0f} MiB = file {r['size'] / mib:.0f} + KV cache "
                     f"{r['kv_bytes'] / mib:.0f} + {other / mib:.0f} MiB")
        lines.append(line)
    if "bandwidth_gbs" in r:
        line = f"{r['model']}: tg reads {r['weight_bytes_per_token'] / 2**20:.0f} MiB of weights per token = " \
               f"{r['bandwidth_gbs']:.1f} GB/s"
        if "machine_bandwidth_gbs" in r:
            line += f" of the machine's {r['machine_bandwidth_gbs']:.1f} GB/s streaming read " \
                    f"({r['bandwidth_gbs'] / r['machine_bandwidth_gbs']:.0%})"
        lines.append(line)
    if "k_ratio" in r:
        ratios = ", ".join(f"k={k}: {v:.2f}" for k, v in r["k_ratio"].items())
        lines.append(f"{r['model']}: time(k tokens) / time(1 token) at 512 tokens of context: {ratios}")
    if "chat_turn" in r:
        c = r["chat_turn"]
        lines.append(f"{r['model']}: next chat turn after {c['history']} tokens: TTFT {c['ttft_ms']:.0f} ms "
                     f"({c['reused']} reused) vs {c['cold_ttft_ms']:.0f} ms cold = {c['ttft_ratio']:.3f}; "
                     f"TPOT {c['tpot_ms']:.1f} ms")
    return lines


def _tests(r: dict):
    """(key, test label as llama-bench prints it) of the tests in a result."""
    for key in ("pp", "tg", "pp_depth", "tg_depth"):
        if key in r:
            n = r[key + "_n"]
            yield key, (f"{key[:2]}{n} @ d{r['depth']}" if key.endswith("_depth") else f"{key}{n}")


def format_rows(results: list[dict], threads: int) -> str:
    """llama-bench's table; with llama.cpp's figures in the results (`llama_cpp`), its t/s and the ratio beside."""
    ref = any("llama_cpp" in r for r in results)
    head = f"| {'model':<30} | {'size':>9} | {'threads':>7} | {'test':>13} | {'t/s':>16} |"
    rule = f"| {'-' * 30} | {'-' * 9}:| {'-' * 7}:| {'-' * 13}:| {'-' * 16}:|"
    if ref:
        head += f" {'llama.cpp t/s':>16} | {'ratio':>5} |"
        rule += f" {'-' * 16}:| {'-' * 5}:|"
    lines = [head, rule]
    for r in results:
        for key, label in _tests(r):
            speed = f"{r[key]:.2f} ± {r[key + '_sd']:.2f}"
            line = f"| {r['model']:<30} | {r['size'] / 2**20:>5.0f} MiB | {threads:>7} | {label:>13} | {speed:>16} |"
            if ref:
                theirs = r.get("llama_cpp", {}).get(key)
                if theirs:
                    line += f" {theirs['ts']:>8.2f} ± {theirs['sd']:>5.2f} | {r[key] / theirs['ts']:>5.2f} |"
                else:
                    line += f" {'-':>16} | {'-':>5} |"
            lines.append(line)
    return "\n".join(lines)


def llama_bench(binary: str, model_path, n_prompt: int, n_gen: int, reps: int, threads: int, depth: int = 0,
                kv_type: str = "f32") -> dict:
    """llama.cpp's figures for the same tests on the same file, from its llama-bench (`-o json`): {key: {"ts",
    "sd"}} with bench.run's keys. Two invocations: without depth, and at `depth` (pp and tg there too). A q8_0
    KV cache is asked of llama.cpp too (`-ctk q8_0 -ctv q8_0`, with flash attention, which a quantized V needs);
    float32 KV leaves llama-bench's default (float16), what its users run."""
    import json
    import subprocess

    from localllm.errors import LocalLLMError

    def invoke(args: list[str]) -> list[dict]:
        cmd = [binary, "-m", str(model_path), "-r", str(reps), "-t", str(threads), "-o", "json", *args]
        if kv_type == "q8_0":
            cmd += ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "1"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        except OSError as e:
            raise LocalLLMError(f"cannot run llama-bench at {binary}: {e.strerror}") from None
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise LocalLLMError(f"llama-bench failed (exit {done.returncode}): " + " / ".join(tail))
        try:
            return json.loads(done.stdout)
        except ValueError:
            raise LocalLLMError("llama-bench printed something other than its JSON (-o json)") from None

    out = {}
    rows = invoke(["-p", str(n_prompt), "-n", str(n_gen), "-d", "0"]) if (n_prompt or n_gen) else []
    if depth and (n_prompt or n_gen):
        rows += invoke(["-p", str(n_prompt), "-n", str(n_gen), "-d", str(depth)])
    for row in rows:
        if row.get("n_depth", 0):
            key = "tg_depth" if row["n_gen"] else "pp_depth"
        elif row["n_prompt"]:
            key = "pp"
        else:
            key = "tg"
        out[key] = {"ts": float(row["avg_ts"]), "sd": float(row["stddev_ts"])}
    return out


# ---- speculative decoding: the same greedy decode with and without it ----------------------------------------

SPEC_PROMPT = '''# File: shapes.py (original)
```python
def area_of_square(side):
    return side * side

def area_of_rectangle(width, height):
    return width * height

def perimeter_of_square(side):
    return 4 * side

def perimeter_of_rectangle(width, height):
    return 2 * (width + height)
```

# File: shapes.py (after renaming area_of_square to square_area and perimeter_of_square to square_perimeter)
```python
'''


def speculative(engine, tokens: list[int], spec, n_gen: int = 128, reps: int = 3,
                stop: list[str] | None = None) -> dict:
    """Greedy decode of n_gen tokens after `tokens`, plain and with `spec`, interleaved `reps` times (after one
    warm-up of each, which also caches the prompt); medians of the decode tokens/s (prompt time excluded). The two
    must give the same tokens: speculation is lossless. With `stop` strings, each decode ends where one appears or
    at the end of generation (n_gen tokens at most): a whole answer, e.g. an edited file up to its closing fence,
    where the first n_gen tokens alone may be mostly the part that differs from the text it copies."""
    from dataclasses import replace

    from localllm.runtime.engine import GenerationParams
    from localllm.chat.sampling import SamplingParams

    plain = GenerationParams(max_tokens=n_gen, ignore_eos=not stop, stop=list(stop or []),
                             sampling=SamplingParams(temperature=0))
    params = {"plain": plain, "spec": replace(plain, speculation=spec)}
    runs: dict[str, list] = {"plain": [], "spec": []}
    outputs = {}
    for rep in range(reps + 1):
        for key, p in params.items():
            events = list(engine.generate(tokens, p if rep else replace(p, max_tokens=min(n_gen, 16))))
            outputs[key] = [e.token for e in events]
            if rep:
                runs[key].append(events[-1].timings)
    if outputs["plain"] != outputs["spec"]:
        raise AssertionError("speculative decoding changed the greedy output")
    tg = {key: statistics.median(t.predicted_per_second for t in ts) for key, ts in runs.items()}
    last = runs["spec"]
    drafted = sum(t.draft_n for t in last)
    accepted = sum(t.draft_n_accepted for t in last)
    verifies = sum(t.n_verifies for t in last)
    return {"model": engine.name, "mode": spec.mode, "draft_model": spec.draft_model, "prompt_tokens": len(tokens),
            "n_gen": len(outputs["plain"]), "stop": list(stop or []), "reps": reps, "tg_plain": tg["plain"],
            "tg_spec": tg["spec"],
            "speedup": tg["spec"] / tg["plain"] if tg["plain"] else 0.0,
            "tg_plain_runs": [t.predicted_per_second for t in runs["plain"]],
            "tg_spec_runs": [t.predicted_per_second for t in last],
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "tokens_per_verify": (accepted + verifies) / verifies if verifies else 0.0}


def format_speculative(r: dict) -> str:
    mode = r["mode"] + (f" ({r['draft_model']})" if r["draft_model"] else "")
    until = f" (until {' or '.join(repr(x) for x in r['stop'])})" if r.get("stop") else ""
    return (f"{r['model']}: tg{r['n_gen']}{until} after a {r['prompt_tokens']}-token prompt, greedy, "
            f"median of {r['reps']}: "
            f"plain {r['tg_plain']:.2f} tok/s, speculative {mode} {r['tg_spec']:.2f} tok/s = {r['speedup']:.2f}x "
            f"(drafts accepted {r['acceptance_rate']:.0%}, {r['tokens_per_verify']:.2f} tokens per check)")
