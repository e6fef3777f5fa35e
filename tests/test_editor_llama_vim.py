"""The real llama.vim (vendored in tests/clients/llama.vim, see its README) in Vim under tmux, against
`localllm serve qwen2.5-coder-0.5b-instruct`: as a user, type in a buffer, see the suggestion, press Tab.

Nothing here replays the plugin's requests: its own Vim script builds them, sends them with curl and reads the
answers (s:fim_on_response drops one that does not match '"content"\\s*:"', so this is where the server's byte
format is checked by the client itself). Vim writes its state to a file every 100 ms (whether the plugin shows
a hint, the cursor, the mode); what the screen shows is read with tmux capture-pane.

Needs vim (with +textprop and +timers), tmux and curl: `.ci/run` installs them from Debian's packages; in CI a
missing one is a failure, elsewhere the tests skip with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import model_file
from test_server import start_server, stop_server

CODER = "qwen2.5-coder-0.5b-instruct"
PLUGIN = Path(__file__).parent / "clients" / "llama.vim"
# A suggestion may take a while on 2 busy cores: the plugin's first requests read its ring of extra context.
WAIT = 240.0

VIMRC = """\
set nocompatible
set runtimepath^={plugin}
let g:llama_config = {{'endpoint_fim': '{url}/infill', 'endpoint_inst': '{url}/v1/chat/completions',
      \\ 'show_info': 0}}
set noswapfile nobackup shortmess+=I encoding=utf-8
function! WriteState(timer)
  call writefile([llama#is_fim_hint_shown() ? 'shown' : 'none', line('.') . ':' . col('.'), mode(),
        \\ has('textprop') && has('timers') ? 'ok' : 'old vim'], '{state}.new')
  call rename('{state}.new', '{state}')
endfunction
call timer_start(100, 'WriteState', {{'repeat': -1}})
"""


def _tools_or_skip() -> None:
    missing = [t for t in ("vim", "tmux", "curl") if shutil.which(t) is None]
    if missing:
        why = f"{', '.join(missing)} not installed (apt-get install vim tmux curl)"
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the llama.vim tests: {why}")
        pytest.skip(why)


@pytest.fixture(scope="module")
def server():
    _tools_or_skip()
    model_file(CODER)
    proc, url = start_server(CODER, "--ctx", "4096")
    yield url
    err = stop_server(proc)
    assert "Traceback" not in err, err


class Vim:
    """Vim with llama.vim loaded, in a tmux server of its own (its own socket, killed at the end)."""

    def __init__(self, tmp: Path, url: str, path: Path):
        self.state = tmp / "state"
        vimrc = tmp / "vimrc"
        vimrc.write_text(VIMRC.format(plugin=PLUGIN, url=url, state=self.state))
        self.socket = f"localllm-test-{uuid.uuid4().hex[:8]}"
        env = {**os.environ, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": str(tmp)}
        self._tmux("new-session", "-d", "-x", "110", "-y", "30",
                   f"vim -N -i NONE -u {vimrc} {path}", env=env)

    def _tmux(self, *args, env=None) -> str:
        out = subprocess.run(["tmux", "-u", "-L", self.socket, "-f", "/dev/null", *args], capture_output=True,
                             text=True, timeout=30, env=env)
        assert out.returncode == 0, out.stderr
        return out.stdout

    def keys(self, *keys: str, literal: bool = False) -> None:
        self._tmux("send-keys", "-t", "0", *(["-l"] if literal else []), *keys)

    def type(self, text: str, pause: float = 0.15) -> None:
        """One key at a time, as a person types (each keystroke moves the cursor: the plugin asks again)."""
        for ch in text:
            self.keys(ch, literal=True)
            time.sleep(pause)

    def screen(self) -> list[str]:
        return self._tmux("capture-pane", "-p", "-t", "0").splitlines()

    def read_state(self) -> list[str]:
        """[hint shown or none, line:col, mode, ok]; ["", "", "", ""] before Vim first wrote it."""
        try:
            return self.state.read_text().splitlines()
        except FileNotFoundError:
            return [""] * 4

    def wait(self, test, what: str, timeout: float = WAIT):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = test()
            if got:
                return got
            time.sleep(0.2)
        pytest.fail(f"timed out waiting for {what}; state {self.read_state()}, screen:\n" + "\n".join(self.screen()))

    def started(self) -> None:
        state = self.wait(lambda: self.read_state()[0] and self.read_state(), "Vim to start", 60)
        if state[3] != "ok":
            pytest.fail(f"{shutil.which('vim')} lacks +textprop or +timers, which llama.vim needs")
        if state[2].startswith("r"):  # a hit-enter prompt (llama.vim warns on Vim 9.0 that it wants 9.1)
            self.keys("Enter")
        self.wait(lambda: self.read_state()[2:3] == ["n"], "normal mode", 30)

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=30)


@pytest.fixture
def vim_at(server, tmp_path):
    opened = []

    def open_(text: str) -> tuple[Vim, Path]:
        path = tmp_path / "demo.py"
        path.write_text(text)
        vim = Vim(tmp_path, server, path)
        opened.append(vim)
        vim.started()
        return vim, path

    yield open_
    for vim in opened:
        vim.close()


def test_typing_in_vim_shows_llama_vims_suggestion_and_tab_inserts_it(vim_at):
    vim, path = vim_at("def add(a, b):\n    return a + b\n\n\ndef multiply(a, b):\n")
    vim.keys("G", "o")  # a new line under `def multiply(a, b):`, in insert mode
    vim.wait(lambda: vim.read_state()[1:3] == ["6:1", "i"], "insert mode on line 6", 30)
    vim.type("    return")
    vim.wait(lambda: vim.read_state()[:2] == ["shown", "6:11"], "a suggestion after '    return'")
    shown = vim.screen()[5].rstrip()  # the ghost text after the cursor, on the screen's 6th row
    assert shown.startswith("    return") and len(shown) > len("    return"), vim.screen()
    vim.keys("Tab")
    vim.wait(lambda: vim.read_state()[1] not in ("", "6:11"), "the cursor to move past what was inserted", 30)
    vim.keys("Escape")
    vim.keys(":w", "Enter")
    lines = vim.wait(lambda: len(path.read_text().splitlines()) >= 6 and path.read_text().splitlines(),
                     "the file to be written")
    # Tab inserted what was shown: the line on disk is the line on the screen
    assert lines[5] == shown and lines[5] != "    return", (lines, shown)


def test_llama_vims_instruction_mode_rewrites_the_selection_on_tab(vim_at):
    original = "def multiply(a, b):\n    return a * b\n"
    vim, path = vim_at(original)
    vim.keys("g", "g", "V", "j")  # select both lines
    vim.keys("\\lli", literal=True)  # <leader>lli: :LlamaInstruct, which asks for the instruction
    vim.wait(lambda: any(row.startswith("Instruction:") for row in vim.screen()), "the instruction prompt", 30)
    instruction = "Rename the function multiply to times"
    vim.keys(instruction, literal=True)
    # Enter only once Vim shows the whole instruction: sent while the prompt was still taking the typed text, it
    # was lost once in a full run (the prompt sat there until the wait ran out)
    vim.wait(lambda: any(row.startswith("Instruction: " + instruction) for row in vim.screen()),
             "the typed instruction", 30)
    vim.keys("Enter")
    # streamed from /v1/chat/completions; the plugin marks the selection ready once curl exits
    vim.wait(lambda: any("Ready!" in row for row in vim.screen()), "the instruction's result")
    vim.keys("Tab")  # llama#inst_accept: the selection is replaced by the result
    vim.keys(":w", "Enter")
    # the selection replaced by the model's answer (qwen2.5-coder-0.5b renames it: "def times(a, b):")
    text = vim.wait(lambda: path.read_text() != original and path.read_text(), "the file to be rewritten")
    assert text.strip(), text


class _StubInfill(BaseHTTPRequestHandler):
    """A server that answers every /infill with one suggestion written with the server's `separators`."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.requests += 1
        body = json.dumps({"content": " a * b", "timings/prompt_n": 1, "timings/prompt_ms": 1.0,
                           "timings/prompt_per_token_ms": 1.0, "timings/prompt_per_second": 1000.0,
                           "timings/predicted_n": 4, "timings/predicted_ms": 4.0,
                           "timings/predicted_per_token_ms": 1.0, "timings/predicted_per_second": 1000.0,
                           "truncated": False, "tokens_cached": 12}, separators=self.server.separators).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("separators, shown", [((",", ":"), True), ((", ", ": "), False)],
                         ids=["compact-as-llama.cpp", "spaced-as-json.dumps"])
def test_llama_vim_shows_only_answers_written_as_llamacpp_writes_them(tmp_path, separators, shown):
    """Why item 1 of issue 37: the same suggestion, from a stub server, is shown when written compactly and
    dropped by s:fim_on_response when written with Python's default separators ('"content": "')."""
    _tools_or_skip()
    stub = ThreadingHTTPServer(("127.0.0.1", 0), _StubInfill)
    stub.separators, stub.requests = separators, 0
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    path = tmp_path / "demo.py"
    path.write_text("def multiply(a, b):\n")
    vim = Vim(tmp_path, f"http://127.0.0.1:{stub.server_address[1]}", path)
    try:
        vim.started()
        vim.keys("G", "o")
        vim.wait(lambda: vim.read_state()[1:3] == ["2:1", "i"], "insert mode on line 2", 30)
        vim.type("    return")
        if shown:
            vim.wait(lambda: vim.read_state()[:2] == ["shown", "2:11"], "the stub's suggestion")
            assert vim.screen()[1].rstrip() == "    return a * b"
        else:
            vim.wait(lambda: stub.requests >= 3, "the plugin's requests", 30)
            time.sleep(3)  # the answers came back: the plugin had time to show one
            assert vim.read_state()[0] == "none" and vim.screen()[1].rstrip() == "    return", vim.screen()
    finally:
        vim.close()
        stub.shutdown()
