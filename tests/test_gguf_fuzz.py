"""Hostile model files: mutants of two catalog models (metadata values and types, tensor dimensions, types,
offsets and names, header counts, truncation; gguf_mutate.py) are either refused with a clear ModelFileError
or run; never a signal, a traceback or a hang.

Most mutants are refused by the loader, which is pure Python, so they are checked in this process (no kernel
runs). The ones it accepts run `localllm run` in a subprocess, several per process (gguf_fuzz_runner.py), where
a kernel that wrote past its buffers would kill the process or corrupt the heap.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from conftest import model_file
from gguf_mutate import Mutator, parse
from localllm.architectures import load_model_config
from localllm.chat.template import ChatTemplate
from localllm.errors import LocalLLMError
from localllm.gguf_file import GGUFFile
from localllm.tokenizer import Tokenizer

# Mutants per model (the first of each is the file unchanged), and the seed that makes them the same every run.
MUTANTS = {"smollm2-135m-instruct": 200, "gemma3-270m": 110}
SEED = 13
RUNNER = Path(__file__).with_name("gguf_fuzz_runner.py")
# Seconds a subprocess may take: start-up, then each mutant (a load and 3 tokens take 1-4 s on 2 busy cores);
# and what one in-process check may take (0.1-1 s) before it counts as a hang.
PROCESS_SECONDS, MUTANT_SECONDS, IN_PROCESS_SECONDS = 60, 20, 30


def load_in_process(path: Path) -> None:
    """Everything the engine does with a file before it builds a weight or calls a kernel."""
    g = GGUFFile(path)
    try:
        load_model_config(g)
        Tokenizer.from_metadata(g.metadata)
        ChatTemplate.from_metadata(g.metadata, model_name=path.stem)
    finally:
        g.close()


class Hang(BaseException):
    """Raised by the alarm in a check that runs too long (a BaseException: the code under test catches
    Exception)."""


@pytest.fixture(scope="module")
def mutants(tmp_path_factory):
    """[(model, description, path or None, in-process outcome)]: outcome "refused" (a ModelFileError or other
    clean error), "loads" (the file is kept for the subprocess test), or the traceback of anything else."""
    out = []
    root = tmp_path_factory.mktemp("mutants")

    def alarm(signum, frame):
        raise Hang()

    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        for model, n in MUTANTS.items():
            source = model_file(model)
            g = GGUFFile(source)
            mutator = Mutator(parse(source), g.architecture, list(g.metadata["tokenizer.ggml.tokens"]), SEED)
            g.close()
            scratch = root / f"{model}-scratch.gguf"
            for i, m in enumerate(mutator.mutants(n)):
                m.layout.write(scratch)
                signal.alarm(IN_PROCESS_SECONDS)
                try:
                    load_in_process(scratch)
                except LocalLLMError:
                    out.append((model, m.description, None, "refused"))
                    continue
                except Hang:
                    out.append((model, m.description, None, f"the loader hung (over {IN_PROCESS_SECONDS} s)"))
                    continue
                except Exception:
                    out.append((model, m.description, None, traceback.format_exc()))
                    continue
                finally:
                    signal.alarm(0)
                kept = scratch.rename(root / f"{model}-{i}.gguf")
                out.append((model, m.description, kept, "loads"))
    finally:
        signal.signal(signal.SIGALRM, previous)
    yield out
    shutil.rmtree(root, ignore_errors=True)  # the kept headers: 2-7 MB each


def test_mutants_of_two_catalog_models_are_refused_with_a_clear_error_or_load(mutants):
    raised = [(model, d, outcome) for model, d, _, outcome in mutants if outcome not in ("refused", "loads")]
    assert not raised, "\n\n".join(f"{model}: {d}\n{tb}" for model, d, tb in raised)
    assert len(mutants) >= 300
    for model in MUTANTS:
        outcomes = [o for m, _, _, o in mutants if m == model]
        # The fuzzer reaches both sides of the loader: most mutants are refused, some still load and run.
        assert outcomes.count("refused") > len(outcomes) // 2, model
        assert outcomes.count("loads") >= 5, model


def run_batch(paths: list[Path], results: Path) -> tuple[list[dict], int | None]:
    """Run the files in one process; returns its records and its exit status (None: it timed out)."""
    results.write_text("")
    try:
        proc = subprocess.run([sys.executable, str(RUNNER), str(results), *map(str, paths)],
                              capture_output=True, timeout=PROCESS_SECONDS + MUTANT_SECONDS * len(paths))
        status = proc.returncode
    except subprocess.TimeoutExpired:
        status = None
    return [json.loads(line) for line in results.read_text().splitlines()], status


def test_mutants_that_load_run_without_a_signal_a_traceback_or_a_hang(mutants, tmp_path):
    loads = [(model, d, path) for model, d, path, outcome in mutants if outcome == "loads"]
    failures = []
    ran = 0
    todo = list(loads)
    while todo:
        records, status = run_batch([path for _, _, path in todo], tmp_path / "results.jsonl")
        finished = set()
        for r in records:
            model, description, _ = todo[r["i"]]
            if r["event"] == "raised":
                failures.append(f"{model}: {description}: a traceback\n{r['stderr']}")
            elif r["event"] == "done":
                ran += 1
                if r["rc"] not in (0, 1) or "Traceback" in r["stderr"]:
                    failures.append(f"{model}: {description}: exit {r['rc']}\n{r['stderr']}")
                elif r["rc"] == 1 and not r["stderr"].strip().splitlines()[-1].startswith("error: "):
                    failures.append(f"{model}: {description}: exit 1 without a clear message\n{r['stderr']}")
            if r["event"] in ("raised", "done"):
                finished.add(r["i"])
        started = [r["i"] for r in records if r["event"] == "start"]
        if status == 0 and len(finished) == len(todo):
            break
        # The process died or hung: the mutant it had started last is the culprit; go on after it.
        culprit = started[-1] if started else 0
        what = "hung" if status is None else f"died with exit status {status}"
        model, description, _ = todo[culprit]
        failures.append(f"{model}: {description}: the process {what}")
        todo = todo[culprit + 1:]
    assert not failures, "\n\n".join(failures)
    assert ran == len(loads)
