"""`localllm bench-serve URL`: load-test a running OpenAI-compatible server with N concurrent streaming clients.

Each client sends streamed completions (prompts of shuffled words, different for every request, so no request
rides entirely on another's cache) until M requests have been sent in all. Measured per request, as vLLM's
`benchmark_serving` measures them:

  TTFT  time from sending the request to its first token
  TPOT  (time of the last token - time of the first) / (tokens - 1)
  ITL   the gaps between successive streamed chunks
  throughput  output tokens / wall time of the whole run; requests / wall time
  goodput     requests / wall time, counting only requests that met the SLO (TTFT and TPOT limits)
"""

from __future__ import annotations

import asyncio
import json
import random
import time

from localllm.errors import LocalLLMError

WORDS = ("the river ran past an old mill where a miller kept bread and grain for every family in town while "
         "children played near water under tall trees").split()


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def make_prompt(i: int, n_words: int) -> str:
    rng = random.Random(i)
    return "Continue the story: " + " ".join(rng.choice(WORDS) for _ in range(n_words))


async def one_request(client, url: str, body: dict, headers: dict) -> dict:
    t0 = time.perf_counter()
    stamps: list[float] = []
    usage = None
    async with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode("utf-8", "replace")
            return {"ok": False, "error": f"HTTP {r.status_code}: {text[:200]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
                if delta:
                    stamps.append(time.perf_counter())
    if not stamps:
        return {"ok": False, "error": "no tokens streamed"}
    n = usage["completion_tokens"] if usage else len(stamps)
    return {"ok": True, "ttft": stamps[0] - t0, "tpot": (stamps[-1] - stamps[0]) / (n - 1) if n > 1 else 0.0,
            "itl": [b - a for a, b in zip(stamps, stamps[1:])], "tokens": n, "latency": stamps[-1] - t0}


async def run(url: str, clients: int, requests: int, max_tokens: int = 64, prompt_words: int = 48,
              chat: bool = False, ignore_eos: bool = False, slo_ttft: float = 2.0, slo_tpot: float = 0.2,
              api_key: str | None = None, model: str | None = None) -> dict:
    import httpx

    base = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = httpx.Timeout(600.0, connect=10.0)
    limits = httpx.Limits(max_connections=clients + 2, max_keepalive_connections=clients + 2)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        try:
            r = await client.get(base + "/v1/models", headers=headers)
        except httpx.HTTPError as e:
            raise LocalLLMError(f"cannot reach {base}: {e}") from None
        if r.status_code != 200:
            raise LocalLLMError(f"{base}/v1/models answered HTTP {r.status_code}: {r.text[:200]}")
        model = model or r.json()["data"][0]["id"]
        endpoint = base + ("/v1/chat/completions" if chat else "/v1/completions")
        next_id = 0
        results: list[dict] = []

        def body(i: int) -> dict:
            b = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                 "stream_options": {"include_usage": True}}
            if ignore_eos:
                b["ignore_eos"] = True
            prompt = make_prompt(i, prompt_words)
            if chat:
                b["messages"] = [{"role": "user", "content": prompt}]
            else:
                b["prompt"] = prompt
            return b

        async def worker():
            nonlocal next_id
            while next_id < requests:
                i, next_id = next_id, next_id + 1
                try:
                    results.append(await one_request(client, endpoint, body(i), headers))
                except httpx.HTTPError as e:
                    results.append({"ok": False, "error": str(e)})

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - t0

    ok = [r for r in results if r["ok"]]
    good = [r for r in ok if r["ttft"] <= slo_ttft and r["tpot"] <= slo_tpot]
    tokens = sum(r["tokens"] for r in ok)

    def pcts(values):
        return {"p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99),
                "mean": sum(values) / len(values) if values else float("nan")}

    return {
        "url": base, "model": model, "clients": clients, "requests": requests, "completed": len(ok),
        "failed": len(results) - len(ok), "errors": sorted({r["error"] for r in results if not r["ok"]})[:5],
        "wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall if wall else 0.0,
        "requests_per_s": len(ok) / wall if wall else 0.0,
        "goodput_requests_per_s": len(good) / wall if wall else 0.0, "slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot},
        "slo_met": len(good),
        "ttft_s": pcts([r["ttft"] for r in ok]), "tpot_s": pcts([r["tpot"] for r in ok]),
        "itl_s": pcts([x for r in ok for x in r["itl"]]),
    }


def format_report(res: dict) -> str:
    def row(name, d):
        return (f"{name:<5} p50 {1000 * d['p50']:8.1f} ms   p90 {1000 * d['p90']:8.1f} ms   "
                f"p99 {1000 * d['p99']:8.1f} ms   mean {1000 * d['mean']:8.1f} ms")

    lines = [
        f"{res['model']} at {res['url']}: {res['clients']} clients, {res['completed']}/{res['requests']} requests "
        f"completed in {res['wall_s']:.1f} s" + (f" ({res['failed']} failed: {res['errors']})" if res["failed"] else ""),
        row("TTFT", res["ttft_s"]), row("TPOT", res["tpot_s"]), row("ITL", res["itl_s"]),
        f"throughput {res['output_tokens_per_s']:.1f} output tokens/s, {res['requests_per_s']:.2f} requests/s",
        f"goodput    {res['goodput_requests_per_s']:.2f} requests/s met the SLO (TTFT <= {res['slo']['ttft_s']} s, "
        f"TPOT <= {res['slo']['tpot_s']} s): {res['slo_met']}/{res['completed']}",
    ]
    return "\n".join(lines)


def main(args) -> int:
    if args.clients < 1 or args.requests < 1 or args.max_tokens < 1:
        raise LocalLLMError("--clients, --requests and --max-tokens must be at least 1")
    res = asyncio.run(run(args.url, args.clients, args.requests, args.max_tokens, args.prompt_words, args.chat,
                          args.ignore_eos, args.slo_ttft, args.slo_tpot, args.api_key, args.model))
    print(json.dumps(res) if args.json else format_report(res))
    return 0 if res["completed"] else 1

