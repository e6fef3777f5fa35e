"""The TUI's modal screens: help, settings, the model picker (with pulling), and the conversation list."""

from __future__ import annotations

import signal
import subprocess
import sys
from dataclasses import fields, replace

from rich.markup import escape as as_text  # DataTable reads a str cell as Rich markup
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.markup import escape
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Input, Label, Markdown, ProgressBar, Select, Static, TextArea

from localllm import parameters
from localllm.store import catalog
from localllm.store import hub
from localllm.store import local as store
from localllm.errors import LocalLLMError
from localllm.tui import conversations
from localllm.tui.settings import ChatSettings

HELP = """\
# localllm chat

| key | what |
| --- | --- |
| Enter | send the message |
| Ctrl+J | new line in the message (Shift+Enter too, if the terminal sends it) |
| Esc | stop the answer being generated |
| Ctrl+R | regenerate the last answer |
| Ctrl+L | edit the last message and send it again |
| F5 | copy the last answer (clipboard via OSC 52, and a file) |
| F6 | export the conversation to Markdown |
| F2 | settings: system prompt, sampling, context |
| F3 | models: switch, or pull one (Esc cancels a pull) |
| F4 | saved conversations: open, rename, delete |
| Ctrl+N | new conversation |
| Ctrl+T | light / dark theme |
| F1 or ? | this help |
| Ctrl+Q | quit |

Conversations are saved as you go, with their KV cache, so reopening one continues where it stopped without
evaluating it again. The status line shows the time to the first token, the speed, how much of the context the
conversation uses, and how many prompt tokens came from the cache.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,q,question_mark", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="dialog", classes="help"):
            yield Markdown(HELP)

    def action_dismiss(self) -> None:
        self.dismiss(None)


# ---- settings ---------------------------------------------------------------------------------------------

# field -> label shown, and the hint below the input
SETTING_LABELS = {
    **{p.name: (p.label, p.hint) for p in parameters.chat_settings()},  # the sampling table's (parameters.py)
    "max_tokens": ("Max tokens", "per answer; -1 = no limit"),
    "ctx": ("Context size", "tokens; 0 = the model's (at most 4096); reloads the model"),
    "seed": ("Seed", "empty = random"),
    "keep": ("Keep on shift", "tokens kept at the start; -1 = the whole prompt"),
}


def device_choices(current: str, devices: list[dict]) -> list[tuple[str, str]]:
    """(label, --device value) for the CPU, each OpenCL device (named by platform and device, so that another
    runtime installed later does not change which one a saved setting means) and the saved value if it is
    neither (a device that is gone stays visible rather than silently becoming the CPU)."""
    choices = [("CPU (Numba kernels)", "cpu")]
    for d in devices:
        choices.append((f"{d['name']} ({d['platform']}, {d['type']}, OpenCL)", f"opencl:{d['platform']}:{d['name']}"))
    if current not in {value for _, value in choices}:
        choices.append((current, current))
    return choices


class SettingsScreen(ModalScreen[ChatSettings | None]):
    """Edit the settings; Ctrl+S (or the Save button) returns them, validated; Esc discards."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, settings: ChatSettings, devices: list[dict] | None = None):
        """`devices`: the OpenCL devices as `localllm devices --json` lists them (the CPU is always offered)."""
        super().__init__()
        self.settings = settings
        self.devices = devices or []

    def compose(self) -> ComposeResult:
        s = self.settings
        with Vertical(id="dialog", classes="settings"):
            yield Label("Settings", classes="title")
            with VerticalScroll():
                yield Label("System prompt")
                yield TextArea(s.system_prompt, id="system_prompt", classes="system", compact=True)
                for name, (label, hint) in SETTING_LABELS.items():
                    value = getattr(s, name)
                    with Horizontal(classes="row"):
                        yield Label(label, classes="name")
                        yield Input("" if value is None else str(value), id=name, classes="value", compact=True)
                        yield Label(hint, classes="hint")
                with Horizontal(classes="row"):
                    yield Label("At context limit", classes="name")
                    yield Select([("shift (drop oldest)", "shift"), ("stop", "stop")], value=s.context_overflow,
                                 allow_blank=False, id="context_overflow", classes="value", compact=True)
                with Horizontal(classes="row"):
                    yield Label("KV cache", classes="name")
                    yield Select([("float32", "f32"), ("q8_0 (8-bit)", "q8_0")], value=s.kv_type,
                                 allow_blank=False, id="kv_type", classes="value", compact=True)
                    yield Label("reloads the model", classes="hint")
                with Horizontal(classes="row"):
                    yield Label("Device", classes="name")
                    yield Select(device_choices(s.device, self.devices), value=s.device, allow_blank=False,
                                 id="device", classes="value", compact=True)
                    yield Label("reloads the model", classes="hint")
                with Horizontal(classes="row"):
                    yield Label("Speculation", classes="name")
                    yield Select([("off", "off"), ("n-gram lookup", "ngram"), ("draft model", "draft")],
                                 value=s.speculation, allow_blank=False, id="speculation", classes="value",
                                 compact=True)
                    yield Label("same answers, faster where drafts are right", classes="hint")
                with Horizontal(classes="row"):
                    yield Label("Draft model", classes="name")
                    yield Input(s.draft_model, id="draft_model", classes="value", compact=True)
                    yield Label("for draft: same vocabulary, smaller", classes="hint")
            yield Static("", id="error")
            with Horizontal(classes="buttons"):
                yield Button("Save (Ctrl+S)", variant="primary", id="save", compact=True)
                yield Button("Cancel (Esc)", id="cancel", compact=True)

    def read(self) -> ChatSettings:
        values = {"system_prompt": self.query_one("#system_prompt", TextArea).text,
                  "context_overflow": self.query_one("#context_overflow", Select).value,
                  "kv_type": self.query_one("#kv_type", Select).value,
                  "device": self.query_one("#device", Select).value,
                  "speculation": self.query_one("#speculation", Select).value,
                  "draft_model": self.query_one("#draft_model", Input).value.strip()}
        types = {f.name: type(getattr(ChatSettings(), f.name)) for f in fields(ChatSettings)}
        for name, (label, _) in SETTING_LABELS.items():
            text = self.query_one(f"#{name}", Input).value.strip()
            if name == "seed":
                values[name] = int(text) if text else None
                continue
            try:
                values[name] = types[name](text)
            except ValueError:
                raise ValueError(f"{label}: {text!r} is not a number") from None
        return replace(self.settings, **values).validated()

    @on(Button.Pressed, "#save")
    def action_save(self) -> None:
        try:
            self.dismiss(self.read())
        except ValueError as e:
            self.query_one("#error", Static).update(f"[b red]{e}[/]")

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


# ---- models -----------------------------------------------------------------------------------------------


def human_size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


class ModelPicker(ModalScreen[str | None]):
    """Catalog and downloaded models. Enter switches to a downloaded one, or pulls one that is not (in a child
    `localllm pull`, whose Ctrl-C cleanup leaves nothing behind when Esc cancels it)."""

    BINDINGS = [Binding("escape", "close", "Close / cancel pull"),
                Binding("slash", "reference", "Type a hub reference", show=False)]

    def __init__(self, current: str | None, pull_now: str | None = None):
        super().__init__()
        self.current = current
        self.pull_now = pull_now
        self.pull_proc: subprocess.Popen | None = None
        self.pull_cancelled = False

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="models"):
            yield Label("Models — Enter: use (or pull), Esc: close", classes="title")
            yield DataTable(cursor_type="row", zebra_stripes=True)
            # '/' opens it: any GGUF on the hub by reference, pulled like a catalog model
            yield Input(placeholder="hf.co/USER/REPO:QUANT, USER/REPO or hf://USER/REPO/FILE.gguf, then Enter",
                        id="reference")
            yield Label("", id="pull_label")
            yield ProgressBar(id="pull_bar", show_eta=False)

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("Model", "Size", "Status", "About")
        self.query_one("#pull_bar").display = False
        self.query_one("#reference").display = False
        self.refresh_rows()
        if self.pull_now:
            self.start_pull(self.pull_now)

    def refresh_rows(self) -> None:
        table = self.query_one(DataTable)
        table.clear()
        local = {m.name: m for m in store.local_models()}
        names = list(catalog.entries()) + sorted(set(local) - set(catalog.entries()))
        for m in hub.hub_models():  # pulled by reference: listed under the reference
            status = "in use" if m.name == self.current else "downloaded"
            table.add_row(as_text(m.name), human_size(m.size), status,
                          as_text(f"Hugging Face hub {m.provenance.get('repo', '')}"), key=m.name)
        for name in names:
            entry = catalog.entries().get(name)
            size = local[name].size if name in local else entry.size
            status = "in use" if name == self.current else "downloaded" if name in local else "not downloaded"
            about = entry.description if entry else str(local[name].path)
            # Text, not markup: a local model's name and path are whatever its file is called.
            table.add_row(as_text(name), human_size(size), status, as_text(about), key=name)
        if self.current in names:
            table.move_cursor(row=names.index(self.current))

    @on(DataTable.RowSelected)
    def choose(self, event: DataTable.RowSelected) -> None:
        name = event.row_key.value
        if self.pull_proc is not None:
            self.notify("A pull is running: Esc cancels it", severity="warning")
        elif store.has_model(name) or name in {m.name for m in hub.hub_models()}:
            self.dismiss(name)
        else:
            self.start_pull(name)

    def action_reference(self) -> None:
        box = self.query_one("#reference", Input)
        box.display = True
        box.focus()

    @on(Input.Submitted, "#reference")
    def reference_given(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if self.pull_proc is not None:
            self.notify("A pull is running: Esc cancels it", severity="warning")
            return
        try:
            ref = hub.parse(text)  # an unsafe or malformed reference is refused here, before anything runs
        except LocalLLMError as e:
            self.query_one("#pull_label", Label).update(f"[red]{escape(str(e))}[/]")
            return
        found = hub.find_local(ref)
        if found is not None:
            self.dismiss(found.name)
        else:
            self.pull_now = text  # go straight to it once pulled
            self.start_pull(text)

    def start_pull(self, name: str) -> None:
        self.pull_cancelled = False
        self.query_one("#pull_label", Label).update(f"Pulling {name}… (Esc cancels)")
        bar = self.query_one("#pull_bar", ProgressBar)
        bar.display = True
        entry = catalog.entries().get(name)
        bar.update(total=entry.size if entry else None, progress=0)  # a hub reference's size comes later
        self.pull_proc = subprocess.Popen([sys.executable, "-m", "localllm", "pull", "--quiet", name],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                          start_new_session=True)
        self.set_interval(0.25, self.show_pull_progress, name="pull-progress")
        self.wait_for_pull(name, self.pull_proc)

    def show_pull_progress(self) -> None:
        if self.pull_proc is not None:
            self.query_one("#pull_bar", ProgressBar).update(progress=store.in_flight_bytes())

    @work(thread=True, group="pull")
    def wait_for_pull(self, name: str, proc: subprocess.Popen) -> None:
        _, err = proc.communicate()
        self.app.call_from_thread(self.pull_done, name, proc.returncode, err)

    def pull_done(self, name: str, returncode: int, err: str) -> None:
        self.pull_proc = None
        self.query_one("#pull_bar").display = False
        label = self.query_one("#pull_label", Label)
        if self.pull_cancelled:
            label.update(f"Pull of {name} cancelled; nothing was left behind." if name in catalog.entries() else
                         f"Pull of {name} cancelled; pulling it again resumes.")
        elif returncode == 0 and name == self.pull_now:
            self.dismiss(name)  # pulled because it was asked for (first run): go straight to it
            return
        elif returncode == 0:
            label.update(f"{name} is downloaded: Enter uses it.")
        else:
            lines = [ln for ln in err.strip().splitlines() if ln.strip()]
            label.update(f"[red]Pull of {name} failed: {escape(lines[-1]) if lines else f'exit {returncode}'}[/]")
        self.refresh_rows()

    def action_close(self) -> None:
        if self.pull_proc is not None:
            self.pull_cancelled = True
            self.pull_proc.send_signal(signal.SIGINT)  # the pull's Ctrl-C path removes its partial files
            self.query_one("#pull_label", Label).update("Cancelling the pull…")
        else:
            self.dismiss(None)


# ---- conversations ----------------------------------------------------------------------------------------


class ConversationsScreen(ModalScreen[str | None]):
    """Saved conversations: Enter opens, N starts a new one, R renames, D deletes. Returns the id to open, "" for
    a new conversation, None to close."""

    BINDINGS = [Binding("escape", "close", "Close"), Binding("n", "new", "New"),
                Binding("r", "rename", "Rename"), Binding("d", "delete", "Delete")]

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="conversations"):
            yield Label("Conversations — Enter: open, N: new, R: rename, D: delete, Esc: close", classes="title")
            yield DataTable(cursor_type="row", zebra_stripes=True)
            yield Input(placeholder="New title, Enter to rename", id="rename", compact=True)

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns("Title", "Model", "Messages", "Updated")
        self.query_one("#rename").display = False
        self.refresh_rows(report=True)

    def refresh_rows(self, report: bool = False) -> None:
        import time

        table = self.query_one(DataTable)
        table.clear()
        problems: list[str] = []
        for conv in conversations.list_all(problems):
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(conv.updated))
            # Text, not markup: titles are what the user typed, or what a file says.
            table.add_row(as_text(conv.display_title), as_text(conv.model), str(len(conv.messages)), when, key=conv.id)
        table.focus()
        if report and problems:
            shown = "\n".join(problems[:5]) + (f"\n… and {len(problems) - 5} more" if len(problems) > 5 else "")
            self.notify(f"Skipped {len(problems)} saved conversation file(s) that cannot be read (left as they "
                        f"are):\n{shown}", severity="warning", timeout=15, markup=False)

    def selected_id(self) -> str | None:
        table = self.query_one(DataTable)
        if table.row_count == 0:
            return None
        return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value

    @on(DataTable.RowSelected)
    def open_selected(self, event: DataTable.RowSelected) -> None:
        self.dismiss(event.row_key.value)

    def action_new(self) -> None:
        self.dismiss("")

    def action_close(self) -> None:
        rename = self.query_one("#rename", Input)
        if rename.display:
            rename.display = False
            self.query_one(DataTable).focus()
        else:
            self.dismiss(None)

    def action_rename(self) -> None:
        if (conv_id := self.selected_id()) is None:
            return
        rename = self.query_one("#rename", Input)
        try:
            rename.value = conversations.load(conv_id).display_title
        except conversations.ConversationError as e:
            self.notify(str(e), severity="error", markup=False)
            self.refresh_rows()
            return
        rename.display = True
        rename.focus()

    @on(Input.Submitted, "#rename")
    def apply_rename(self, event: Input.Submitted) -> None:
        if (conv_id := self.selected_id()) is not None and event.value.strip():
            try:
                conversations.rename(conversations.load(conv_id), event.value)
            except (conversations.ConversationError, OSError) as e:
                self.notify(f"Cannot rename it: {e}", severity="error", markup=False)
        event.input.display = False
        self.refresh_rows()

    def action_delete(self) -> None:
        if (conv_id := self.selected_id()) is None:
            return
        try:
            conversations.delete(conv_id)
        except (conversations.ConversationError, OSError) as e:
            self.notify(f"Cannot delete it: {e}", severity="error", markup=False)
        else:
            self.notify("Conversation deleted")
        self.refresh_rows()


class ConfirmPull(ModalScreen[bool]):
    """First run: nothing is downloaded yet."""

    BINDINGS = [Binding("escape", "no", "Not now")]

    def __init__(self, message: str, choose: bool = False):
        """`choose`: a third button, "Choose another", whose answer is "choose" (the model picker)."""
        super().__init__()
        self.message = message
        self.choose = choose

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="confirm"):
            yield Static(self.message)
            with Horizontal(classes="buttons"):
                yield Button("Pull it", variant="primary", id="yes", compact=True)
                if self.choose:
                    yield Button("Choose another", id="choose", compact=True)
                yield Button("Not now (Esc)", id="no", compact=True)

    @on(Button.Pressed, "#yes")
    def yes(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#choose")
    def choose_another(self) -> None:
        self.dismiss("choose")

    @on(Button.Pressed, "#no")
    def action_no(self) -> None:
        self.dismiss(False)
