"""`localllm bench-serve URL --workload llama-vim`: replay what llama.vim sends to a server while a user types,
and measure the time from each keystroke's request to its suggestion.

The requests are built as llama.vim builds them (ggml-org/llama.vim autoload/llama.vim, a1c8e6e), with its
default settings (n_prefix 256 lines, n_suffix 64 lines, n_predict 128, ring_n_chunks 16, ring_chunk_size 64):

  1. the ring of extra context fills: 16 chunks of 33 lines picked from the other source files, one
     s:ring_update request (n_predict 0: a cache warm-up) as each chunk joins the ring;
  2. the user retypes lines of the edited file one character at a time from their indentation; each
     keystroke sends one llama#fim request to /infill (the first at a position: t_max_predict_ms 250) and
     waits for its answer, as the plugin does (it sends no new request while one is in flight).

Time to suggestion is the wall time of one keystroke's request. llama-server speaks the same protocol, so the
same command measures it: run both on the same model and machine, back to back, and compare the medians.
  3. when the cursor goes to the next retyped line, the ring moves: its oldest chunk leaves, a chunk of the
     edited file joins, and the ring update (a warm-up) is sent before the next keystroke (--no-ring-moves:
     the ring stays as it is).

Not replayed: llama.vim's speculative follow-up request after a suggestion is shown.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from localllm.bench.serving import percentile
from localllm.errors import LocalLLMError

N_PREFIX, N_SUFFIX, N_PREDICT = 256, 64, 128
RING_N_CHUNKS, RING_CHUNK_SIZE = 16, 64
FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
          "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
          "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated", "tokens_cached"]


def ring_update_body(extra: list[dict]) -> dict:
    return {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": extra, "prompt": "",
            "n_predict": 0, "temperature": 0.0, "samplers": [], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""]}


def fim_body(lines: list[str], y: int, x: int, extra: list[dict], first: bool = True) -> dict:
    """llama#fim for the cursor at column x of line y (0-based): s:fim_ctx_local, then the request."""
    cur = lines[y]
    prefix = "\n".join(lines[max(0, y - N_PREFIX):y]) + "\n"
    if not cur.strip():
        middle, cur_suffix, indent = "", "", 0
    else:
        middle, cur_suffix, indent = cur[:x], cur[x:], len(cur) - len(cur.lstrip())
    suffix = cur_suffix + "\n" + "\n".join(lines[y + 1:y + 1 + N_SUFFIX]) + "\n"
    return {"id_slot": 0, "input_prefix": prefix, "input_suffix": suffix, "input_extra": extra, "prompt": middle,
            "n_predict": N_PREDICT, "stop": [], "n_indent": indent, "top_k": 40, "top_p": 0.90,
            "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 250 if first else 1000, "response_fields": FIELDS}


def pick_ring(files: list[Path], n_chunks: int, rng: random.Random) -> list[dict]:
    """Chunks as s:pick_chunk cuts them: ring_chunk_size/2 + 1 lines from a random start."""
    ring = []
    for i in range(n_chunks):
        path = files[i % len(files)]
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
        half = RING_CHUNK_SIZE // 2
        if len(text) + 1 < RING_CHUNK_SIZE:
            chunk = text
        else:
            l0 = rng.randint(0, max(0, len(text) - half))
            chunk = text[l0:min(l0 + half, len(text)) + 1]
        ring.append({"text": "\n".join(chunk) + "\n", "time": [1767225600 + i, 0], "filename": path.name})
    return ring


def exchange(edit: Path, others: list[Path], n_lines: int, keystrokes: int, seed: int = 0,
             ring_chunks: int = RING_N_CHUNKS, ring_moves: bool = True):
    """(warm-up bodies, keystroke steps) of one editing session. A step is (body, after_ring_move), or
    (body, None) for a ring update sent between keystrokes: with `ring_moves`, when the cursor goes to the
    next line, llama.vim's s:pick_chunk takes the lines around it as a new chunk, and s:ring_update drops the
    ring's oldest chunk for it and sends a warm-up (n_predict 0) before the next keystroke."""
    rng = random.Random(seed)
    ring = pick_ring(others, ring_chunks, rng)
    warmups = [ring_update_body(ring[:n]) for n in range(1, len(ring) + 1)]
    lines = edit.read_text(encoding="utf-8", errors="replace").splitlines()
    candidates = [y for y, s in enumerate(lines) if len(s.strip()) >= keystrokes + 8]
    if not candidates:
        raise LocalLLMError(f"{edit} has no line long enough to type {keystrokes} characters of")
    steps = []
    for i, y in enumerate(sorted(rng.sample(candidates, min(n_lines, len(candidates))))):
        moved = False
        if ring_moves and i and ring:
            half = RING_CHUNK_SIZE // 2
            l0 = max(0, y - half - N_PREFIX // 2)  # s:pick_chunk: a chunk of the file away from the cursor's window
            chunk = {"text": "\n".join(lines[l0:l0 + half + 1]) + "\n", "time": [1767225700 + i, 0],
                     "filename": edit.name}
            ring = ring[1:] + [chunk]
            steps.append((ring_update_body(ring), None))
            moved = True
        original = lines[y]
        start = len(original) - len(original.lstrip())
        for x in range(start + 1, start + keystrokes + 1):
            typed = lines[:y] + [original[:x]] + lines[y + 1:]
            steps.append((fim_body(typed, y, x, ring), moved and x == start + 1))
    return warmups, steps


def default_files() -> tuple[Path, list[Path]]:
    """The edited file and the ring's sources: this package's own source (real code, on every install)."""
    here = Path(__file__).parent
    edit = here / "engine.py"
    others = sorted(p for p in here.glob("*.py") if p != edit and p.stat().st_size > 4000)
    return edit, others


def session_files(edit: str | None) -> tuple[Path, list[Path]]:
    if not edit:
        return default_files()
    edit_path = Path(edit)
    if not edit_path.is_file():
        raise LocalLLMError(f"no such file: {edit}")
    return edit_path, sorted(p for p in edit_path.parent.glob("*" + edit_path.suffix) if p != edit_path) or [edit_path]


def run(url: str, edit: str | None = None, n_lines: int = 3, keystrokes: int = 8, api_key: str | None = None,
        seed: int = 0, ring_chunks: int = RING_N_CHUNKS, ring_moves: bool = True,
        temperature: float | None = None) -> dict:
    import httpx

    edit_path, others = session_files(edit)
    warmups, steps = exchange(edit_path, others, n_lines, keystrokes, seed, ring_chunks, ring_moves)
    if temperature is not None:  # llama.vim sends none (the server's default); 0: answers two servers can compare
        for body, moved in steps:
            if moved is not None:
                body["temperature"] = temperature
    keys = [body for body, moved in steps if moved is not None]
    base = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=base, headers=headers, timeout=httpx.Timeout(600.0, connect=10.0)) as client:
        try:
            client.get("/health")
        except httpx.HTTPError as e:
            raise LocalLLMError(f"cannot reach {base}: {e}") from None

        def post(body: dict) -> tuple[float, dict | None, str | None]:
            t0 = time.perf_counter()
            try:
                r = client.post("/infill", content=json.dumps(body), headers={"Content-Type": "application/json"})
            except httpx.HTTPError as e:  # the server went away or broke the connection: say so, no traceback
                raise LocalLLMError(f"{base}/infill: {type(e).__name__}: {e}") from None
            dt = time.perf_counter() - t0
            if r.status_code != 200:
                return dt, None, f"HTTP {r.status_code}: {r.text[:300]}"
            return dt, r.json(), None

        t0 = time.perf_counter()
        for body in warmups:
            _, _, error = post(body)
            if error:
                raise LocalLLMError(f"{base}/infill refused a cache warm-up: {error}")
        warm_s = time.perf_counter() - t0
        answers, errors, ring_s = [], [], []
        for body, moved in steps:
            dt, out, error = post(body)
            if moved is None:  # a ring update between keystrokes: the plugin sends it from a timer
                if error:
                    errors.append(error)
                ring_s.append(dt)
                continue
            if error:  # a keystroke the server refused shows no suggestion; count it, go on typing
                errors.append(error)
                continue
            answers.append({"s": dt, "content": out.get("content", ""), "prompt_n": out.get("timings/prompt_n"),
                            "predicted_n": out.get("timings/predicted_n"), "tokens_cached": out.get("tokens_cached"),
                            "after_ring_move": moved})

    def med(key, rows):
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return percentile(vals, 50)

    shown = [a for a in answers if a["content"].strip()]
    within = [a["s"] for a in answers if not a["after_ring_move"]]
    moved = [a["s"] for a in answers if a["after_ring_move"]]
    return {"url": base, "workload": "llama-vim", "file": str(edit_path), "warmups": len(warmups),
            "warmup_s": warm_s, "keystrokes": len(keys), "failed": len(errors), "errors": sorted(set(errors))[:3],
            "suggestions": len(shown), "ring_moves": len(ring_s),
            "ring_update_s": {"p50": percentile(ring_s, 50)} if ring_s else None,
            "time_to_suggestion_s": {"p50": percentile([a["s"] for a in answers], 50),
                                     "p90": percentile([a["s"] for a in answers], 90),
                                     "p50_shown": percentile([a["s"] for a in shown], 50),
                                     "p50_within_line": percentile(within, 50) if within else None,
                                     "p50_after_ring_move": percentile(moved, 50) if moved else None},
            "prompt_n_p50": med("prompt_n", answers), "predicted_n_p50": med("predicted_n", answers),
            "tokens_cached_p50": med("tokens_cached", answers), "answers": answers}


def _ms(seconds) -> str:
    return "       -" if seconds is None else f"{1000 * seconds:8.1f} ms"


def format_report(res: dict) -> str:
    t = res["time_to_suggestion_s"]
    return "\n".join([
        f"llama.vim exchange at {res['url']} ({res['file']}): {res['warmups']} ring warm-ups in "
        f"{res['warmup_s']:.1f} s, then {res['keystrokes']} keystrokes",
        f"time to suggestion  p50 {1000 * t['p50']:8.1f} ms   p90 {1000 * t['p90']:8.1f} ms   "
        f"p50 of shown {1000 * t['p50_shown']:8.1f} ms",
        f"within a line p50   {_ms(t['p50_within_line'])}   first key after a ring move p50 "
        f"{_ms(t['p50_after_ring_move'])}   ring update p50 "
        f"{_ms((res['ring_update_s'] or {}).get('p50'))} ({res['ring_moves']} moves)",
        f"suggestions shown   {res['suggestions']}/{res['keystrokes']}"
        + (f" ({res['failed']} requests failed: {res['errors']})" if res["failed"] else ""),
        f"per keystroke (p50) {res['prompt_n_p50']:.0f} prompt tokens evaluated, {res['predicted_n_p50']:.0f} "
        f"generated, {res['tokens_cached_p50']:.0f} in the cache",
    ])


def main(args) -> int:
    if args.lines < 1 or args.keystrokes < 1 or args.ring_chunks < 0:
        raise LocalLLMError("--lines and --keystrokes must be at least 1, --ring-chunks at least 0")
    res = run(args.url, args.file, args.lines, args.keystrokes, args.api_key, ring_chunks=args.ring_chunks,
              ring_moves=not args.no_ring_moves, temperature=args.temperature)
    print(json.dumps(res) if args.json else format_report(res))
    return 0 if res["keystrokes"] and not res["failed"] else 1
