"""A reverse proxy that logs every request a client makes (method, path, status, time to the first byte of the
answer) as JSON lines: what a real client sent and what it got, for tests/test_real_clients.py.

    python logging_proxy.py UPSTREAM_URL PORT LOG_FILE
"""

import json
import sys
import time

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

UPSTREAM, PORT, LOG = sys.argv[1], int(sys.argv[2]), open(sys.argv[3], "a", buffering=1)
client = httpx.AsyncClient(base_url=UPSTREAM, timeout=None)
DROP = {"host", "content-length", "transfer-encoding", "connection"}


async def proxy(request):
    body = await request.body()
    t0 = time.perf_counter()
    path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    upstream = await client.send(client.build_request(
        request.method, path, content=body,
        headers=[(k, v) for k, v in request.headers.items() if k.lower() not in DROP]), stream=True)

    async def relay():
        first, size = None, 0
        try:
            async for chunk in upstream.aiter_raw():
                first = first if first is not None else time.perf_counter() - t0
                size += len(chunk)
                yield chunk
        finally:
            await upstream.aclose()
            LOG.write(json.dumps({"method": request.method, "path": request.url.path, "status": upstream.status_code,
                                  "request_bytes": len(body), "response_bytes": size,
                                  "ttfb_s": round(first or 0.0, 3), "total_s": round(time.perf_counter() - t0, 3),
                                  "body": body[:4096].decode("utf-8", "replace") if upstream.status_code >= 400 else "",
                                  }) + "\n")

    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in DROP}  # raw bytes: any encoding kept
    return StreamingResponse(relay(), status_code=upstream.status_code, headers=headers)


app = Starlette(routes=[Route("/{path:path}", proxy, methods=["GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS"])])
uvicorn.run(app, host="127.0.0.1", port=PORT, log_level="warning")
