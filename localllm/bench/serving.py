"""`localllm bench-serve URL`: load-test a running OpenAI-compatible server with N concurrent streaming clients.

Each client sends streamed completions (prompts of shuffled words, different for every request and, unless
`--seed` repeats a run's, for every run: a request never rides on a cache an earlier run left in the server)
until M requests have been sent in all. Measured per request, as vLLM's `benchmark_serving` measures them:

  TTFT  time from sending the request to its first token
  TPOT  (time of the last token - time of the first) / (tokens - 1)
  ITL   the gaps between successive streamed chunks
  throughput  output tokens / wall time of the whole run; requests / wall time
  goodput     requests / wall time, counting only requests that met the SLO (TTFT and TPOT limits)

The load generator usually shares the machine with the server it measures, so its own cost per streamed token
is CPU time the server loses: each client reads its answers off a plain asyncio stream (`StreamingClient`), not
through httpx, whose streaming took ~180 us of CPU a token here (2 cores, 8 clients: 1.4 ms of every 8-token
step of the server's, 8-client throughput 226-232 t/s where the same server gave 252-257 t/s to this client).
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import ssl
import time
from urllib.parse import urlsplit

from localllm.errors import LocalLLMError

WORDS = ("the river ran past an old mill where a miller kept bread and grain for every family in town while "
         "children played near water under tall trees").split()
REQUEST_TIMEOUT = 600.0  # seconds for a whole streamed answer
CONNECT_TIMEOUT = 10.0


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def make_prompt(i: int, n_words: int, seed: str = "") -> str:
    """Request i's prompt: the same for the same (seed, i), different for another i or seed."""
    rng = random.Random(f"{seed}:{i}")
    return "Continue the story: " + " ".join(rng.choice(WORDS) for _ in range(n_words))


class _Unanswered(ConnectionError):
    """The connection closed (or was reset) before the first byte of the answer."""


class StreamingClient:
    """One client's keep-alive HTTP/1.1 connection: one request at a time, a 200 answer's body handed over line
    by line as it arrives (chunked, Content-Length or read to the close), any other answer's body returned whole.
    The connection opens on first use and again after the server closed it or a request failed."""

    def __init__(self, base: str, headers: dict[str, str]):
        u = urlsplit(base)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise LocalLLMError(f"{base}: give the server as http://HOST:PORT or https://HOST:PORT")
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if u.scheme == "https" else None
        self.prefix = u.path.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": f"{host}:{self.port}", **headers}.items())
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def post(self, path: str, payload: bytes, on_line) -> tuple[int, bytes]:
        """POST the JSON `payload` to `path`: (status, body), where a 200 answer's body went to on_line(line)
        line by line (without its line ending) and comes back empty. A kept-alive connection the server closed
        before answering (llama.cpp's server closes it after each streamed answer) is opened again and the
        request sent once more, as HTTP/1.1 clients do: nothing of it was read."""
        reused = self.writer is not None
        for attempt in range(2):
            try:
                return await self._post(path, payload, on_line)
            except _Unanswered:
                self.close()
                if not reused or attempt:
                    raise ConnectionError("the server closed the connection without answering") from None
            except BaseException:
                self.close()  # a half-read answer leaves the connection unusable
                raise
        raise AssertionError("unreachable")

    async def _post(self, path: str, payload: bytes, on_line) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, ssl=self.ssl), CONNECT_TIMEOUT)
        self.writer.write(f"POST {self.prefix}{path} HTTP/1.1\r\n{self.head}Content-Type: application/json\r\n"
                          f"Content-Length: {len(payload)}\r\n\r\n".encode("latin-1") + payload)
        reader = self.reader
        try:
            status_line = await reader.readline()
        except (ConnectionResetError, BrokenPipeError):
            raise _Unanswered() from None
        if not status_line:
            raise _Unanswered()
        version, status, *_ = status_line.split(None, 2) + [b"", b""]
        if not version.startswith(b"HTTP/") or not status.isdigit():
            raise ConnectionError(f"not an HTTP answer: {status_line[:80]!r}")
        status_code = int(status)
        chunked, length, close = False, None, version == b"HTTP/1.0"
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n"):
                break
            if not line:
                raise ConnectionError("the server closed the connection in the answer's headers")
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"transfer-encoding":
                chunked = b"chunked" in value
            elif name == b"content-length":
                length = int(value)
            elif name == b"connection":
                close = close or value == b"close"
        body = bytearray()
        pending = b""

        def feed(data: bytes) -> None:
            nonlocal pending
            if status_code != 200:
                body.extend(data)
                return
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                on_line(line.rstrip(b"\r"))

        if chunked:
            while True:
                size = int((await reader.readline()).split(b";", 1)[0], 16)
                data = await reader.readexactly(size + 2)  # the chunk and its CRLF (after the last: no trailers)
                if size == 0:
                    break
                feed(data[:-2])
        elif length is not None:
            feed(await reader.readexactly(length))
        else:
            feed(await reader.read())
            close = True
        if pending and status_code == 200:
            on_line(pending.rstrip(b"\r"))
        if close:
            self.close()
        return status_code, bytes(body)


async def one_request(client: StreamingClient, path: str, body: dict) -> dict:
    t0 = time.perf_counter()
    stamps: list[float] = []
    usage = None

    def on_line(line: bytes) -> None:
        nonlocal usage
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            return
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
            if delta:
                stamps.append(time.perf_counter())

    async with asyncio.timeout(REQUEST_TIMEOUT):
        status, text = await client.post(path, json.dumps(body).encode(), on_line)
    if status != 200:
        return {"ok": False, "error": f"HTTP {status}: {text.decode('utf-8', 'replace')[:200]}"}
    if not stamps:
        return {"ok": False, "error": "no tokens streamed"}
    n = usage["completion_tokens"] if usage else len(stamps)
    return {"ok": True, "ttft": stamps[0] - t0, "tpot": (stamps[-1] - stamps[0]) / (n - 1) if n > 1 else 0.0,
            "itl": [b - a for a, b in zip(stamps, stamps[1:])], "tokens": n, "latency": stamps[-1] - t0}


async def run(url: str, clients: int, requests: int, max_tokens: int = 64, prompt_words: int = 48,
              chat: bool = False, ignore_eos: bool = False, slo_ttft: float = 2.0, slo_tpot: float = 0.2,
              api_key: str | None = None, model: str | None = None, seed: str | None = None) -> dict:
    import httpx

    base = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base + "/v1/models", headers=headers, timeout=CONNECT_TIMEOUT)
    except httpx.HTTPError as e:
        raise LocalLLMError(f"cannot reach {base}: {e}") from None
    if r.status_code != 200:
        raise LocalLLMError(f"{base}/v1/models answered HTTP {r.status_code}: {r.text[:200]}")
    model = model or r.json()["data"][0]["id"]
    path = "/v1/chat/completions" if chat else "/v1/completions"
    seed = secrets.token_hex(8) if seed is None else seed
    next_id = 0
    results: list[dict] = []

    def body(i: int) -> dict:
        b = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
             "stream_options": {"include_usage": True}}
        if ignore_eos:
            b["ignore_eos"] = True
        prompt = make_prompt(i, prompt_words, seed)
        if chat:
            b["messages"] = [{"role": "user", "content": prompt}]
        else:
            b["prompt"] = prompt
        return b

    async def worker():
        nonlocal next_id
        client = StreamingClient(base, headers)
        try:
            while next_id < requests:
                i, next_id = next_id, next_id + 1
                try:
                    results.append(await one_request(client, path, body(i)))
                except (OSError, EOFError, ValueError, TimeoutError) as e:  # this request only (EOFError:
                    # asyncio.IncompleteReadError, an answer cut short)
                    results.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
        finally:
            client.close()

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
        "url": base, "model": model, "clients": clients, "requests": requests, "seed": seed, "completed": len(ok),
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
                          args.ignore_eos, args.slo_ttft, args.slo_tpot, args.api_key, args.model, args.seed))
    print(json.dumps(res) if args.json else format_report(res))
    return 0 if res["completed"] else 1

