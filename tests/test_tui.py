"""The chat TUI (`tui/`), driven through Textual's Pilot on the real smollm2 model (and gemma3 for a model
switch); snapshots of its main screens use a stand-in engine so they are deterministic.

Settings and conversations go to a temporary LOCALLLM_HOME whose `models` links to the catalog's test models in the
real store (and nothing else the user downloaded).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from textual import events

from localllm import paths
from localllm.store import catalog
from conftest import CATALOG_MODELS, model_file
from localllm.chat.loop_guard import CHAT_LOOP_PROTECTION
from localllm.tui import conversations
from localllm.tui.chat_app import ChatApp, ChatInput, ChatMessage
from localllm.tui.chat_session import load_engine
from localllm.tui.screens import ConfirmPull, ConversationsScreen, HelpScreen, ModelPicker, SettingsScreen
from localllm.tui import settings as settings_store
from localllm.tui.settings import ChatSettings

SMOLLM = "smollm2-135m-instruct"
GEMMA = "gemma3-270m"
GREEDY = ChatSettings(temperature=0.0, max_tokens=48)
_engines = {}


@pytest.fixture
def anyio_backend():
    return "asyncio"


def shared_engine(name, ctx, on_compile, kv_type="f32", device="cpu"):
    """The real engine, loaded once per (model, context, KV type, device) for the whole file: loading is not what
    most tests test."""
    if (name, ctx, kv_type, device) not in _engines:
        _engines[name, ctx, kv_type, device] = load_engine(name, ctx, on_compile, kv_type, device)
    return _engines[name, ctx, kv_type, device]


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A store of its own holding links to the catalog's test models only: the model picker lists what the store
    holds, and a user's other downloads must not change what these tests see (issue 41 item 4)."""
    for name in (SMOLLM, GEMMA):
        model_file(name)
    models = tmp_path / "models"
    models.mkdir()
    real = paths.models_dir()
    for name in CATALOG_MODELS:
        for file in (f"{name}.gguf", f".{name}.gguf.verified.json"):
            if (real / file).exists():
                (models / file).symlink_to(real / file)
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))
    return tmp_path


async def until(pilot, condition, timeout=60.0, what="the condition"):
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await pilot.pause(0.01)


async def ready(pilot, app):
    await until(pilot, lambda: app.session is not None and app.busy is None, what="the model to load")


async def send(pilot, app, text):
    app.query_one(ChatInput).load_text(text)
    press_now(app, "enter")
    await until(pilot, lambda: app.busy == "generating", timeout=1.0, what="the answer to start")


def press_now(app, key, character=None):
    """A key press as the terminal delivers it, without Pilot's wait for the app to go idle (which never happens
    while an answer streams in): the test then measures how soon the key takes effect."""
    app.post_message(events.Key(key, character))


async def answered(pilot, app):
    await until(pilot, lambda: app.busy is None, what="the answer to finish")
    return app.conversation.messages[-1]["content"]


@pytest.mark.anyio
async def test_answer_streams_in_token_by_token_and_is_saved(home):
    app = ChatApp(SMOLLM, loader=shared_engine, chat_settings=GREEDY)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot, app)
        await send(pilot, app, "Name three colours.")
        seen = []
        while app.busy:
            if not seen or seen[-1] != app.answer:
                seen.append(app.answer)
            await pilot.pause(0.005)
        answer = app.conversation.messages[-1]["content"]
        assert answer and answer == app.answer
        # Many intermediate states, each a prefix of the next: the text arrived piece by piece.
        assert len(seen) >= 5, seen
        assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))
        views = app.query(ChatMessage)
        assert [v.role for v in views] == ["user", "assistant"]
        assert views.last().source == answer
        stats = app.last_stats
        assert stats.generated > 0 and stats.ttft_ms > 0 and stats.tokens_per_second > 0
        assert stats.context_used > stats.generated and stats.context_size == app.session.engine.ctx
        assert "tok/s" in str(app.query_one("#stats").render())

        saved = conversations.load(app.conversation.id)
        assert saved.messages == app.conversation.messages and saved.model == SMOLLM
        assert conversations.kv_path(app.conversation.id).exists()

        await pilot.press("f5")  # copy: the clipboard, and a file whose path the app tells
        copied = list((home / "copied").iterdir())
        assert len(copied) == 1 and copied[0].read_text() == answer
        assert app.clipboard == answer
        await pilot.press("f6")
        exported = (home / "exports" / f"{app.conversation.id}.md").read_text()
        assert "Name three colours." in exported and answer.strip() in exported


@pytest.mark.anyio
async def test_esc_stops_the_answer_and_keys_stay_responsive(home):
    app = ChatApp(SMOLLM, loader=shared_engine, chat_settings=ChatSettings(temperature=0.0, max_tokens=500))
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot, app)
        await send(pilot, app, "Write a long story about a dragon.")
        await until(pilot, lambda: len(app.answer) > 0, what="the first token")
        # Typing while the model generates: each key is handled at once, not after the answer.
        for typed in ("h", "hi"):
            press_now(app, typed[-1], typed[-1])
            await until(pilot, lambda: app.query_one(ChatInput).text == typed, timeout=0.25, what=f"{typed!r} typed")
            assert app.busy == "generating"

        press_now(app, "escape")
        await until(pilot, lambda: app.busy is None, timeout=1.0, what="the stop")
        stats = app.last_stats
        assert stats.stopped and stats.finish_reason is None and 0 < stats.generated < 500
        assert app.conversation.messages[-1] == {"role": "assistant", "content": app.answer}
        assert app.is_running  # Esc stopped the answer, not the app
        assert app.query_one(ChatInput).text == "hi"


@pytest.mark.anyio
async def test_regenerate_replaces_the_last_answer_reusing_the_prompt_cache(home):
    app = ChatApp(SMOLLM, loader=shared_engine, chat_settings=GREEDY)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot, app)
        await send(pilot, app, "What is the capital of France?")
        first = await answered(pilot, app)
        prompt_tokens = app.last_stats.cache_n + app.last_stats.prompt_n
        press_now(app, "ctrl+r")
        await until(pilot, lambda: app.busy == "generating", timeout=1.0, what="the regeneration")
        second = await answered(pilot, app)
        assert [m["role"] for m in app.conversation.messages] == ["user", "assistant"]
        assert [v.role for v in app.query(ChatMessage)] == ["user", "assistant"]
        assert second == first  # greedy: the same prompt gives the same answer
        # Everything but the last prompt token came from the cache the first answer left.
        assert app.last_stats.cache_n == prompt_tokens - 1 and app.last_stats.prompt_n == 1


@pytest.mark.anyio
async def test_edit_last_message_puts_it_back_in_the_input(home):
    app = ChatApp(SMOLLM, loader=shared_engine, chat_settings=GREEDY)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot, app)
        await send(pilot, app, "Say hello.")
        await answered(pilot, app)
        await pilot.press("ctrl+l")
        assert app.conversation.messages == [] and not app.query(ChatMessage)
        assert app.query_one(ChatInput).text == "Say hello."
        await pilot.press("end", "ctrl+j", "P", "l", "e", "a", "s", "e", ".")
        assert app.query_one(ChatInput).text == "Say hello.\nPlease."  # Ctrl+J: a new line, not a send
        await pilot.press("enter")
        await answered(pilot, app)
        assert app.conversation.messages[0] == {"role": "user", "content": "Say hello.\nPlease."}


@pytest.mark.anyio
async def test_settings_are_saved_and_reach_the_generation(home):
    app = ChatApp(SMOLLM, loader=shared_engine, chat_settings=ChatSettings(temperature=0.0))
    async with app.run_test(size=(100, 40)) as pilot:
        await ready(pilot, app)
        await pilot.press("f2")
        assert isinstance(app.screen, SettingsScreen)
        app.screen.query_one("#max_tokens").value = "6"
        app.screen.query_one("#seed").value = "42"
        await pilot.press("ctrl+s")
        assert not isinstance(app.screen, SettingsScreen)
        saved = json.loads((home / "settings.json").read_text())
        assert saved["max_tokens"] == 6 and saved["seed"] == 42 and saved["temperature"] == 0.0

        generations = []
        real_stream = app.session.stream

        def spy(messages, system_prompt, params, stats, **kw):
            generations.append(params)
            return real_stream(messages, system_prompt, params, stats, **kw)

        app.session.stream = spy
        await send(pilot, app, "Count from one to twenty.")
        await answered(pilot, app)
        assert generations[0].max_tokens == 6 and generations[0].sampling.seed == 42
        assert generations[0].sampling.dry_multiplier == CHAT_LOOP_PROTECTION["dry_multiplier"] > 0  # loop protection
        stats = app.last_stats
        assert stats.generated == 6 and stats.finish_reason == "length" and not stats.context_full

        # Speculation and the KV cache type: the first reaches the next generation, the second reloads the model.
        await pilot.press("f2")
        app.screen.query_one("#speculation").value = "ngram"
        app.screen.query_one("#kv_type").value = "q8_0"
        await pilot.press("ctrl+s")
        await until(pilot, lambda: app.session is not None and app.session.engine.kv_pool.kv_type == "q8_0",
                    what="the model reloaded with a q8_0 KV cache")
        app.session.stream = spy
        await send(pilot, app, "Count from one to twenty.")
        await answered(pilot, app)
        assert generations[-1].speculation is not None and generations[-1].speculation.mode == "ngram"
        assert "max tokens" in stats.outcome()

        await pilot.press("f2")
        app.screen.query_one("#top_p").value = "1.5"
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, SettingsScreen)  # refused, with the reason
        assert "Top-p must be in (0, 1]" in str(app.screen.query_one("#error").render())


@pytest.mark.anyio
async def test_a_full_context_says_so(home):
    settings = ChatSettings(temperature=0.0, max_tokens=-1, ctx=64, context_overflow="stop")
    app = ChatApp(SMOLLM, loader=shared_engine, chat_settings=settings)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot, app)
        await send(pilot, app, "Write a long story about a dragon.")
        await answered(pilot, app)
        stats = app.last_stats
        assert stats.finish_reason == "length" and stats.context_full and stats.context_used >= 63
        assert "Context full (64 tokens)" in stats.outcome()
        # The next message no longer fits with the whole conversation: the oldest turn is left out of the
        # prompt (and says so), as Ollama does; the conversation itself keeps every message.
        app.query_one(ChatInput).load_text("Go on.")
        press_now(app, "enter")
        await until(pilot, lambda: len(app.conversation.messages) == 4 and app.busy is None, what="the answer")
        stats = app.last_stats
        assert stats.dropped == 2 and "oldest 2 messages were left out" in stats.outcome()
        assert [m["role"] for m in app.conversation.messages] == ["user", "assistant", "user", "assistant"]


@pytest.mark.anyio
async def test_reopening_a_conversation_restores_its_kv_cache(home):
    first = ChatApp(SMOLLM, loader=shared_engine, chat_settings=GREEDY)
    async with first.run_test(size=(100, 30)) as pilot:
        await ready(pilot, first)
        await send(pilot, first, "Tell me a fact about the moon.")
        await answered(pilot, first)
        conv_id, cached = first.conversation.id, list(first.session.seq.tokens)

    # A fresh engine, so nothing is left in its KV pool: only the saved cache can make the next turn cheap.
    second = ChatApp(SMOLLM, loader=load_engine, chat_settings=GREEDY)
    async with second.run_test(size=(100, 30)) as pilot:
        await ready(pilot, second)
        await pilot.press("f4")
        assert isinstance(second.screen, ConversationsScreen)
        await pilot.press("enter")
        assert second.conversation.id == conv_id
        assert [v.role for v in second.query(ChatMessage)] == ["user", "assistant"]
        assert second.session.seq.tokens == cached
        await send(pilot, second, "And one about the sun.")
        await answered(pilot, second)
        assert second.last_stats.cache_n >= len(cached) - 8  # all but the re-rendered end of the last answer
        assert len(conversations.load(conv_id).messages) == 4


@pytest.mark.anyio
async def test_conversations_can_be_renamed_deleted_and_started_anew(home):
    for title in ("first chat", "second chat"):
        conversations.save(conversations.Conversation(model=SMOLLM, messages=[{"role": "user", "content": title}]))
    app = ChatApp(SMOLLM, loader=shared_engine, chat_settings=GREEDY)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot, app)
        await pilot.press("f4")
        await pilot.press("r")
        app.screen.query_one("#rename").value = "Renamed"
        await pilot.press("enter")
        titles = sorted(c.display_title for c in conversations.list_all())
        assert "Renamed" in titles and len(titles) == 2
        await pilot.press("d")
        assert len(conversations.list_all()) == 1
        await pilot.press("n")
        assert app.screen is app.screen_stack[0] and app.conversation.messages == []


@pytest.mark.anyio
async def test_switching_model_keeps_the_conversation(home):
    app = ChatApp(SMOLLM, loader=shared_engine, chat_settings=GREEDY)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot, app)
        await send(pilot, app, "Hi! My name is Ada.")
        await answered(pilot, app)
        await pilot.press("f3")
        assert isinstance(app.screen, ModelPicker)
        table = app.screen.query_one("DataTable")
        table.move_cursor(row=table.get_row_index(GEMMA))
        await pilot.press("enter")
        await ready(pilot, app)
        assert app.session.engine.name == GEMMA and app.conversation.model == GEMMA
        assert [v.role for v in app.query(ChatMessage)] == ["user", "assistant"]
        await send(pilot, app, "What is my name?")
        await answered(pilot, app)
        assert [m["role"] for m in app.conversation.messages] == ["user", "assistant"] * 2
        # The second turn's prompt is the whole conversation rendered and tokenized by the new model.
        rendered = app.session.prompt_tokens(app.conversation.messages[:3], "")
        assert app.session.seq.tokens[: len(rendered)] == rendered
        assert max(rendered) >= 49152  # gemma's vocabulary, beyond smollm2's


@pytest.mark.anyio
async def test_first_run_offers_to_pull_the_default_model(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))  # no models at all
    app = ChatApp(None, loader=shared_engine)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert isinstance(app.screen, ConfirmPull)
        offer = str(app.screen.query_one("Static").render())
        assert "smollm2-135m-instruct" in offer
        # a short list to choose from, not a silent decision (issue 41 item 1)
        assert "qwen2.5-coder-0.5b-instruct" in offer and "qwen2.5-coder-1.5b-instruct" in offer
        await pilot.press("escape")
        assert app.session is None and "F3" in str(app.query_one("#stats").render())
    app = ChatApp(None, loader=shared_engine)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        await pilot.click("#choose")
        await pilot.pause()
        assert isinstance(app.screen, ModelPicker)


@pytest.mark.anyio
async def test_a_pull_from_the_picker_shows_progress_and_cancels_cleanly(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))  # an empty store: the pull really downloads
    app = ChatApp(None, loader=shared_engine)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("escape")  # not the first-run offer: pull from the picker
        await pilot.press("f3")
        picker = app.screen
        table = picker.query_one("DataTable")
        table.move_cursor(row=table.get_row_index(GEMMA))
        await pilot.press("enter")
        bar = picker.query_one("#pull_bar")
        await until(pilot, lambda: bar.progress > 0, timeout=90, what="download progress")
        assert bar.display and bar.total == catalog.find(GEMMA).size
        await pilot.press("escape")
        await until(pilot, lambda: picker.pull_proc is None, timeout=30, what="the pull to stop")
        assert "cancelled; nothing was left behind" in str(picker.query_one("#pull_label").render())
        assert list((tmp_path / "models").iterdir()) == []
        assert app.screen is picker  # Esc cancelled the pull, not the picker


@pytest.mark.anyio
async def test_kernel_compilation_shows_progress(home, tmp_path, monkeypatch):
    # An empty kernel cache dir: warm-up runs every kernel once more, reporting as on a first start (Numba's own
    # cache keeps this fast).
    monkeypatch.setenv("LOCALLLM_CACHE", str(tmp_path / "cache"))
    shown = []

    class Watching(ChatApp):
        def on_load_progress(self, message):
            shown.append((message.text, message.done, message.total))
            super().on_load_progress(message)

    app = Watching(SMOLLM, loader=load_engine, chat_settings=GREEDY)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot, app)
    total = shown[-1][2]
    assert total > 0 and shown[-1][1] == total and all("Compiling kernels" in text for text, _, _ in shown)
    assert [done for _, done, _ in shown] == list(range(total + 1))


def test_chat_falls_back_to_the_plain_repl_off_a_terminal(home):
    out = subprocess.run([sys.executable, "-m", "localllm", "chat", SMOLLM, "-n", "4"], input="Hi\n/bye\n",
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"Chatting with {SMOLLM}.") and ">>> " in out.stdout


# ---- snapshots (a stand-in engine: no model, the same pixels every time) -----------------------------------


class StandInEngine:
    name = SMOLLM
    ctx = 4096
    model = SimpleNamespace(can_shift=True)

    def new_sequence(self):
        return SimpleNamespace(tokens=[], close=lambda: None)


def stand_in(name, ctx, on_compile, kv_type="f32", device="cpu"):
    return StandInEngine()


def snapshot_app():
    return ChatApp(SMOLLM, loader=stand_in, chat_settings=ChatSettings())


async def loaded(pilot):
    await until(pilot, lambda: pilot.app.session is not None)
    await pilot.pause()


def test_snapshot_empty_chat(home, snap_compare):
    assert snap_compare(snapshot_app(), terminal_size=(80, 24), run_before=loaded)


@pytest.mark.parametrize("screen, key", [("help", "f1"), ("settings", "f2"), ("model_picker", "f3"),
                                         ("light_theme", "ctrl+t")])
def test_snapshot_after_a_key(home, snap_compare, screen, key):
    """The main screens, each one key away from the loaded chat."""
    async def press(pilot):
        await loaded(pilot)
        await pilot.press(key)
        if screen == "help":
            assert isinstance(pilot.app.screen, HelpScreen)

    assert snap_compare(snapshot_app(), terminal_size=(80, 24), run_before=press)


# ---- hostile saved state (the stand-in engine: these are about files, not the model) -------------------------


class Noting(ChatApp):
    """The chat app, keeping every notice it shows the user."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.told: list[str] = []

    def notify(self, message, **kwargs):
        self.told.append(message)
        super().notify(message, **kwargs)


def write_conversation(home, file_id: str, content) -> bytes:
    folder = home / "conversations"
    folder.mkdir(exist_ok=True)
    data = content if isinstance(content, bytes) else json.dumps(content).encode()
    (folder / f"{file_id}.json").write_bytes(data)
    return data


@pytest.mark.anyio
async def test_a_conversation_id_that_is_a_path_is_never_deleted_or_written(home):
    victim = home / "victim.json"
    victim.write_text("precious")
    (home / "victim.kv.npz").write_text("precious too")
    write_conversation(home, "evil", {"id": "../victim", "title": "Evil", "model": SMOLLM,
                                      "messages": [{"role": "user", "content": "hi"}], "created": 1.0, "updated": 2.0})
    [conv] = conversations.list_all()
    assert conv.id == "evil"  # the id is the file's name, never what the file says
    app = Noting(SMOLLM, loader=stand_in, chat_settings=ChatSettings())
    async with app.run_test(size=(100, 30)) as pilot:
        await loaded(pilot)
        await pilot.press("f4")
        await pilot.press("r")
        app.screen.query_one("#rename").value = "Renamed"
        await pilot.press("enter")
        assert json.loads((home / "conversations" / "evil.json").read_text())["title"] == "Renamed"
        await pilot.press("d")
        assert not (home / "conversations" / "evil.json").exists()
    assert victim.read_text() == "precious" and (home / "victim.kv.npz").read_text() == "precious too"
    for bad in ("../victim", "/tmp/victim", ".hidden", ""):
        with pytest.raises(conversations.ConversationError):
            conversations.delete(bad)
        with pytest.raises(conversations.ConversationError):
            conversations.export_markdown(conversations.Conversation(id=bad, messages=[]))


@pytest.mark.anyio
async def test_the_device_setting_offers_each_opencl_device_and_reloads_the_model_there(home):
    loads = []

    def recording(name, ctx, on_compile, kv_type="f32", device="cpu"):
        loads.append((name, device))
        return StandInEngine()

    listed = [{"platform": "Portable Computing Language", "name": "pthread-Some CPU", "type": "CPU"}]
    app = ChatApp(SMOLLM, loader=recording, chat_settings=ChatSettings())
    app.opencl_devices = listed  # what `localllm devices` found (the listing itself is tested in test_backend_ops)
    async with app.run_test(size=(100, 30)) as pilot:
        await loaded(pilot)
        assert loads == [(SMOLLM, "cpu")]
        await pilot.press("f2")
        select = app.screen.query_one("#device")
        wanted = "opencl:Portable Computing Language:pthread-Some CPU"
        assert [value for _, value in select._options if value is not None][:2] == ["cpu", wanted]
        select.value = wanted
        await pilot.press("ctrl+s")
        await until(pilot, lambda: len(loads) == 2 and app.session is not None and not app.busy,
                    what="the model reloaded on the OpenCL device")
    assert loads[1] == (SMOLLM, wanted)
    assert json.loads(paths.settings_file().read_text())["device"] == wanted  # the next start uses it too


def test_a_saved_device_that_is_gone_stays_selectable_and_a_malformed_one_is_refused():
    from localllm.tui.screens import device_choices

    assert device_choices("opencl:Old:GPU", []) == [("CPU (Numba kernels)", "cpu"), ("opencl:Old:GPU", "opencl:Old:GPU")]
    assert ChatSettings(device="opencl").validated().device == "opencl"
    for bad in ("gpu", "/dev/dri", "", "cuda:0"):
        with pytest.raises(ValueError, match="device must be"):
            ChatSettings(device=bad).validated()


def test_chat_device_and_kv_type_options_override_the_saved_settings_only_when_given():
    from localllm.cli.main import build_parser
    from localllm.cli.generate import chat_settings_overrides

    saved = ChatSettings(device="opencl", kv_type="q8_0")
    given = chat_settings_overrides(build_parser().parse_args(["chat", "--device", "cpu", "--kv-type", "f32"]), saved)
    assert (given.device, given.kv_type) == ("cpu", "f32")  # the defaults' values, given: they win
    kept = chat_settings_overrides(build_parser().parse_args(["chat"]), saved)
    assert (kept.device, kept.kv_type) == ("opencl", "q8_0")


@pytest.mark.anyio
async def test_saved_conversations_that_cannot_be_read_are_skipped_with_a_notice(home):
    message = [{"role": "user", "content": "hello"}]
    bad = {"wrong-messages": {"messages": "hello"},
           "wrong-message": {"messages": [{"role": "user", "content": ["not", "text"]}]},
           "nested": ("[" * 100_000 + "]" * 100_000).encode(),
           "not-json": b"{not json",
           "not-utf8": b"\xff\xfe\x00garbage",
           "a-list": [message]}
    on_disk = {name: write_conversation(home, name, content) for name, content in bad.items()}
    # Wrong-typed details of an otherwise good conversation are repaired, not skipped.
    write_conversation(home, "repaired", {"title": 5, "model": ["x"], "updated": "yesterday", "messages": message})
    (home / "conversations" / "overflow.json").write_text('{"created": 1e400, "messages": []}')
    app = Noting(SMOLLM, loader=stand_in, chat_settings=ChatSettings())
    async with app.run_test(size=(100, 30)) as pilot:
        await loaded(pilot)
        await pilot.press("f4")
        table = app.screen.query_one("DataTable")
        assert table.row_count == 2
        [notice] = [t for t in app.told if t.startswith("Skipped")]
        assert notice.startswith(f"Skipped {len(bad)} saved conversation file(s)") and "… and 1 more" in notice
        assert "nested.json is nested too deeply" in notice and "not-utf8.json is not UTF-8 text" in notice
        table.move_cursor(row=table.get_row_index("repaired"))
        await pilot.press("enter")
        assert app.conversation.id == "repaired" and app.conversation.messages == message
        assert app.conversation.title == "" and app.conversation.model == ""
        assert app.is_running
    for name, data in on_disk.items():  # left exactly as they were
        assert (home / "conversations" / f"{name}.json").read_bytes() == data
    problems = []
    conversations.list_all(problems)
    assert "wrong-messages.json: 'messages' is not a list" in problems


@pytest.mark.anyio
async def test_a_corrupt_settings_json_falls_back_to_defaults_with_a_notice(home):
    settings_file = home / "settings.json"
    settings_file.write_text("{" + '"a": {' * 50_000 + "}" * 50_001)
    app = Noting(SMOLLM, loader=stand_in)
    async with app.run_test(size=(100, 30)) as pilot:
        await loaded(pilot)
        assert app.settings == ChatSettings()
        assert any("using the default settings (it is nested too deeply)" in t for t in app.told)
    # Bad values fall back one by one, and the notice names them.
    settings_file.write_text(json.dumps({"temperature": "hot", "top_k": 5, "seed": -1, "ctx": 10**30, "stop": [[1]],
                                         "speculation": "draft", "draft_model": "qwen2.5-coder-0.5b-instruct"}))
    loaded_settings, notices = settings_store.load_reporting()
    assert loaded_settings == ChatSettings(top_k=5, speculation="draft", draft_model="qwen2.5-coder-0.5b-instruct")
    assert notices == [f"{settings_file}: ignored the bad values of ctx, seed, stop, temperature; using their "
                       "defaults"]


@pytest.mark.anyio
async def test_saved_titles_and_names_that_look_like_markup_are_shown_as_text(home):
    title = "[/] [bold]not bold[/bold] [link=x]"
    write_conversation(home, "markup", {"title": title, "model": "[/x]", "messages": [
        {"role": "user", "content": "[/]" + ">" * 500 + "- " * 500},
        {"role": "assistant", "content": "[" * 2_000 + "(" * 2_000}]})
    app = Noting(SMOLLM, loader=stand_in, chat_settings=ChatSettings())
    async with app.run_test(size=(100, 30)) as pilot:
        await loaded(pilot)
        await pilot.press("f4")
        await pilot.press("enter")
        await pilot.pause()
        assert app.conversation.title == title and app.is_running
        assert title in str(app.query_one("#topbar").render())
