"""`localllm chat`: a Textual app over the engine's token stream.

The engine only ever runs on worker threads (loading, compiling, generating, saving a KV cache); they send the
UI messages, so the screen never freezes. One engine job runs at a time (`self.busy` says which). The
conversation's Sequence lives in `ChatSession` across turns, so each turn only evaluates its new tokens.
"""

from __future__ import annotations

from typing import Callable

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.markup import escape
from textual.message import Message
from textual.widgets import Footer, Label, Markdown, ProgressBar, Static, TextArea

from localllm.store import catalog
from localllm.store import hub
from localllm.store import local as store
from localllm.errors import LocalLLMError
from localllm.tui import conversations, settings as settings_store
from localllm.tui.chat_session import ChatSession, TurnStats, load_engine
from localllm.tui.conversations import Conversation, ConversationError
from localllm.tui.screens import ConfirmPull, ConversationsScreen, HelpScreen, ModelPicker, SettingsScreen, human_size
from localllm.tui.settings import ChatSettings

# The first run's short list (issue 41 item 1): the catalog's chat models, what each is good for (the 20 everyday
# prompts of tools/measure_loops.py, README "Answers that end"), and their decode speed on the 2-core dev machine
# (`localllm run MODEL --chat "Explain how a rainbow forms, in simple words." --seed 0 -n 128 -v`, load ~3). The
# default comes first.
FIRST_RUN = {
    "qwen2.5-coder-1.5b-instruct": "the default: the best answers, code above all; no loop in 40 answers",
    "qwen2.5-coder-0.5b-instruct": "faster; fair plain answers and code; 1 loop in 20",
    "smollm2-135m-instruct": "tiny; shallow answers, and loops (7 in 60; 2 with DRY)",
}
FIRST_RUN_SPEED = {"qwen2.5-coder-1.5b-instruct": "15 tokens/s", "qwen2.5-coder-0.5b-instruct": "27 tokens/s",
                   "smollm2-135m-instruct": "31 tokens/s"}


def first_run_choices() -> str:
    """What the first run says when nothing is downloaded: the short list to choose from."""
    entries = catalog.entries()
    lines = ["No model is downloaded yet. The catalog's chat models (speed: on 2 cores of a Zen 5):", ""]
    for name, about in FIRST_RUN.items():
        if name in entries:
            speed = FIRST_RUN_SPEED.get(name)
            lines.append(f"  {name}  {human_size(entries[name].size)}{f', {speed}' if speed else ''}: {about}")
    lines += ["", "Gemma 3 270M is a base model (it continues text; it does not chat). F3 lists them all, and "
              "pulls any GGUF from the hub."]
    return "\n".join(lines)


CSS = """
#topbar { height: 1; background: $primary-background; color: $text; padding: 0 1; }
#messages { height: 1fr; padding: 0 1; }
.message { margin: 1 0 0 0; padding: 0 1; height: auto; }
.message.user { border-left: thick $accent; background: $boost; }
.message.assistant { border-left: thick $success; }
.message MarkdownFence { max-height: 40; }
#loading { height: auto; padding: 0 1; display: none; }
#loading.shown { display: block; }
#input { height: auto; min-height: 3; max-height: 8; border: round $primary; }
#input:focus { border: round $accent; }
#stats { height: 1; padding: 0 1; color: $text-muted; }
#dialog { width: 96%; max-width: 110; height: auto; max-height: 90%; border: thick $primary; background: $surface; padding: 0 1; }
#dialog.help { height: 90%; }
#dialog .title { text-style: bold; padding: 0 0 1 0; }
#dialog .row { height: auto; }
#dialog .row { margin: 1 0 0 0; }
#dialog .row .name { width: 18; }
#dialog .row .value { width: 22; }
#dialog .row .hint { width: 1fr; padding: 0 0 0 1; color: $text-muted; }
#dialog .system { height: 5; border: round $primary-darken-1; }
#dialog .system:focus { border: round $accent; }
#dialog .buttons { height: auto; align-horizontal: right; margin: 1 0 0 0; }
#dialog .buttons Button { margin: 0 0 0 2; }
#dialog #error { height: auto; }
#dialog DataTable { height: auto; max-height: 16; }
ModalScreen { align: center middle; }
"""


class ChatInput(TextArea):
    """The message box: Enter sends, Ctrl+J (or Shift+Enter) starts a new line. Both are handled here, in the
    box's own key queue: as a binding, the new line would run from the app's queue, after letters typed later."""

    class Submitted(Message):
        def __init__(self, text: str):
            super().__init__()
            self.text = text

    async def _on_key(self, event) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self.text))
            return
        if event.key in ("ctrl+j", "shift+enter"):
            event.stop()
            event.prevent_default()
            edit = self.replace("\n", *self.selection)
            self.move_cursor(edit.end_location)
            return
        await super()._on_key(event)


class ChatMessage(Markdown):
    """One message of the conversation, rendered as Markdown (code blocks highlighted)."""

    def __init__(self, role: str, content: str = ""):
        # What the user typed keeps its line breaks (a single newline is only a space in Markdown).
        shown = content.replace("\n", "  \n") if role == "user" else content
        super().__init__(shown, classes=f"message {role}")
        self.role = role


# Messages from the worker threads (post_message is thread-safe).
class Loaded(Message):
    def __init__(self, session: ChatSession | None, error: str | None, restored: int = 0):
        super().__init__()
        self.session, self.error, self.restored = session, error, restored


class LoadProgress(Message):
    def __init__(self, text: str, done: int | None = None, total: int | None = None):
        super().__init__()
        self.text, self.done, self.total = text, done, total


class TokenText(Message):
    def __init__(self, text: str):
        super().__init__()
        self.text = text


class TurnDone(Message):
    def __init__(self, stats: TurnStats, error: str | None):
        super().__init__()
        self.stats, self.error = stats, error


# (name, ctx, on_compile, kv_type, device) -> engine
EngineLoader = Callable[[str, int | None, Callable[[int, int], None] | None, str, str], object]


class ChatApp(App):
    TITLE = "localllm chat"
    CSS = CSS
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("f1", "help", "Help", priority=True),
        Binding("question_mark", "help", "Help", show=False),
        Binding("f2", "settings", "Settings", priority=True),
        Binding("f3", "models", "Models", priority=True),
        Binding("f4", "conversations", "Chats", priority=True),
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+r", "regenerate", "Regen", priority=True),
        Binding("ctrl+l", "edit_last", "Edit last", show=False, priority=True),
        Binding("f5", "copy_answer", "Copy", show=False, priority=True),
        Binding("f6", "export", "Export", show=False, priority=True),
        Binding("ctrl+n", "new_conversation", "New", priority=True),
        Binding("ctrl+t", "toggle_theme", "Theme", show=False, priority=True),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(self, model: str | None = None, loader: EngineLoader = load_engine,
                 chat_settings: ChatSettings | None = None, notices: list[str] | None = None):
        super().__init__()
        self.model_name = model
        self.loader = loader
        self.notices = list(notices or [])  # told once the screen is up (e.g. a settings file that was ignored)
        if chat_settings is None:
            chat_settings, problems = settings_store.load_reporting()
            self.notices += problems
        self.settings = chat_settings
        self.session: ChatSession | None = None
        self.conversation = Conversation()
        self.busy: str | None = None  # "loading" or "generating": the engine job running now
        self.answer = ""  # the answer being streamed, as received so far
        self.answer_view: ChatMessage | None = None
        self.answer_stream = None
        self.last_stats: TurnStats | None = None
        self.restore_kv_of: str | None = None  # a conversation whose KV cache the next load adopts
        self.opencl_devices: list[dict] | None = None  # listed when Settings first opens

    # ---- layout -------------------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Static("", id="topbar")
        yield VerticalScroll(id="messages")
        with Vertical(id="loading"):
            yield Label("", id="loading_label")
            yield ProgressBar(id="loading_bar", show_eta=False)
        yield ChatInput(id="input", soft_wrap=True, show_line_numbers=False,
                        placeholder="Your message (Enter sends, Ctrl+J new line, F1 help)")
        yield Static("Enter sends · Ctrl+J new line · F1 help", id="stats")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(ChatInput).focus()
        self.update_topbar()
        for notice in self.notices:
            self.notify(notice, severity="warning", timeout=15, markup=False)
        self.start()

    def start(self) -> None:
        """Load the model asked for, or the default, or offer to pull the default when nothing is here."""
        if self.model_name is None:
            local = [m.name for m in store.local_models()] + [m.name for m in hub.hub_models()]
            default = catalog.default_entry().name
            if not local:
                self.offer_pull(default, first_run_choices(), choose=True)
                return
            self.model_name = default if default in local else local[0]
        try:
            store.resolve(self.model_name)
        except LocalLLMError as e:
            if self.model_name in catalog.entries():
                self.offer_pull(self.model_name, f"{self.model_name} is not downloaded yet.")
            else:
                self.show_status(f"[red]{escape(str(e))}[/] — F3 picks a model.")
            return
        self.load_model(self.model_name)

    def offer_pull(self, name: str, why: str, choose: bool = False) -> None:
        size = human_size(catalog.find(name).size)

        def answered(yes: bool | str | None) -> None:
            if yes == "choose":
                self.push_screen(ModelPicker(None), self.model_chosen)
            elif yes:
                self.push_screen(ModelPicker(None, pull_now=name), self.model_chosen)
            else:
                self.show_status("No model loaded: F3 picks or pulls one.")

        self.push_screen(ConfirmPull(f"{why}\n\nPull {name} ({size}) now? You can cancel the download.", choose),
                         answered)

    def update_topbar(self) -> None:
        model = self.session.engine.name if self.session else (self.model_name or "no model")
        # Names and titles come from files and from what the user typed: text, never markup.
        self.query_one("#topbar", Static).update(
            f"[b]localllm[/] · {escape(model)} · {escape(self.conversation.display_title)}")

    def show_status(self, text: str) -> None:
        self.query_one("#stats", Static).update(text)

    # ---- loading ------------------------------------------------------------------------------------------

    def load_model(self, name: str) -> None:
        self.busy = "loading"
        self.model_name = name
        self.update_topbar()
        self.show_loading(f"Loading {escape(name)}…")
        self.load_worker(name, self.settings.ctx, self.restore_kv_of)

    @work(thread=True, group="engine")
    def load_worker(self, name: str, ctx: int, restore_kv_of: str | None) -> None:
        device = self.settings.device
        where = "this CPU" if device == "cpu" else "this device"

        def compiling(done: int, total: int) -> None:
            self.post_message(LoadProgress(f"Compiling kernels for {where} (first run only)", done, total))

        try:
            engine = self.loader(name, ctx, compiling, self.settings.kv_type, device)
            session = ChatSession(engine)
            restored = session.restore_kv(conversations.kv_path(restore_kv_of)) if restore_kv_of else 0
        except LocalLLMError as e:
            self.post_message(Loaded(None, str(e)))
            return
        self.post_message(Loaded(session, None, restored))

    def show_loading(self, text: str, done: int | None = None, total: int | None = None) -> None:
        box = self.query_one("#loading")
        box.add_class("shown")
        self.query_one("#loading_label", Label).update(text)
        self.query_one("#loading_bar", ProgressBar).update(total=total, progress=done or 0)

    def on_load_progress(self, message: LoadProgress) -> None:
        self.show_loading(message.text, message.done, message.total)

    def on_loaded(self, message: Loaded) -> None:
        self.busy = None
        self.restore_kv_of = None
        self.query_one("#loading").remove_class("shown")
        if message.error:
            self.show_status(f"[red]{escape(message.error)}[/]")
            return
        if self.session is not None:
            self.session.close()
        self.session = message.session
        self.conversation.model = self.session.engine.name
        self.update_topbar()
        restored = f" · {message.restored} tokens restored from the saved cache" if message.restored else ""
        self.show_status(f"{escape(self.session.engine.name)} ready · ctx {self.session.engine.ctx}{restored} · F1 help")

    # ---- chatting -----------------------------------------------------------------------------------------

    @on(ChatInput.Submitted)
    def send(self, event: ChatInput.Submitted) -> None:
        text = event.text.strip()
        if not text:
            return
        if not self.ready_to_generate():
            return
        self.query_one(ChatInput).clear()
        self.conversation.messages.append({"role": "user", "content": text})
        self.mount_message("user", text)
        self.update_topbar()
        self.generate()

    def ready_to_generate(self) -> bool:
        if self.session is None:
            self.notify("No model is loaded: F3 picks one", severity="warning")
            return False
        if self.busy:
            self.notify(f"Still {self.busy}: wait, or Esc stops the answer", severity="warning")
            return False
        return True

    def mount_message(self, role: str, content: str) -> ChatMessage:
        view = ChatMessage(role, content)
        messages = self.query_one("#messages", VerticalScroll)
        messages.mount(view)
        messages.scroll_end(animate=False)
        return view

    def generate(self) -> None:
        self.busy = "generating"
        self.answer = ""
        self.answer_view = self.mount_message("assistant", "")
        self.answer_stream = Markdown.get_stream(self.answer_view)
        self.show_status("Thinking… (Esc stops)")
        params = self.settings.generation_params(can_shift=self.session.can_shift)
        self.generate_worker(self.session, list(self.conversation.messages), self.settings.system_prompt, params,
                             self.conversation)

    @work(thread=True, group="engine")
    def generate_worker(self, session: ChatSession, messages: list[dict], system_prompt: str, params,
                        conv: Conversation) -> None:
        stats = TurnStats()
        pieces = []
        error = None
        try:
            for text in session.stream(messages, system_prompt, params, stats, loop_guard=self.settings.loop_guard):
                pieces.append(text)
                self.post_message(TokenText(text))
        except LocalLLMError as e:
            error = str(e)
        if error is None:
            conv.messages = messages + [{"role": "assistant", "content": "".join(pieces)}]
            conv.model = session.engine.name
            try:
                conversations.save(conv)
                session.save_kv(conversations.kv_path(conv.id))
            except (OSError, LocalLLMError) as e:
                error = f"could not save the conversation: {e}"
        self.post_message(TurnDone(stats, error))

    async def on_token_text(self, message: TokenText) -> None:
        self.answer += message.text
        if self.answer_stream is not None:
            await self.answer_stream.write(message.text)
        self.query_one("#messages", VerticalScroll).scroll_end(animate=False)

    async def on_turn_done(self, message: TurnDone) -> None:
        if self.answer_stream is not None:
            await self.answer_stream.stop()
            self.answer_stream = None
        self.busy = None
        self.last_stats = stats = message.stats
        if message.error:
            if not self.answer:
                # Nothing was generated (e.g. the conversation no longer fits): give the message back to edit.
                await self.answer_view.remove()
                await self.restore_last_user_message()
            self.show_status(f"[red]{escape(message.error)}[/]")
            self.notify(message.error, severity="error", timeout=8, markup=False)
            return
        self.update_topbar()
        outcome = stats.outcome()
        self.show_status(stats.summary() + (f" · {outcome}" if outcome and len(outcome) < 20 else ""))
        if outcome and (stats.context_full or stats.finish_reason == "length"):
            self.notify(outcome, severity="warning", timeout=10, markup=False)

    async def remove_last_view(self, role: str) -> None:
        views = self.query(ChatMessage)
        if views and views.last().role == role:
            await views.last().remove()

    async def restore_last_user_message(self) -> None:
        messages = self.conversation.messages
        if messages and messages[-1]["role"] == "user":
            text = messages.pop()["content"]
            await self.remove_last_view("user")
            self.query_one(ChatInput).load_text(text)

    def action_stop(self) -> None:
        if self.busy == "generating" and self.session is not None:
            self.session.cancel.set()

    async def action_regenerate(self) -> None:
        messages = self.conversation.messages
        if not messages or not self.ready_to_generate():
            return
        if messages[-1]["role"] == "assistant":
            messages.pop()
            await self.remove_last_view("assistant")
        self.generate()

    async def action_edit_last(self) -> None:
        if self.busy or not any(m["role"] == "user" for m in self.conversation.messages):
            return
        messages = self.conversation.messages
        if messages[-1]["role"] == "assistant":
            messages.pop()
            await self.remove_last_view("assistant")
        await self.restore_last_user_message()
        self.query_one(ChatInput).focus()

    def last_answer(self) -> str | None:
        return next((m["content"] for m in reversed(self.conversation.messages) if m["role"] == "assistant"), None)

    def action_copy_answer(self) -> None:
        text = self.last_answer()
        if text is None:
            self.notify("No answer to copy yet")
            return
        self.copy_to_clipboard(text)
        path = conversations.save_copied_text(text)
        self.notify(f"Copied to the clipboard (if the terminal allows OSC 52) and to {path}", timeout=8, markup=False)

    def action_export(self) -> None:
        if not self.conversation.messages:
            self.notify("Nothing to export yet")
            return
        path = conversations.export_markdown(self.conversation)
        self.notify(f"Exported to {path}", timeout=8, markup=False)

    # ---- conversations ------------------------------------------------------------------------------------

    def action_new_conversation(self) -> None:
        if self.busy:
            self.notify(f"Still {self.busy}", severity="warning")
            return
        self.conversation = Conversation(model=self.session.engine.name if self.session else "")
        self.query_one("#messages").remove_children()
        if self.session is not None:
            self.session.reset()
        self.update_topbar()
        self.show_status("New conversation · F1 help")

    def action_conversations(self) -> None:
        if self.busy:
            self.notify(f"Still {self.busy}", severity="warning")
            return

        def chosen(conv_id: str | None) -> None:
            if conv_id == "":
                self.action_new_conversation()
            elif conv_id is not None:
                self.open_conversation(conv_id)

        self.push_screen(ConversationsScreen(), chosen)

    def open_conversation(self, conv_id: str) -> None:
        try:
            conv = conversations.load(conv_id)
        except ConversationError as e:  # changed on disk since the list was shown
            self.notify(f"Cannot open the conversation: {e}", severity="error", timeout=10, markup=False)
            return
        self.conversation = conv
        box = self.query_one("#messages", VerticalScroll)
        box.remove_children()
        for m in conv.messages:
            self.mount_message(m["role"], m["content"])
        self.update_topbar()
        # Reload the conversation's model when it is here (its saved KV cache then applies); else go on with this
        # one (the messages are rendered with its template).
        same_model = self.session is not None and conv.model == self.session.engine.name
        if not same_model and conv.model and store.has_model(conv.model):
            self.restore_kv_of = conv.id
            self.load_model(conv.model)
            return
        if self.session is not None:
            restored = self.session.restore_kv(conversations.kv_path(conv.id)) if same_model else 0
            if not restored:
                self.session.reset()
            self.show_status(f"Reopened · {restored} tokens restored from the saved cache" if restored
                             else "Reopened")

    # ---- models and settings ------------------------------------------------------------------------------

    def action_models(self) -> None:
        if self.busy:
            self.notify(f"Still {self.busy}", severity="warning")
            return
        self.push_screen(ModelPicker(self.session.engine.name if self.session else None), self.model_chosen)

    def model_chosen(self, name: str | None) -> None:
        if name and (self.session is None or name != self.session.engine.name):
            self.load_model(name)  # the conversation stays; the next turn renders it with this model's template

    def action_settings(self) -> None:
        def saved(new: ChatSettings | None) -> None:
            if new is None:
                return
            old, self.settings = self.settings, new
            settings_store.save(new)
            self.notify("Settings saved")
            reload = (new.ctx, new.kv_type, new.device) != (old.ctx, old.kv_type, old.device)
            if reload and self.session is not None and not self.busy:
                self.restore_kv_of = None
                self.load_model(self.session.engine.name)

        if self.opencl_devices is None:
            from localllm.backends.devices import opencl_devices

            self.opencl_devices = opencl_devices()[0]  # none (and no error shown) where OpenCL is missing
        self.push_screen(SettingsScreen(self.settings, self.opencl_devices), saved)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_toggle_theme(self) -> None:
        self.theme = "textual-light" if self.theme == "textual-dark" else "textual-dark"

    def check_action(self, action: str, parameters) -> bool | None:
        # The chat's keys belong to the chat screen; a dialog on top keeps its own (Esc closes it).
        if action in ("stop", "regenerate", "edit_last", "copy_answer", "export", "new_conversation") \
                and self.screen is not self.screen_stack[0]:
            return False
        return True

    async def action_quit(self) -> None:
        if self.session is not None:
            self.session.cancel.set()
        self.exit()


def run(model: str | None, chat_settings: ChatSettings | None = None, notices: list[str] | None = None) -> int:
    """Models load on `chat_settings.device` (the saved setting, or `--device`)."""
    ChatApp(model, loader=load_engine, chat_settings=chat_settings, notices=notices).run()
    return 0
