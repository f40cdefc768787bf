"""A small desktop chat app: Tkinter (stdlib) + edgelm.runtime, nothing else.

    python examples/desktop/app.py [--package PATH] [--provider cpu|cuda|auto] [--threads N] [--adapter FILE]
                                   [--tools FILE] [--template-var KEY=VALUE]

A package with a chat template gets a chat: a history view, a message box, Send, Stop and New chat, and
a Conversation (runtime/chat.py) that keeps its KV cache between turns, so a follow-up message is
answered without reading the whole history again. A package without one falls back to text
completion: the message box is the prompt and the view shows its continuation.

Tk may only be touched from the thread that created it (the tkinter docs' "Threading model"), and
a model call blocks while it runs. So loading and generating run on a worker thread that never
calls Tk: it puts messages on a queue, and the UI thread drains that queue every POLL_MS with
`after`, so the window keeps repainting and answering clicks. Stop sets the threading.Event
passed to the stream as `cancel`; the runtime checks it before every decode step, so the reply
ends within one step (and stays in the conversation as far as it got).

A package with LoRA slots (`edgelm export --lora-slots`) gets an Adapter menu beside Load: "(base)" and the
.onnx_adapter files added with Add... (or --adapter); each message runs with the adapter chosen, and a chat
whose adapter changes is prefilled again under the new one (runtime/adapters.py).

Tools and reasoning (docs/apps.md): Tools... (or --tools FILE, the JSON list of tool specs `edgelm chat --tools`
reads) gives the chat's template its tools. A reply's reasoning (Qwen3's, SmolLM3's <think>) shows greyed apart
from its answer, and each tool call it makes as a line `→ get_weather({"city": "Paris"})`; the next messages
typed are then the calls' results, one per call, sent back as `role: "tool"` messages (New chat drops pending
calls). Thinking is the template's enable_thinking, offered when the chat template reads it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import queue
import threading
import tkinter as tk
from tkinter import filedialog, ttk

from edgelm.cli.apps import add_chat_inputs, chat_inputs, read_tools_file
from edgelm.runtime import EdgelmError, GenerationResult, Model, ToolCall, load
from edgelm.runtime.chat import template_variables
from edgelm.runtime.chat_defaults import CHAT_SAMPLING, model_chat_sampling
from edgelm.runtime.tools import tool_name, tool_specs

POLL_MS = 30  # how often the UI thread drains the worker's queue: fast enough to look live

# (runtime keyword, label, parser, default). An empty seed means a different sample every run. A loaded chat
# package sets the sampling fields to what its model recommends, else to edgelm's chat defaults
# (runtime/chat_defaults.py); temperature 0 is greedy.
PARAMETERS = [
    ("max_new_tokens", "Max tokens", int, "200"),
    ("temperature", "Temperature", float, f"{CHAT_SAMPLING['temperature']:g}"),
    ("top_k", "Top-k", int, "0"),
    ("top_p", "Top-p", float, f"{CHAT_SAMPLING['top_p']:g}"),
    ("min_p", "Min-p", float, f"{CHAT_SAMPLING['min_p']:g}"),
    ("repetition_penalty", "Repeat penalty", float, f"{CHAT_SAMPLING['repetition_penalty']:g}"),
    ("seed", "Seed", int, ""),
]
DEFAULT_SYSTEM = "You are a helpful assistant."
BASE_ADAPTER = "(base)"  # the adapter menu's entry for no LoRA adapter


def read_tools(path: str) -> list[dict]:
    """A tools file as `edgelm chat --tools` reads it (edgelm/cli/apps.py), each spec checked; ValueError if bad."""
    try:
        tools = read_tools_file(path)
    except argparse.ArgumentTypeError as e:
        raise ValueError(str(e)) from None
    tool_specs(tools)  # ChatTemplateError (a ValueError) for a spec that is not a dict or a function
    return tools


def tool_call_line(call: ToolCall) -> str:
    """A parsed tool call as the history shows it: → get_weather({"city": "Paris"})."""
    return f"→ {call.name}({json.dumps(call.arguments, ensure_ascii=False)})"


def tool_message(call: ToolCall, result: str) -> dict:
    """The message that gives a tool call's result back to the conversation."""
    return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": result}


def piece_parts(piece: str) -> list[tuple[str, str]]:
    """A streamed piece as (text, tag) runs for the history: its reasoning ("reasoning", greyed), its content
    (no tag) and a line per tool call it completed ("tool"). A plain str (text completion) is all content."""
    parts = [(getattr(piece, "reasoning", ""), "reasoning"), (getattr(piece, "content", piece), "")]
    parts += [(f"\n{tool_call_line(call)}\n", "tool") for call in getattr(piece, "tool_calls", ())]
    return [(text, tag) for text, tag in parts if text]


class ChatApp:
    """The window's widgets and its jobs: loading a package, and streaming a reply (or a completion).

    Driven by a person through the buttons, or by a test through load_package(), send_message(),
    stop_generation() and new_chat(); both read mode ("chat" or "completion"), status_text,
    history_text(), is_busy, is_generating and last_result."""

    def __init__(
        self,
        root: tk.Tk,
        package: str | None = None,
        *,
        provider: str = "auto",
        threads: int | None = None,
        adapters: tuple[str, ...] = (),
        tools: list | None = None,
        template_vars: dict | None = None,
    ):
        self.root = root
        self.tools = tools  # tool specs for the chat template (Tools..., --tools)
        self.template_vars = dict(template_vars or {})  # --template-var; enable_thinking goes to the checkbox
        self.pending_calls: list[ToolCall] = []  # the last reply's tool calls whose results are still to be typed
        self._tool_results: list[dict] = []  # role "tool" messages typed so far for pending_calls
        self.start_adapters = adapters  # .onnx_adapter files to load once the package is
        self.provider = provider
        self.threads = threads
        self.model: Model | None = None
        self.conversation = None  # a runtime Conversation in chat mode
        self.last_result: GenerationResult | None = None  # the latest finished reply
        self._messages: queue.Queue[tuple[str, object]] = queue.Queue()  # worker -> UI thread
        self._cancel = threading.Event()
        self._job: str | None = None  # "load" or "generate" while a worker runs
        self._build_widgets()
        self.root.protocol("WM_DELETE_WINDOW", self.close)
        self._poll_id = self.root.after(POLL_MS, self._poll)
        if package:
            self.package_path.set(package)
            self.load_package(package)
        else:
            self._set_status("Choose a model package folder and press Load.")

    # ---- layout --------------------------------------------------------------------------------

    def _build_widgets(self) -> None:
        self.root.title("edgelm chat")
        self.root.columnconfigure(0, weight=1)
        self.root.rowconfigure(2, weight=1)
        self._build_package_row()
        self._build_settings()
        self._build_history()
        self._build_message_box()
        self._build_status_bar()
        self.root.bind("<Escape>", lambda _: self.stop_generation())
        self._update_buttons()

    def _build_package_row(self) -> None:
        """The package folder, with Browse and Load beside it."""
        top = ttk.Frame(self.root, padding=(8, 8, 8, 0))
        top.grid(row=0, column=0, sticky="ew")
        top.columnconfigure(1, weight=1)
        ttk.Label(top, text="Package").grid(row=0, column=0, padx=(0, 6))
        self.package_path = tk.StringVar()
        entry = ttk.Entry(top, textvariable=self.package_path)
        entry.grid(row=0, column=1, sticky="ew")
        entry.bind("<Return>", lambda _: self.load_package(self.package_path.get()))
        ttk.Button(top, text="Browse...", command=self._browse).grid(row=0, column=2, padx=(6, 0))
        self.load_button = ttk.Button(top, text="Load", command=lambda: self.load_package(self.package_path.get()))
        self.load_button.grid(row=0, column=3, padx=(6, 0))
        # LoRA adapters: shown for a package with LoRA slots (edgelm export --lora-slots); "(base)" is no adapter
        self.adapter_label = ttk.Label(top, text="Adapter")
        self.adapter_choice = tk.StringVar(value=BASE_ADAPTER)
        self.adapter_menu = ttk.Combobox(top, textvariable=self.adapter_choice, state="readonly", width=16)
        self.adapter_add = ttk.Button(top, text="Add...", command=self._browse_adapter)
        self._adapter_widgets = [(self.adapter_label, 4), (self.adapter_menu, 5), (self.adapter_add, 6)]
        self._show_adapters(False)

    def _show_adapters(self, show: bool) -> None:
        for widget, column in self._adapter_widgets:
            if show:
                widget.grid(row=0, column=column, padx=(10 if column == 4 else 6, 0))
            else:
                widget.grid_remove()
        self.adapter_menu.configure(values=[BASE_ADAPTER, *(self.model.adapters if show and self.model else [])])
        self.adapter_choice.set(BASE_ADAPTER)

    def _browse_adapter(self) -> None:
        path = filedialog.askopenfilename(title="LoRA adapter", filetypes=[("ONNX Runtime adapter", "*.onnx_adapter")])
        if path:
            self.load_adapter(path)

    def _build_settings(self) -> None:
        """Sampling on one row, the system prompt below it."""
        settings = ttk.Frame(self.root, padding=(8, 6, 8, 0))
        settings.grid(row=1, column=0, sticky="ew")
        self.params: dict[str, tk.StringVar] = {}
        for column, (key, label, _, default) in enumerate(PARAMETERS):
            ttk.Label(settings, text=label).grid(row=0, column=2 * column, padx=(0 if column == 0 else 10, 4))
            self.params[key] = tk.StringVar(value=default)
            ttk.Entry(settings, textvariable=self.params[key], width=6).grid(row=0, column=2 * column + 1)
        ttk.Label(settings, text="System").grid(row=1, column=0, pady=(6, 0), sticky="w")
        self.system_prompt = tk.StringVar(value=DEFAULT_SYSTEM)
        ttk.Entry(settings, textvariable=self.system_prompt).grid(
            row=1, column=1, columnspan=2 * len(PARAMETERS) - 1, sticky="ew", pady=(6, 0)
        )
        self.tools_button = ttk.Button(settings, text="Tools...", command=self._browse_tools)
        self.tools_button.grid(row=2, column=0, pady=(6, 0), sticky="w")
        self.tools_label = ttk.Label(settings, foreground="gray35")
        self.tools_label.grid(row=2, column=1, columnspan=2 * len(PARAMETERS) - 3, sticky="w", pady=(6, 0))
        self.thinking = tk.BooleanVar(value=self.template_vars.pop("enable_thinking", True) is not False)
        self.thinking_box = ttk.Checkbutton(settings, text="Thinking", variable=self.thinking, state="disabled")
        self.thinking_box.grid(row=2, column=2 * len(PARAMETERS) - 2, columnspan=2, sticky="e", pady=(6, 0))
        self._show_tools()

    def _build_history(self) -> None:
        """The conversation so far, read-only, with a scroll bar."""
        body = ttk.Frame(self.root, padding=8)
        body.grid(row=2, column=0, sticky="nsew")
        body.rowconfigure(0, weight=1)
        body.columnconfigure(0, weight=1)
        self.history = tk.Text(body, wrap="word", state="disabled", padx=6, pady=4)  # only _append writes
        self.history.tag_configure("user", foreground="navy", font=("TkDefaultFont", 10, "bold"))
        self.history.tag_configure("label", foreground="gray35", font=("TkDefaultFont", 9, "italic"))
        self.history.tag_configure("reasoning", foreground="gray50", font=("TkDefaultFont", 9, "italic"))
        self.history.tag_configure("tool", foreground="dark green", font=("TkFixedFont", 9))
        scroll = ttk.Scrollbar(body, command=self.history.yview)
        self.history.configure(yscrollcommand=scroll.set)
        self.history.grid(row=0, column=0, sticky="nsew")
        scroll.grid(row=0, column=1, sticky="ns")

    def _build_message_box(self) -> None:
        """The message box, with Send / Stop / New chat beside it."""
        bottom = ttk.Frame(self.root, padding=(8, 0, 8, 8))
        bottom.grid(row=3, column=0, sticky="ew")
        bottom.columnconfigure(0, weight=1)
        self.input = tk.Text(bottom, height=3, wrap="word", undo=True)
        self.input.grid(row=0, column=0, rowspan=3, sticky="nsew")
        self.input.bind("<Return>", lambda _: (self.send_message(), "break")[1])  # "break": no newline
        self.input.bind("<Shift-Return>", lambda _: None)  # a newline in the message
        self.send_button = ttk.Button(bottom, text="Send", command=self.send_message)
        self.send_button.grid(row=0, column=1, sticky="new", padx=(6, 0))
        self.stop_button = ttk.Button(bottom, text="Stop", command=self.stop_generation)
        self.stop_button.grid(row=1, column=1, sticky="new", padx=(6, 0))
        self.new_chat_button = ttk.Button(bottom, text="New chat", command=self.new_chat)
        self.new_chat_button.grid(row=2, column=1, sticky="new", padx=(6, 0))

    def _build_status_bar(self) -> None:
        self._status = tk.StringVar()
        self.status_label = ttk.Label(self.root, textvariable=self._status, relief="sunken", anchor="w", padding=(6, 2))
        self.status_label.grid(row=4, column=0, sticky="ew")

    def _browse_tools(self) -> None:
        path = filedialog.askopenfilename(title="Tools (a JSON list of tool specs)", filetypes=[("JSON", "*.json")])
        if path:
            self.load_tools(path)

    def _show_tools(self) -> None:
        names = [tool_name(spec) or "?" for spec in tool_specs(self.tools) or []]
        self.tools_label.configure(text=f"Tools: {', '.join(names)}" if names else "No tools")

    def _browse(self) -> None:
        folder = filedialog.askdirectory(title="Model package folder", mustexist=True)
        if folder:
            self.package_path.set(folder)
            self.load_package(folder)

    # ---- readable state ------------------------------------------------------------------------

    @property
    def mode(self) -> str | None:
        if self.model is None:
            return None
        return "chat" if self.conversation is not None else "completion"

    @property
    def status_text(self) -> str:
        return self._status.get()

    @property
    def is_busy(self) -> bool:
        return self._job is not None

    @property
    def is_generating(self) -> bool:
        return self._job == "generate"

    def history_text(self) -> str:
        return self.history.get("1.0", "end-1c")

    # ---- actions -------------------------------------------------------------------------------

    def load_package(self, path: str) -> None:
        """Load a package folder on the worker; the current model stays usable if this one fails."""
        if self.is_busy:
            return
        path = path.strip()
        if not path:
            self._set_error("Enter the path of a model package folder.")
            return
        self._set_status(f"Loading {path} ...")
        self._start_worker("load", self._load_worker, path)

    @property
    def adapter(self) -> str | None:
        """The adapter chosen in the menu; None for the base model."""
        choice = self.adapter_choice.get()
        return None if choice == BASE_ADAPTER else choice

    def load_adapter(self, path: str) -> None:
        """Load an .onnx_adapter for the package's LoRA slots (a small file: on the UI thread) and choose it."""
        if self.model is None or self.model.lora_slots is None:
            self._set_error("This package has no LoRA slots (export it with --lora-slots).")
            return
        try:
            name = self.model.load_adapter(path)
        except (EdgelmError, OSError) as e:
            self._set_error(str(e))
            return
        self.adapter_menu.configure(values=[BASE_ADAPTER, *self.model.adapters])
        self.adapter_choice.set(name)
        self._set_status(f"Loaded adapter {name}.")

    @property
    def reads_thinking(self) -> bool:
        """Whether the chat template reads enable_thinking (Qwen3, SmolLM3): only then is Thinking passed."""
        return self.conversation is not None and "enable_thinking" in self.conversation.template.source

    def load_tools(self, path: str) -> None:
        """Use the tools of a JSON file (a list of tool specs) from the next message on."""
        try:
            self.tools = read_tools(path)
        except ValueError as e:
            self._set_error(str(e))
            return
        if self.conversation is not None:
            self.conversation.tools = self.tools
        self._show_tools()
        self._set_status(f"Loaded {len(self.tools)} tools from {path}.")

    def new_chat(self) -> None:
        """Start over with the system prompt as it is now set (the cache keeps what the new chat shares)."""
        if self.is_busy or self.model is None:
            return
        if self.conversation is not None:
            # the next turn compares its ids with the cache's, so a changed system prompt is safe here
            self.conversation.system = self.system_prompt.get().strip() or None
            self.conversation.reset()
        self.pending_calls, self._tool_results = [], []
        self._clear_history()
        self._set_status("New chat." if self.conversation is not None else "Cleared.")

    def send_message(self) -> None:
        """Check the settings, then stream the reply to the message box's text (or its completion)."""
        if self.is_busy:
            return
        if self.model is None:
            self._set_error("Load a model package first.")
            return
        options = self._read_options()
        if options is None:
            return
        text = self.input.get("1.0", "end-1c").strip()
        if not text:
            self._set_error("Type a message first.")
            return
        max_new_tokens = options.pop("max_new_tokens")
        options["adapter"] = self.adapter
        if self.reads_thinking:
            options["enable_thinking"] = self.thinking.get()
        message = text
        if self.conversation is not None and self.pending_calls:  # the text is the result of the next call
            call = self.pending_calls[0]
            message = [*self._tool_results, tool_message(call, text)]
            if len(self.pending_calls) > 1:  # more results to type before the model answers
                self._tool_results, self.pending_calls = message, self.pending_calls[1:]
                self.input.delete("1.0", "end")
                self._append(f"Result of {call.name}\n", "label")
                self._append(text + "\n\n", "user")
                self._set_status(f"Type the result of {tool_call_line(self.pending_calls[0])} and Send.")
                return
        self._cancel = threading.Event()  # a fresh one: a late Stop of the last run must not end this one
        system = self.system_prompt.get().strip() or None
        try:
            # stream() checks every parameter and the context before returning, so bad input is reported
            # here, on the UI thread, and no worker starts
            if self.conversation is not None:
                if all(message["role"] == "system" for message in self.conversation.messages):
                    self.conversation.system = system  # until the first message; later, New chat applies it
                stream = self.conversation.stream(message, max_new_tokens, cancel=self._cancel, **options)
            else:
                stream = self.model.stream(text, max_new_tokens, cancel=self._cancel, **options)
        except EdgelmError as e:
            self._set_error(str(e))
            return
        self.input.delete("1.0", "end")
        if isinstance(message, list):
            self._append(f"Result of {self.pending_calls[0].name}\n", "label")
            self._append(text + "\n\n", "user")
            self._append("Assistant\n", "label")
            self.pending_calls, self._tool_results = [], []
        elif self.conversation is not None:
            self._append("You\n", "label")
            self._append(text + "\n\n", "user")
            self._append("Assistant\n", "label")
        else:
            self._clear_history()
            self._append(text, "user")
        self._set_status("Generating ...")
        self._start_worker("generate", self._generate_worker, stream)

    def _read_options(self) -> dict | None:
        options = {}
        for key, label, parse, _ in PARAMETERS:
            text = self.params[key].get().strip()
            if key == "seed" and not text:
                options[key] = None
                continue
            try:
                options[key] = parse(text)
            except ValueError:
                self._set_error(f"{label} must be {'an integer' if parse is int else 'a number'}, got {text!r}.")
                return None
        return options

    def stop_generation(self) -> None:
        if self.is_generating and not self._cancel.is_set():
            self._cancel.set()
            self._set_status("Stopping ...")

    def close(self) -> None:
        self._cancel.set()  # the worker is a daemon thread; this only spares it the remaining steps
        self.root.after_cancel(self._poll_id)
        self.root.destroy()

    # ---- the worker thread: never touches Tk, only self._messages ------------------------------

    def _start_worker(self, job: str, target, argument) -> None:
        self._job = job
        self._update_buttons()
        threading.Thread(target=self._run_worker, args=(target, argument), daemon=True, name=f"edgelm-{job}").start()

    def _run_worker(self, target, argument) -> None:
        try:
            target(argument)
        except EdgelmError as e:
            self._messages.put(("error", str(e)))
        except Exception as e:  # a bug or an onnxruntime failure: show it rather than stay "busy" forever
            self._messages.put(("error", f"{type(e).__name__}: {e}"))

    def _load_worker(self, path: str) -> None:
        model = load(path, provider=self.provider, threads=self.threads)
        self._messages.put(("loaded", model))

    def _generate_worker(self, stream) -> None:
        # the stream computes token n+1 only after piece n was taken, so this loop paces generation
        for piece in stream:
            self._messages.put(("piece", piece))
        self._messages.put(("done", stream.result))

    # ---- the UI thread: drains the queue -------------------------------------------------------

    def _poll(self) -> None:
        parts: list[tuple[str, str]] = []  # (text, tag) runs: reasoning, content, tool call lines
        while True:
            try:
                kind, value = self._messages.get_nowait()
            except queue.Empty:
                break
            if kind == "piece":
                parts += piece_parts(value)
                continue
            self._append_parts(parts)  # keep the text in order with the message that follows it
            parts = []
            self._finish(kind, value)
        self._append_parts(parts)
        self._poll_id = self.root.after(POLL_MS, self._poll)

    def _finish(self, kind: str, value) -> None:
        self._job = None
        self._update_buttons()
        if kind == "loaded":
            self.model = value
            info = value.info()
            self._show_adapters(value.lora_slots is not None)
            for path in self.start_adapters if value.lora_slots is not None else ():
                self.load_adapter(path)
            try:
                self.conversation = value.conversation(
                    system=self.system_prompt.get().strip() or None,
                    tools=self.tools,
                    template_vars=self.template_vars or None,
                )
                sampling, origin = model_chat_sampling(value)
                for key, number in sampling.items():
                    self.params[key].set(f"{number:g}")
                mode = f"chat, sampling from {origin}"
            except EdgelmError:  # no chat template: text completion, as for a base model
                self.conversation, mode = None, "completion (the package has no chat template)"
            self.pending_calls, self._tool_results = [], []
            self.thinking_box.configure(state="normal" if self.reads_thinking else "disabled")
            self._clear_history()
            self._set_status(
                f"Loaded {info['package']}: {info['layers']} layers, {info['precision']}, "
                f"context {info['context_length']}, on {value.device}; {mode}."
            )
        elif kind == "done":
            self.last_result = value
            if self.conversation is not None:
                self._append("\n\n")
            timings, turn = value.timings, getattr(self.conversation, "last_turn", None)
            cached = f", reused {turn.reused_tokens} cached tokens" if turn is not None else ""
            if turn is not None and turn.adapter_switched:
                cached = f", adapter {turn.adapter or BASE_ADAPTER}: the whole chat prefilled again"
            self._set_status(
                f"{timings.new_tokens} tokens, {timings.decode_tokens_per_s:.1f} tokens/s, first token "
                f"{timings.time_to_first_token_s * 1000:.0f} ms{cached}, finish: {value.finish_reason}"
            )
            if self.conversation is not None and value.tool_calls:
                self.pending_calls = list(value.tool_calls)
                self._set_status(f"Type the result of {tool_call_line(self.pending_calls[0])} and Send.")
        else:
            self._set_error(value)

    def _append(self, text: str, *tags: str) -> None:
        if not text:
            return
        self.history.configure(state="normal")
        self.history.insert("end", text, tags)
        self.history.configure(state="disabled")
        self.history.see("end")

    def _append_parts(self, parts: list[tuple[str, str]]) -> None:
        """Runs of one tag joined, so a fast stream is a few inserts per poll."""
        for tag, run in itertools.groupby(parts, key=lambda part: part[1]):
            self._append("".join(text for text, _ in run), *((tag,) if tag else ()))

    def _clear_history(self) -> None:
        self.history.configure(state="normal")
        self.history.delete("1.0", "end")
        self.history.configure(state="disabled")

    def _update_buttons(self) -> None:
        idle = "disabled" if self.is_busy else "normal"
        for button in (self.load_button, self.send_button, self.new_chat_button, self.tools_button):
            button.configure(state=idle)
        self.stop_button.configure(state="normal" if self.is_generating else "disabled")

    def _set_status(self, text: str) -> None:
        self._status.set(text)
        self.status_label.configure(foreground="")

    def _set_error(self, text: str) -> None:
        self._status.set(f"Error: {text}")
        self.status_label.configure(foreground="red3")


def main() -> None:
    parser = argparse.ArgumentParser(description="Chat (or text completion) with an edgelm model package.")
    parser.add_argument("--package", help="model package folder to load at start")
    parser.add_argument("--provider", choices=["cpu", "cuda", "auto"], default="auto")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: ONNX Runtime's)")
    parser.add_argument("--adapter", action="append", default=[], help="a LoRA .onnx_adapter to load (repeatable)")
    add_chat_inputs(parser)  # --tools FILE and --template-var KEY=VALUE, as edgelm chat takes them
    args = parser.parse_args()
    inputs = chat_inputs(args)
    try:
        template_variables(inputs["tools"], template_vars=inputs["template_vars"])  # bad specs: one line, exit 2
    except EdgelmError as e:
        parser.error(str(e))
    root = tk.Tk()
    root.geometry("900x650")
    ChatApp(
        root,
        args.package,
        provider=args.provider,
        threads=args.threads,
        adapters=tuple(args.adapter),
        tools=inputs["tools"],
        template_vars=inputs["template_vars"],
    )
    root.mainloop()


if __name__ == "__main__":
    main()
