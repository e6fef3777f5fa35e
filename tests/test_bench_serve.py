"""bench-serve's load generator: its HTTP/1.1 streaming client against a scripted server (chunk boundaries that
cut lines, keep-alive, error answers, a connection cut mid-answer), and prompts that never repeat across runs.
The end-to-end run against a real server is tests/test_server.py's test_bench_serve_reports_latencies."""

from __future__ import annotations

import asyncio
import json

import pytest

from localllm.bench.serving import StreamingClient, make_prompt, one_request
from localllm.errors import LocalLLMError


def sse(*events: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\r\n\r\n" for e in events) + b"data: [DONE]\r\n\r\n"


def chunked(data: bytes, sizes: list[int]) -> bytes:
    """data in chunks of the given sizes (the rest in one more), then the last chunk."""
    out, i = b"", 0
    for n in sizes + [len(data)]:
        part, i = data[i:i + n], i + n
        if part:
            out += b"%x\r\n" % len(part) + part + b"\r\n"
    return out + b"0\r\n\r\n"


async def scripted_server(answers: list[bytes], close_each: bool = False):
    """A server that reads each request (headers and Content-Length body) and writes the next scripted answer,
    closing the connection after the last one, one that says Connection: close, or (close_each) every one without
    saying so, as llama.cpp's server does after a streamed answer. Returns (server, url, requests seen)."""
    seen: list[bytes] = []
    queue = list(answers)

    async def handle(reader, writer):
        while queue:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            seen.append(head + await reader.readexactly(length))
            answer = queue.pop(0)
            writer.write(answer)
            await writer.drain()
            if b"Connection: close" in answer or close_each:
                break
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", seen


def ok_head(extra: str = "") -> bytes:
    return f"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n{extra}".encode()


EVENTS = [{"choices": [{"text": "Hello"}]}, {"choices": [{"text": " world"}]},
          {"choices": [], "usage": {"completion_tokens": 2}}]


def test_a_streamed_answer_is_read_whole_whatever_its_chunks_cut_and_the_connection_is_reused():
    async def main():
        body = sse(*EVENTS)
        answers = [ok_head("transfer-encoding: chunked\r\n\r\n") + chunked(body, [3, 1, 17, 2, 40]),
                   ok_head(f"content-length: {len(body)}\r\n\r\n") + body]
        server, url, seen = await scripted_server(answers)
        client = StreamingClient(url + "/", {"Authorization": "Bearer k"})
        first = await one_request(client, "/v1/completions", {"prompt": "a"})
        second = await one_request(client, "/v1/completions", {"prompt": "b"})
        client.close()
        server.close()
        return first, second, seen

    first, second, seen = asyncio.run(main())
    for res in (first, second):
        assert res["ok"] and res["tokens"] == 2 and len(res["itl"]) == 1
    assert len(seen) == 2 and all(s.startswith(b"POST /v1/completions HTTP/1.1\r\n") for s in seen)
    assert all(b"Authorization: Bearer k\r\n" in s for s in seen)
    assert json.loads(seen[1].split(b"\r\n\r\n", 1)[1]) == {"prompt": "b"}


def test_an_error_answer_fails_that_request_with_its_status_and_text():
    async def main():
        text = b'{"error": "bad key"}'
        server, url, _ = await scripted_server(
            [f"HTTP/1.1 401 Unauthorized\r\ncontent-length: {len(text)}\r\n\r\n".encode() + text,
             ok_head("Connection: close\r\n\r\n") + sse(*EVENTS)])  # no length: the body ends at the close
        client = StreamingClient(url, {})
        failed = await one_request(client, "/v1/completions", {})
        ok = await one_request(client, "/v1/completions", {})
        server.close()
        return failed, ok, client.writer

    failed, ok, writer = asyncio.run(main())
    assert failed == {"ok": False, "error": 'HTTP 401: {"error": "bad key"}'}
    assert ok["ok"] and ok["tokens"] == 2
    assert writer is None  # closed after the server's Connection: close


def test_an_answer_cut_mid_stream_raises_and_the_next_request_reconnects():
    async def main():
        body = sse(*EVENTS)
        cut = ok_head("transfer-encoding: chunked\r\n\r\n") + chunked(body, [10])[:30]
        whole = ok_head("transfer-encoding: chunked\r\n\r\n") + chunked(body, [])
        server, url, seen = await scripted_server([cut, whole], close_each=True)
        client = StreamingClient(url, {})
        with pytest.raises(asyncio.IncompleteReadError):  # an EOFError: bench-serve counts it as a failure
            await one_request(client, "/v1/completions", {"i": 0})
        assert client.writer is None  # the half-read connection is dropped
        res = await one_request(client, "/v1/completions", {"i": 1})  # the same client, a new connection
        client.close()
        server.close()
        return res, seen

    res, seen = asyncio.run(main())
    assert res["ok"] and res["tokens"] == 2
    assert [json.loads(s.split(b"\r\n\r\n", 1)[1]) for s in seen] == [{"i": 0}, {"i": 1}]


def test_a_kept_alive_connection_the_server_closed_is_opened_again_and_the_request_sent_once_more():
    async def main():
        body = sse(*EVENTS)
        answer = ok_head("transfer-encoding: chunked\r\n\r\n") + chunked(body, [7])
        server, url, seen = await scripted_server([answer, answer, answer], close_each=True)
        client = StreamingClient(url, {})
        results = [await one_request(client, "/v1/completions", {"i": i}) for i in range(3)]
        client.close()
        server.close()
        return results, seen

    results, seen = asyncio.run(main())
    assert all(r["ok"] and r["tokens"] == 2 for r in results)
    assert [json.loads(s.split(b"\r\n\r\n", 1)[1]) for s in seen] == [{"i": 0}, {"i": 1}, {"i": 2}]


def test_a_fresh_connection_closed_before_any_answer_fails_the_request():
    async def main():
        async def hang_up(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.close()

        server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
        client = StreamingClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", {})
        try:
            with pytest.raises(ConnectionError, match="closed the connection without answering"):
                await one_request(client, "/v1/completions", {})
        finally:
            server.close()

    asyncio.run(main())


def test_a_server_url_that_is_not_http_is_refused_with_a_message():
    with pytest.raises(LocalLLMError, match="http://HOST:PORT"):
        StreamingClient("127.0.0.1:8080", {})


def test_prompts_differ_between_requests_and_between_runs_unless_the_seed_is_repeated():
    run_a = [make_prompt(i, 48, "a") for i in range(8)]
    assert len(set(run_a)) == 8
    assert run_a == [make_prompt(i, 48, "a") for i in range(8)]
    assert not set(run_a) & {make_prompt(i, 48, "b") for i in range(8)}
