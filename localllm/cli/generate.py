"""Commands that run a model: `run`, `chat` (the TUI in `tui/`, or a plain REPL) and `perplexity`.

All of them consume `Engine.generate()` (or its scoring sibling); none touches tensors.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time

from localllm import parameters
from localllm.chat.history import fit_messages
from localllm.files import read_text_file
from localllm.runtime.kv_cache import KV_TYPES
from localllm.errors import LocalLLMError
from localllm.chat.loop_guard import CHAT_LOOP_PROTECTION, DRY_SEQUENCE_BREAKERS, NOTICE, RepeatGuard

MODEL_HELP = "catalog name, hub reference (hf.co/USER/REPO:QUANT) or path to a .gguf file"
MIN_PERPLEXITY_CHUNK = 3  # a chunk scores tokens first+1 .. c-1 with first = c // 2: none below 3


def whole_number(minimum: int, maximum: int | None = None, why: str = ""):
    """An argparse type: an integer in [minimum, maximum], else argparse's one-line usage error (exit 2) saying
    what is allowed, never a traceback further on (a count of 0 repetitions, a negative thread count)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum or (maximum is not None and value > maximum):
            allowed = f"at least {minimum}" if maximum is None else f"in {minimum}..{maximum}"
            raise argparse.ArgumentTypeError(f"must be {allowed}{why}, not {value}")
        return value

    parse.__name__ = "whole number"
    return parse


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, not {text}")
    return value


def add_sampling_options(p) -> None:
    g = p.add_argument_group("sampling (llama.cpp's defaults)")
    g.add_argument("-n", "--max-tokens", type=whole_number(-1), default=256,
                   help="tokens to generate at most (default 256; -1: until the model stops or the context is full)")
    for param in parameters.SAMPLING:  # --temp, --top-k, ... --xtc-threshold: the table's flags and ranges
        if param.flag is None:
            continue
        default, shown = param.default, param.default
        if param.name == "dry_multiplier":  # on in a chat (loop protection), llama.cpp's default elsewhere
            default, shown = None, (f"{CHAT_LOOP_PROTECTION['dry_multiplier']} in a chat (`chat`, `run --chat`), "
                                    f"else {param.default}")
        g.add_argument(param.flag, dest=param.name, type=parameter_type(param), default=default,
                       metavar="N" if param.kind is int else "X", help=f"{param.help} (default {shown})")
        if param.name == "dry_penalty_last_n":
            g.add_argument("--dry-sequence-breaker", action="append", default=None, metavar="TEXT",
                           help="DRY: a repeat never reaches back past this text (repeatable; replaces the "
                                "defaults \\n : \" *; 'none' for none)")
    g.add_argument("--no-loop-guard", action="store_true",
                   help="in a chat, do not stop an answer that repeats the same line or sentence over and over")
    g.add_argument("--seed", type=whole_number(0), default=None, help="random seed: same seed and settings, same text")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when this text is generated (repeatable; never printed)")
    g.add_argument("--ctx", type=whole_number(0), default=None,
                   help="context size in tokens (default: the model's, at most 4096)")
    add_kv_type_option(g)


def parameter_type(param):
    """An argparse type for a sampling parameter: its kind, within the table's range."""
    def parse(text: str):
        try:
            value = param.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'a number' if param.kind is float else 'an integer'}"
                                             ) from None
        why = param.problem(value)
        if why is not None:
            raise argparse.ArgumentTypeError(f"must be {why}, not {text}")
        return value

    parse.__name__ = param.kind.__name__
    return parse


def add_kv_type_option(p) -> None:
    p.add_argument("--kv-type", choices=KV_TYPES, default=parameters.KV_TYPE,
                   help="KV cache element type: f32, or q8_0 (8-bit, 3.6x smaller; see README for its measured "
                        f"perplexity cost) (default {parameters.KV_TYPE})")
    add_device_option(p)


def add_device_option(p) -> None:
    p.add_argument("--device", default=parameters.DEVICE, metavar="DEVICE",
                   help="where the model runs: cpu (Numba kernels, the default) or opencl[:PLATFORM:DEVICE] "
                        "(an OpenCL GPU or CPU device, by name substrings; `localllm devices` lists them)")


def generation_params(args):
    from localllm.runtime.engine import GenerationParams
    from localllm.chat.sampling import SamplingParams

    flags = {p.name: getattr(args, p.name) for p in parameters.SAMPLING if p.flag is not None}
    sampling = SamplingParams(**{**flags, **loop_protection(args)}, seed=args.seed)
    max_tokens = None if args.max_tokens is not None and args.max_tokens < 0 else args.max_tokens
    return GenerationParams(max_tokens=max_tokens, stop=list(args.stop), sampling=sampling,
                            context_overflow=args.context_overflow, n_keep=args.keep,
                            speculation=speculation_params(args))


def is_chat(args) -> bool:
    return args.command == "chat" or bool(getattr(args, "chat", False))


def loop_protection(args) -> dict:
    """DRY's multiplier and sequence breakers: in a chat (`chat`, `run --chat`) DRY is on unless --dry-multiplier
    says otherwise (CHAT_LOOP_PROTECTION, chosen by tools/measure_loops.py); a plain `run` keeps llama.cpp's
    defaults."""
    mult = args.dry_multiplier
    if mult is None:
        mult = CHAT_LOOP_PROTECTION["dry_multiplier"] if is_chat(args) else parameters.BY_NAME["dry_multiplier"].default
    breakers = args.dry_sequence_breaker
    if breakers is None:
        breakers = DRY_SEQUENCE_BREAKERS
    elif breakers == ["none"]:
        breakers = ()
    else:  # as llama.cpp's --dry-sequence-breaker, escapes like \n are read
        breakers = tuple(b.encode("latin-1", "backslashreplace").decode("unicode_escape") for b in breakers)
    return dict(dry_multiplier=mult, dry_sequence_breakers=breakers)


def add_speculation_options(p) -> None:
    g = p.add_argument_group("speculative decoding (lossless: the same output, faster where drafts are right)")
    g.add_argument("--spec", choices=["ngram", "draft"], default=None,
                   help="draft tokens by n-gram lookup in the prompt and the text so far (ngram), or with a smaller "
                        "model of the same vocabulary (draft, with --draft-model); the target checks a whole draft "
                        "in one forward, and the draft length adapts to what pays (off where nothing does)")
    g.add_argument("--draft-model", metavar="M", default=None,
                   help="the draft model for --spec draft (e.g. qwen2.5-coder-0.5b-instruct for the -1.5b)")
    g.add_argument("--draft-max", type=whole_number(1, 32), default=16, metavar="K",
                   help="tokens drafted per check at most (default 16; the draft length adapts below it)")


def speculation_params(args):
    from localllm.runtime.speculative import SpeculationParams

    spec = getattr(args, "spec", None)
    if spec is None:
        if getattr(args, "draft_model", None):
            raise LocalLLMError("--draft-model needs --spec draft")
        return None
    return SpeculationParams(mode=spec, draft_model=args.draft_model, draft_max=args.draft_max).validated()


def add_overflow_options(p, default: str, why: str) -> None:
    p.add_argument("--context-overflow", choices=["stop", "shift"], default=default,
                   help="at the context limit: stop (finish reason 'length') or shift (drop the older half of "
                        f"the tokens after --keep, as llama.cpp's context shift) (default {default}: {why})")
    p.add_argument("--keep", type=whole_number(-1), default=0, metavar="N",
                   help="tokens a context shift always keeps at the start, e.g. the system prompt; -1: the whole "
                        "prompt (default 0; the BOS is always kept)")


def add_offline_option(p) -> None:
    p.add_argument("--offline", action="store_true",
                   help="never download: a model that is not in the store is an error (default: a catalog model "
                        "or hub reference that is missing is pulled first, with a progress bar)")


def ensure_model(args) -> str:
    """The model's file, pulled first when it is a missing catalog model or hub reference (unless --offline)."""
    from localllm.store import local as store

    return str(store.ensure(args.model, offline=getattr(args, "offline", False)))


def load_engine(args):
    from localllm.runtime.engine import Engine

    # run and chat generate for one sequence at a time: the whole-forward path only (perplexity scores op by op).
    warm = "all" if args.command == "perplexity" else "first-token"
    return Engine.load(ensure_model(args), ctx=args.ctx, kv_type=args.kv_type, device=args.device, warm=warm)


# ---- run -------------------------------------------------------------------------------------------------


def cmd_run(args) -> int:
    if args.prompt_file:
        prompt = read_text_file(args.prompt_file)
    elif args.prompt is not None:
        prompt = args.prompt
    else:
        raise LocalLLMError("give a prompt, or --prompt-file FILE")
    if (args.prompt_cache_all or args.prompt_cache_ro) and not args.prompt_cache:
        raise LocalLLMError("--prompt-cache-all and --prompt-cache-ro need --prompt-cache FILE")
    if args.prompt_cache:
        check_prompt_cache_file(args.prompt_cache)
    params = generation_params(args)
    schema = read_text_file(args.json_schema) if args.json_schema else None
    gbnf = read_text_file(args.grammar) if args.grammar else None
    engine = load_engine(args)
    if schema is not None or gbnf is not None:
        from localllm.chat.grammar import compile_grammar

        where = args.json_schema or args.grammar
        try:
            params.grammar = compile_grammar(engine.tokenizer, engine.config.vocab_size, json_schema=schema,
                                             gbnf=gbnf)
        except LocalLLMError as e:
            raise LocalLLMError(f"{where}: {e}") from None
    if args.chat:
        prompt = engine.render_chat([{"role": "user", "content": prompt}])
    tokens = engine.tokenize_prompt(prompt, chat=args.chat)
    seq = open_prompt_cache(engine, args.prompt_cache) if args.prompt_cache else engine.new_sequence()
    generated, pieces, final = [], [], None
    guard = RepeatGuard() if args.chat and not args.no_loop_guard else None
    # -n 0 (as llama.cpp's): the prompt is evaluated (and, with --prompt-cache, saved); one final event, no token.
    events = engine.generate(tokens, params, seq=seq)
    for event in events:
        if args.prompt_cache and final is None and not args.prompt_cache_ro:
            # As llama.cpp: the prompt's state is saved once it is evaluated (the first token just came out).
            save_prompt_cache(engine, seq, args.prompt_cache, len(tokens))
        if event.token is not None:
            generated.append(event.token)
        pieces.append(event.text)
        if not args.json:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        final = event
        if guard is not None and event.finish_reason is None and guard.feed(event.text):
            events.close()
            final.finish_reason = "loop"
            print(f"\n[{NOTICE}]", file=sys.stderr)
            break
    if args.prompt_cache_all and not args.prompt_cache_ro:
        save_prompt_cache(engine, seq, args.prompt_cache)  # the prompt and what was generated
    seq.close()
    timings = final.timings.to_dict()
    if args.json:
        print(json.dumps({"tokens": generated, "text": "".join(pieces), "prompt_tokens": len(tokens),
                          "timings": timings}, ensure_ascii=False))
    else:
        print()
        if args.verbose:
            spec = (f"; drafts accepted {timings['draft_n_accepted']}/{timings['draft_n']}, "
                    f"{timings['tokens_per_verify']:.2f} tokens per check" if params.speculation else "")
            print(f"[prompt {timings['prompt_n']} tokens, {timings['prompt_per_second']:.1f} tok/s; "
                  f"generated {timings['predicted_n']} tokens, {timings['predicted_per_second']:.1f} tok/s{spec}; "
                  f"finish: {final.finish_reason}]", file=sys.stderr)
    return 0


def check_prompt_cache_file(path) -> None:
    """Refuse, before anything runs, a --prompt-cache FILE that exists and is not a session file: the run would
    replace it (llama.cpp refuses such a file too). Missing and empty files are fine: a new session goes there."""
    import os

    from localllm.runtime import session_file

    if not os.path.lexists(path) or (os.path.isfile(path) and os.path.getsize(path) == 0):
        return
    if not session_file.is_session_file(path):
        raise LocalLLMError(f"--prompt-cache {path}: the file exists and is not a localllm session file; refusing to "
                            "overwrite it (name a new file, or remove this one)")


def open_prompt_cache(engine, path):
    """A sequence holding the saved session in `path` when it is usable; else a fresh one (with a warning when the
    file is a session from another model, or damaged, which this run then replaces: it is only a cache)."""
    import os

    from localllm.runtime import session_file

    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return engine.new_sequence()
    try:
        return session_file.load(engine, path)
    except session_file.NotASessionFile as e:  # replaced since check_prompt_cache_file looked
        raise LocalLLMError(f"--prompt-cache {path}: {e}; refusing to overwrite it") from None
    except LocalLLMError as e:
        print(f"warning: ignoring the prompt cache: {e}", file=sys.stderr)
        return engine.new_sequence()


def save_prompt_cache(engine, seq, path, n_tokens=None) -> None:
    from localllm.runtime import session_file

    try:
        session_file.save(engine, seq, path, n_tokens)
    except LocalLLMError as e:
        print(f"warning: {e}", file=sys.stderr)


# ---- chat ------------------------------------------------------------------------------------------------


def cmd_chat(args) -> int:
    if args.plain or not (sys.stdin.isatty() and sys.stdout.isatty()):
        return chat_plain(args)
    from localllm.tui.chat_app import run
    from localllm.tui.settings import load_reporting

    saved, notices = load_reporting()
    if args.model is not None:
        ensure_model(args)  # pull a missing model here, with a progress bar, before the app takes the screen
    return run(args.model, chat_settings_overrides(args, saved), notices)


def chat_settings_overrides(args, saved):
    """The TUI's saved settings, with the options given on this command line on top (for this session; F2 saves)."""
    from dataclasses import replace

    names = [p.name for p in parameters.chat_settings() if p.name != "dry_multiplier"]  # the chat app's own
    changes = {name: getattr(args, name) for name in names + ["max_tokens", "context_overflow", "keep"]
               if getattr(args, name) != args.parser_default(name)}
    if "max_tokens" in changes and changes["max_tokens"] < 0:
        changes["max_tokens"] = -1
    if args.system is not None:
        changes["system_prompt"] = args.system
    if args.ctx is not None:
        changes["ctx"] = args.ctx
    if args.seed is not None:
        changes["seed"] = args.seed
    if args.dry_multiplier is not None:
        changes["dry_multiplier"] = args.dry_multiplier
    if args.no_loop_guard:
        changes["loop_guard"] = False
    if args.stop:
        changes["stop"] = list(args.stop)
    if args.spec is not None:
        changes["speculation"] = args.spec
    if args.draft_model is not None:
        changes["draft_model"] = args.draft_model
    if args.device is not None:
        changes["device"] = args.device
    if args.kv_type is not None:
        changes["kv_type"] = args.kv_type
    try:
        return replace(saved, **changes).validated()
    except ValueError as e:
        raise LocalLLMError(str(e)) from None


def chat_plain(args) -> int:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    from localllm.store import catalog

    if args.model is None:
        args.model = catalog.default_entry().name
    args.device, args.kv_type = args.device or parameters.DEVICE, args.kv_type or parameters.KV_TYPE
    engine = load_engine(args)
    if args.context_overflow == "shift" and not engine.model.can_shift:
        args.context_overflow = "stop"  # sliding-window layers (gemma3) cannot shift; see Transformer.can_shift
    params = generation_params(args)
    seq = engine.new_sequence()
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print(f"Chatting with {engine.name}. Ctrl-C stops an answer, Ctrl-D (or /bye) quits, /clear forgets.")
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            continue
        if line.strip() in ("/bye", "/exit", "/quit"):
            return 0
        if line.strip() == "/clear":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        answer = []
        try:
            kept, dropped = fit_messages(engine, messages, room=min(params.max_tokens or engine.ctx, engine.ctx // 4))
            if dropped:
                print(f"(the oldest {dropped} messages no longer fit the context: dropped)", file=sys.stderr)
                messages[:] = kept
            prompt = engine.render_chat(messages)
            guard = None if args.no_loop_guard else RepeatGuard()
            events = engine.generate(engine.tokenize_prompt(prompt, chat=True), params, seq=seq)
            for event in events:
                answer.append(event.text)
                sys.stdout.write(event.text)
                sys.stdout.flush()
                if guard is not None and event.finish_reason is None and guard.feed(event.text):
                    events.close()
                    sys.stdout.write(f"\n[{NOTICE}]")
                    break
        except KeyboardInterrupt:
            sys.stdout.write(" [stopped]")
        except LocalLLMError as e:
            messages.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        print()
        messages.append({"role": "assistant", "content": "".join(answer)})


# ---- perplexity ------------------------------------------------------------------------------------------


def perplexity(engine, text: str, n_ctx: int = 512, progress=None) -> dict:
    """llama.cpp's `llama-perplexity` protocol: chunks of n_ctx tokens, each from an empty cache (BOS first when
    the model adds one), scoring the second half of each chunk."""
    import numpy as np

    if n_ctx < MIN_PERPLEXITY_CHUNK:
        raise LocalLLMError(f"-c must be at least {MIN_PERPLEXITY_CHUNK}: a chunk scores its tokens after the first "
                            f"half, and {n_ctx} leaves none")
    tokens = engine.tokenizer.encode(text, add_special=True, parse_special=False)
    n_chunks = len(tokens) // n_ctx
    if n_chunks == 0:
        raise LocalLLMError(f"the text is {len(tokens)} tokens, shorter than one {n_ctx}-token chunk")
    if n_ctx > engine.ctx:
        raise LocalLLMError(f"-c {n_ctx} is larger than the context ({engine.ctx}); raise --ctx")
    nll, count = 0.0, 0
    first = n_ctx // 2
    for i in range(n_chunks):
        chunk = tokens[i * n_ctx : (i + 1) * n_ctx]
        if engine.tokenizer.add_bos and engine.tokenizer.bos_id is not None:
            chunk[0] = engine.tokenizer.bos_id
        scored = np.arange(first, n_ctx - 1)
        logprobs = engine.log_probs(chunk, positions=scored)
        targets = np.asarray(chunk[first + 1 :])
        nll -= float(logprobs[np.arange(len(scored)), targets].sum(dtype=np.float64))
        count += len(targets)
        if progress:
            progress(i + 1, n_chunks, math.exp(nll / count))
    return {"ppl": math.exp(nll / count), "chunks": n_chunks, "n_ctx": n_ctx, "tokens": len(tokens),
            "scored": count}


def cmd_perplexity(args) -> int:
    text = read_text_file(args.file)
    engine = load_engine(args)

    def show(done, total, ppl):
        if not args.json:
            print(f"[{done}/{total}] ppl {ppl:.4f}", file=sys.stderr, flush=True)

    result = perplexity(engine, text, args.c, progress=show)
    if args.json:
        print(json.dumps({**result, "model": engine.name}))
    else:
        print(f"perplexity {result['ppl']:.4f} over {result['chunks']} chunks of {result['n_ctx']} tokens")
    return 0


def cmd_bench(args) -> int:
    from localllm.backends import host_kernels
    from localllm.kernels.membw import read_bandwidth
    from localllm.bench import speed as bench
    from localllm.store import local as store
    from localllm.runtime.engine import Engine

    ops = host_kernels()
    if args.threads:
        ops.set_threads(args.threads)
    names = list(args.models)
    if args.present:
        names += [m.name for m in store.local_models() if m.entry is not None and m.name not in names]
    if not names:
        raise LocalLLMError("name a model, or use --present for every downloaded catalog model")
    spec = speculation_params(args)
    if spec is not None:
        return bench_speculative(args, names, spec)
    machine_bandwidth = None if args.no_bandwidth else read_bandwidth() / 1e9
    results = []
    for name in names:
        bench.reset_peak_rss()
        t0 = time.perf_counter()
        engine = Engine.load(name, ctx=max(args.ctx or 0, args.p + args.n + 16, args.depth + max(args.n, args.p) + 16,
                                           args.chat_turn + 64, 512 + 16),
                             quiet=args.json, kv_type=args.kv_type, device=args.device, warm="first-token")
        load_s = time.perf_counter() - t0
        result = bench.run(engine, n_prompt=args.p, n_gen=args.n, reps=args.r, depth=args.depth)
        result["load_s"] = load_s
        result["rss_peak_bytes"] = bench.peak_rss()
        result["kv_bytes"] = engine.kv_pool.nbytes
        if args.llama_bench:
            # Back to back with localllm's run, on the same file and thread count: quote the ratio, not the figures.
            result["llama_cpp"] = bench.llama_bench(args.llama_bench, engine.path, args.p, args.n, args.r,
                                                    ops.threads(), args.depth, kv_type=args.kv_type)
        if machine_bandwidth is not None:
            result["machine_bandwidth_gbs"] = machine_bandwidth
        if args.k_ratio:
            result["k_ratio"] = bench.k_token_ratios(engine)
        if args.chat_turn:
            result["chat_turn"] = bench.chat_turn(engine, history=args.chat_turn)
        results.append(result)
        del engine  # freed before the next model loads: each one's peak RSS is its own
        gc.collect()
        if not args.json:
            print(f"{name}: done", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results))
    else:
        if args.p > 0 or args.n > 0:
            print(bench.format_rows(results, ops.threads()))
        for device in sorted({r["device"] for r in results} - {"cpu"}):
            print(f"device: {device} (the threads column is the CPU backend's)")
        for r in results:
            for line in bench.format_extras(r):
                print(line)
    return 0


def bench_speculative(args, names, spec) -> int:
    """bench --spec: greedy decode of a prompt with and without speculation (the same tokens), tokens/s of each."""
    from localllm.bench import speed as bench
    from localllm.runtime.engine import Engine

    prompt = read_text_file(args.prompt_file) if args.prompt_file else bench.SPEC_PROMPT
    results = []
    for name in names:
        engine = Engine.load(name, ctx=args.ctx, quiet=args.json, kv_type=args.kv_type, device=args.device,
                             warm="first-token")
        results.append(bench.speculative(engine, engine.tokenize_prompt(prompt), spec, n_gen=args.n, reps=args.r,
                                         stop=args.stop))
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results))
    else:
        for r in results:
            print(bench.format_speculative(r))
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser("run", help="generate text from a prompt (streamed)",
                       description="Generate a completion of a prompt, streamed to stdout. Raw completion by "
                                   "default; --chat wraps the prompt in the model's chat template.")
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("prompt", nargs="?", help="the prompt text")
    p.add_argument("-f", "--prompt-file", help="read the prompt from a file")
    p.add_argument("--chat", action="store_true", help="apply the chat template (the prompt is a user message)")
    p.add_argument("--json", action="store_true",
                   help='print {"tokens", "text", "prompt_tokens", "timings"} once at the end')
    p.add_argument("-v", "--verbose", action="store_true", help="print speed and finish reason to stderr")
    p.add_argument("--prompt-cache", metavar="FILE",
                   help="reuse the saved state of a previous prompt from FILE (its longest common prefix with "
                        "this prompt is not evaluated again), then save this prompt's state to FILE, as llama.cpp "
                        "(an existing FILE that is not a session file is refused, never overwritten)")
    p.add_argument("--prompt-cache-all", action="store_true",
                   help="with --prompt-cache: also save the generated tokens")
    p.add_argument("--prompt-cache-ro", action="store_true",
                   help="with --prompt-cache: only read FILE, never update it")
    g = p.add_argument_group("structured output (the answer is constrained to match; one of them)")
    g = g.add_mutually_exclusive_group()
    g.add_argument("--json-schema", metavar="FILE",
                   help="a JSON schema (a .json file): the answer is JSON that validates against it")
    g.add_argument("--grammar", metavar="FILE",
                   help="a llama.cpp GBNF grammar (a .gbnf file; its rule 'root' is the answer)")
    add_sampling_options(p)
    add_overflow_options(p, "stop", "a completion never silently loses the start of its prompt")
    add_speculation_options(p)
    add_offline_option(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("chat", help="chat with a model in the terminal",
                       description="Chat with a model in a terminal app: answers stream in as Markdown; F1 lists "
                                   "the keys (Enter sends, Ctrl+J new line, Esc stops, Ctrl+R regenerates, F2 "
                                   "settings, F3 models, F4 saved conversations). Settings and conversations are "
                                   "kept in $LOCALLLM_HOME (default ~/.local/share/localllm); the options below "
                                   "override the saved settings for this session. Each turn reuses the cached "
                                   "conversation. With --plain, or when stdin or stdout is not a terminal, a "
                                   "line-by-line REPL instead (Ctrl-C stops an answer, /bye quits, /clear forgets).")
    p.add_argument("model", nargs="?", metavar="MODEL", help=MODEL_HELP + " (default: the default model)")
    p.add_argument("--plain", action="store_true", help="a plain line-by-line REPL instead of the terminal app")
    p.add_argument("--system", help="a system prompt")
    add_sampling_options(p)
    add_overflow_options(p, "shift", "an answer that reaches the context limit goes on, forgetting the "
                         "oldest tokens, instead of being cut off mid-sentence; models with sliding-window layers "
                         "stop instead")
    add_speculation_options(p)
    add_offline_option(p)
    # --device and --kv-type not given: the saved settings (F2; cpu and f32 unless changed there)
    p.set_defaults(func=cmd_chat, max_tokens=1024, device=None, kv_type=None, parser_default=p.get_default)

    p = sub.add_parser("perplexity", help="measure perplexity on a text file (llama.cpp's protocol)",
                       description="Perplexity of a model on a text file, as llama-perplexity computes it: "
                                   "chunks of -c tokens from an empty cache, scoring the second half of each.")
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("file", help="a UTF-8 text file")
    p.add_argument("-c", type=whole_number(MIN_PERPLEXITY_CHUNK, why=" (each chunk scores its second half)"),
                   default=512, help="tokens per chunk (default 512)")
    p.add_argument("--ctx", type=whole_number(0), default=None,
                   help="context size (default: the model's, at most 4096)")
    add_kv_type_option(p)
    p.add_argument("--json", action="store_true", help='print {"ppl", "chunks", ...}')
    p.set_defaults(func=cmd_perplexity)

    p = sub.add_parser("bench", help="measure prompt and generation speed (like llama-bench)",
                       description="Prompt processing (pp) and generation (tg) tokens/s, mean ± sd over "
                                   "repetitions, measured as llama-bench measures them.")
    p.add_argument("models", nargs="*", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--present", action="store_true", help="every downloaded catalog model")
    p.add_argument("-p", type=whole_number(0), default=512, help="prompt tokens (default 512; 0 skips)")
    p.add_argument("-n", type=whole_number(0), default=128, help="generated tokens (default 128; 0 skips)")
    p.add_argument("-r", type=whole_number(1), default=3, help="repetitions (default 3)")
    p.add_argument("-t", "--threads", type=whole_number(1), default=None, help="threads (default: all cores)")
    p.add_argument("--ctx", type=whole_number(0), default=None, help="context size (default: enough for the test)")
    p.add_argument("-d", "--depth", type=whole_number(0), default=0, metavar="N",
                   help="also time pp and tg after N tokens of context (llama-bench -d N; default 0: skip)")
    p.add_argument("--llama-bench", metavar="PATH", default=None,
                   help="run llama.cpp's llama-bench (this binary) on the same file, tests and threads right after "
                        "each model, and print its t/s and localllm's ratio beside")
    add_kv_type_option(p)
    p.add_argument("--chat-turn", type=whole_number(0), default=512, metavar="N",
                   help="time a chat's next turn after N tokens of history (TTFT with the cache and cold, TPOT) "
                        "(default 512; 0 skips)")
    p.add_argument("--no-k-ratio", dest="k_ratio", action="store_false",
                   help="skip timing k-token forwards against 1-token ones (k = 2, 4, 8)")
    p.add_argument("--no-bandwidth", action="store_true", help="skip measuring the machine's read bandwidth")
    p.add_argument("--prompt-file", metavar="F", default=None,
                   help="with --spec: the prompt to decode from (default: a small built-in code edit)")
    p.add_argument("--stop", metavar="S", action="append", default=None,
                   help="with --spec: end each decode where S appears, or at the end of generation (-n tokens at "
                        "most): a whole answer, e.g. --stop $'\\n```' for an edited file (repeatable)")
    add_speculation_options(p)
    p.add_argument("--json", action="store_true", help='print {"pp", "tg", "pp_sd", "tg_sd", ...}')
    p.set_defaults(func=cmd_bench)
