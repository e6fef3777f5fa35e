"""How the package installs and imports: its own namespace, no side effects on import, no import cycles."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from conftest import parse_python

ROOT = Path(__file__).resolve().parent.parent
# The folders the design card names at the top level, and the package each installs as.
FOLDERS = {"localllm": "localllm", "kernels": "localllm.kernels", "tui": "localllm.tui", "models": "localllm.models"}


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_top_level_folders_install_under_the_localllm_namespace():
    out = json.loads(_run("import json, localllm.kernels, localllm.tui, localllm.models;"
                          "print(json.dumps([m.__file__ for m in (localllm.kernels, localllm.tui, localllm.models)]))"))
    assert [Path(f).parent.name for f in out] == ["kernels", "tui", "models"]


def test_no_module_imports_the_bare_folder_names():
    """`import kernels` would find whatever else is installed under that name (Hugging Face's `kernels`)."""
    offenders = []
    for name, path in _modules().items():
        for node in ast.walk(parse_python(path)):
            targets = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{name}: {t}" for t in targets if t.split(".")[0] in ("kernels", "tui", "models")]
    for path in sorted((ROOT / "tests").glob("*.py")):
        text = path.read_text()
        offenders += [f"{path.name}: {line}" for line in text.splitlines()
                      if line.lstrip().startswith(("import kernels", "from kernels", "from tui", "import tui",
                                                   "from models", "import models"))]
    assert offenders == []


def test_importing_the_library_sets_no_environment_and_does_not_sleep():
    """A library import must not set OpenMP variables, Numba's cache directory or BLAS limits, nor wait 50 ms
    measuring the machine: those happen when the CPU kernels are first used (kernels/cpu/process_settings.py)."""
    out = json.loads(_run(
        "import os, json, time\n"
        "before = dict(os.environ)\n"
        "import localllm.kernels.ops, localllm.runtime.engine, localllm.server.app, localllm.tui.chat_app, localllm.store.catalog\n"
        "from localllm.kernels.cpu import process_settings as runtime\n"
        "changed = sorted(k for k in set(os.environ) | set(before) if os.environ.get(k) != before.get(k))\n"
        "print(json.dumps({'changed': changed, 'configured': runtime._done}))"))
    assert out == {"changed": [], "configured": False}


def test_first_kernel_use_applies_the_thread_settings():
    out = json.loads(_run(
        "import os, json, numpy as np\n"
        "os.environ.pop('OMP_WAIT_POLICY', None); os.environ.pop('GOMP_SPINCOUNT', None)\n"
        "from localllm.kernels import ops\n"
        "from gguf import GGMLQuantizationType as T\n"
        "w = ops.Weight(np.zeros((4, 32 * 2 + 4), np.uint8)[:, :34 * 2].copy(), T.Q8_0)\n"
        "print(json.dumps({'threads': ops.threads(), 'wait': [os.environ.get(k) for k in "
        "('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT')]}))"))
    assert out["threads"] >= 1
    assert out["wait"] in (["PASSIVE", None], [None, "2000"])


def test_there_are_no_import_cycles():
    """Every import points down the layers (README, "How it is built"), including imports inside functions:
    a cycle through a function-level import still means two modules each need the other."""
    modules = _modules()
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        deps = set()
        for sub in ast.walk(parse_python(path)):
            if isinstance(sub, ast.Import):
                deps |= {a.name for a in sub.names}
            elif isinstance(sub, ast.ImportFrom) and sub.level == 0 and sub.module:
                deps.add(sub.module)
                deps |= {f"{sub.module}.{a.name}" for a in sub.names}
        # A package's __init__ is imported with each of its modules, but that is not a dependency between them.
        graph[name] = {d for d in deps if d in known and d != name and not name.startswith(d + ".")}
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert cycles == []
