"""`serve`'s options for several models behind one port, and `localllm ps` / `localllm stop MODEL`, which ask a
running server (GET /api/ps; an Ollama /api/generate with keep_alive 0, as `ollama stop` sends)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys

from localllm.errors import LocalLLMError


def _keep_alive(text: str) -> float:
    from localllm.server.registry import parse_duration_option

    try:
        return parse_duration_option(text)
    except LocalLLMError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def add_serve_options(p) -> None:
    """--models, --max-loaded, --pin, --keep-alive on `serve`."""
    from localllm.cli.generate import whole_number

    p.add_argument("--models", type=_names, default=None, metavar="A,B,...",
                   help="serve these models behind the one port: each request's 'model' field picks one, loaded "
                        "on its first request (the first is the default for requests that name none). Without "
                        "MODEL and --models: any model of the store")
    p.add_argument("--max-loaded", type=whole_number(1), default=None, metavar="N",
                   help="models loaded at once at most; the least recently used idle one is unloaded to make room "
                        "(default: as many as fit in 80%% of the memory available at start, counting each "
                        "model's file and KV cache)")
    p.add_argument("--pin", action="append", default=[], metavar="MODEL",
                   help="load MODEL at start and never unload it (repeatable)")
    p.add_argument("--keep-alive", type=_keep_alive, default=None, metavar="DURATION",
                   help="how long a model stays loaded after its last request, e.g. 30s, 5m, 1h; -1: until "
                        "unloaded for room (default 5m, as Ollama; a request's keep_alive overrides it)")


def _client(args):
    import httpx

    host = args.host
    shown = f"[{host}]" if ":" in host else host
    key = args.api_key or os.environ.get("LOCALLLM_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=f"http://{shown}:{args.port}", headers=headers, timeout=args.timeout)


def _call(args, method: str, path: str, **kwargs):
    import httpx

    try:
        with _client(args) as c:
            r = c.request(method, path, **kwargs)
    except httpx.HTTPError as e:
        raise LocalLLMError(f"no server answers on {args.host}:{args.port} ({e}); start one with `localllm serve`, "
                            "or give --host/--port") from None
    try:
        body = r.json()
    except ValueError:
        body = {}
    if r.status_code != 200:
        message = body.get("error") if isinstance(body, dict) else None
        raise LocalLLMError(f"the server answered {r.status_code}: {message or r.text[:200]}")
    return body


def _until(expires_at: str) -> str:
    try:
        t = dt.datetime.fromisoformat(expires_at.replace("Z", "+00:00"))
    except (ValueError, AttributeError):
        return "?"
    if t.year >= 2999:
        return "forever"
    left = (t - dt.datetime.now(dt.timezone.utc)).total_seconds()
    if left <= 0:
        return "now"
    return f"{left:.0f} s" if left < 120 else f"{left / 60:.0f} min"


def cmd_ps(args) -> int:
    from localllm.progress import human_size

    models = _call(args, "GET", "/api/ps").get("models", [])
    if args.json:
        print(json.dumps(models, ensure_ascii=False))
        return 0
    if not models:
        print("no model is loaded")
        return 0
    print(f"{'NAME':<36} {'SIZE':>9} {'CONTEXT':>8}  UNTIL")
    for m in models:
        print(f"{m.get('name', '?'):<36} {human_size(m.get('size', 0)):>9} {m.get('context_length', 0):>8}  "
              f"{_until(m.get('expires_at'))}")
    return 0


def cmd_stop(args) -> int:
    loaded = {m.get("name") for m in _call(args, "GET", "/api/ps").get("models", [])}
    name = args.model[: -len(":latest")] if args.model.endswith(":latest") else args.model
    if name not in loaded:
        print(f"error: {name} is not loaded (`localllm ps` lists what is)", file=sys.stderr)
        return 1
    _call(args, "POST", "/api/generate", json={"model": name, "keep_alive": 0})
    print(f"{name}: unloaded")
    return 0


def add_commands(sub) -> None:
    def common(p):
        p.add_argument("--host", default="127.0.0.1", help="the server's address (default 127.0.0.1)")
        p.add_argument("--port", type=int, default=8080, help="the server's port (default 8080)")
        p.add_argument("--api-key", metavar="KEY", help="the server's key (default: $LOCALLLM_API_KEY)")
        p.add_argument("--timeout", type=float, default=30.0, help=argparse.SUPPRESS)

    p = sub.add_parser("ps", help="list the models a running server has loaded",
                       description="Ask a running `localllm serve` which models it has loaded: name, memory, "
                                   "context, and how long each stays (GET /api/ps).")
    common(p)
    p.add_argument("--json", action="store_true", help="print /api/ps's list of models as JSON")
    p.set_defaults(func=cmd_ps)

    p = sub.add_parser("stop", help="unload a model from a running server",
                       description="Unload MODEL from a running `localllm serve` once its requests end (as "
                                   "`ollama stop`: a request with keep_alive 0). A pinned model stays.")
    p.add_argument("model", metavar="MODEL", help="a model name, as `localllm ps` shows it")
    common(p)
    p.set_defaults(func=cmd_stop)
