"""The chat controller: turns user actions into store writes and engine requests, and back into signals.

No widgets here. The window calls send / stop / regenerate / edit_and_resend / continue_reply and
listens to the signals; the controller keeps the SQLite store in step with what is on screen:
- the user's message is committed before the request goes to the engine;
- the assistant's message is created (state "streaming") when the reply starts, its text is flushed
  every FLUSH_S while it streams and written with its final state and figures when it ends;
- a reply that fails keeps what had arrived and says why (state "error" or "stopped").

Tools (MCP, app.tools): when they are on and the model's template takes tools, the prompt lists them; a
reply holding tool calls ends its message with the calls stored on it (each waiting for the user's
Allow once / Always allow / Deny unless its tool is always allowed), allowed calls run off the GUI thread,
and once every call has its result the next reply starts by itself, up to the tool_max_rounds setting.
Stop cancels calls waiting or running; the calls keep what came of them.

While such a reply streams, the view gets its text through engine.tools.ToolCallStream (after
engine.reasoning has split the thinking off): call markup never shows; from the moment a call starts,
toolCallPending says so (the view shows a placeholder card) until the reply ends and the real cards come.
The store always gets the raw text (a crash keeps what the model wrote). Stop while a call is being written
keeps what arrived, the call's unfinished markup included: the reply ends "stopped" with that text shown as
it is (no call runs; Continue goes on writing it).

A message with images goes to the engine as a list of parts, its images first and then its text (as
Gemma 3's examples order them); a message without images stays a string.

Documents (engine.documents, attached in the composer) are stored with their user message; every reply
writes the chat's documents into the prompt (engine.document_context.with_documents): whole when they all
fit the context beside the conversation and the reply, else the chunks that best match the latest
question, counted in the model's own tokenizer. That choice runs in the bridge's thread (a `prepare` step:
counting, chunking and ranking a long document take a while); what went in comes back as `prepared`, is
kept in the reply's stats as "sources" and shown under it. Chunks are ranked by keywords and, when the
document_search setting finds an embedding model (search_model), by meaning too: the worker embeds them
(EngineClient.embed) and their vectors are cached in this process. Should that fail, the chunks are ranked
by keywords and the status bar says why (statusMessage); the reply goes on.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from app.chat_store import Chat, ChatStore, Message, MessageImage
from app.engine_bridge import EngineBridge
from app.qt import QObject, QTimer, Signal, Slot
from app.settings import SAMPLING_KEYS, SEARCH_AUTO, SEARCH_KEYWORDS, Settings, clean_overrides
from engine import tool_loop
from engine.client import ChatEvent
from engine.document_context import (
    cached_embed,
    document_budget,
    estimate_tokens,
    model_token_counter,
    with_documents,
)
from engine.documents import Document
from engine.generate import GenerationParams
from engine.reasoning import ReasoningStream, split_reasoning
from engine.tool_loop import ALLOW_ALWAYS, CANCELLED, DECLINED, DENY, CallOutcome
from engine.tools import ToolCallStream, parse_tool_calls

SPEC_KEYS = (
    "speculation",
    "drafted_tokens",
    "accepted_tokens",
    "acceptance_rate",
    "tokens_per_pass",
    "speedup_estimate",
    "draft_k",
)
EMBED_BATCH = 32  # document chunks a search-model request embeds (a progress step: Stop ends it between two)
FLUSH_S = 0.5  # the store is at most this far behind the screen while a reply streams
TITLE_CHARS = 48
STATS_KEYS = (
    "ttft_s",
    "generation_tps",
    "prompt_tps",
    "generated_tokens",
    "prompt_tokens",
    "cached_tokens",
    "context_after",
    "context_size",
)


def sampling_params(settings: Settings, overrides: dict | None = None) -> GenerationParams:
    """GenerationParams from the settings' sampling defaults and a chat's overrides."""
    values = {k: settings.get(k) for k in SAMPLING_KEYS}
    values.update({k: v for k, v in (overrides or {}).items() if k in SAMPLING_KEYS and v is not None})
    return GenerationParams(
        max_tokens=int(values["max_tokens"]),
        temperature=float(values["temperature"]),
        top_k=int(values["top_k"]),
        top_p=float(values["top_p"]),
        min_p=float(values["min_p"]),
        repetition_penalty=float(values["repetition_penalty"]),
        seed=overrides.get("seed") if overrides else None,
        stop=tuple((overrides or {}).get("stop") or ()),
    )


def speculation_options(settings: Settings):
    """The engine's SpeculationOptions for the speculation settings; None when off (or when this engine
    has no speculative decoding)."""
    mode = settings.get("speculation")
    if mode == "off":
        return None
    try:
        from engine.client import SpeculationOptions
    except ImportError:
        return None
    draft = settings.get("draft_model").strip() or None
    if mode == "draft" and draft is None:
        raise ValueError("Speculative decoding is set to 'draft' but no draft model is chosen (Settings).")
    return SpeculationOptions(mode=mode, draft_model=draft if mode == "draft" else None)


def template_vars(settings: Settings) -> dict:
    """Chat template variables the settings ask for: thinking off sets enable_thinking (Qwen3's switch)
    and a low reasoning_effort (gpt-oss, which always thinks: as briefly as it can); templates without
    them ignore the variables."""
    return {} if settings.get("thinking") else {"enable_thinking": False, "reasoning_effort": "low"}


def message_content(message: Message) -> str | list[dict]:
    """What the engine gets as a message's content: its text, or with images a list of parts (images,
    then the text unless it is empty)."""
    if not message.images:
        return message.content
    parts: list[dict] = [{"type": "image", "image": im.data} for im in message.images]
    if message.content:
        parts.append({"type": "text", "text": message.content})
    return parts


def chat_title(text: str, images: list[MessageImage], documents: list[Document] | None = None) -> str:
    """A new chat's title: the first message's first words; else the first document's name, or "Image"
    for a message of images only."""
    title = " ".join(text.split())[:TITLE_CHARS]
    if title:
        return title
    if documents:
        return documents[0].name[:TITLE_CHARS]
    if not images:
        return title
    return "Image" if len(images) == 1 else f"{len(images)} images"


def search_model(choice: str) -> tuple[str, str] | None:
    """The embedding model the document_search setting names, as (path, display name); None for keywords
    only. "auto": the first embedding model present in the library (None when there is none); otherwise the
    path itself (a missing one fails when it is used, and the reply falls back to keywords with a notice)."""
    if choice == SEARCH_KEYWORDS or not choice.strip():
        return None
    if choice == SEARCH_AUTO:
        from models.library import Library

        try:
            found = Library().embedding_models()
        except Exception:  # noqa: BLE001 - an unreadable library only means keywords
            return None
        if not found:
            return None
        choice = found[0].path
    return choice, model_display_name(choice)


def model_display_name(path: str) -> str:
    """A model's short name: its file name without .gguf, or its folder's name."""
    return Path(path).name.removesuffix(".gguf")


def _add_documents(
    documents: list[list[Document]],
    n_ctx: int,
    max_tokens: int,
    model_path: str,
    conversation: list[dict],
    search: str = SEARCH_KEYWORDS,
    client=None,
    report=None,
):
    """The conversation with its documents written in, and what the reply shows of them (a bridge `prepare`
    step): {"sources": Selection.sources(), "notice": why the search model was not used, or ""}.
    Tokens are counted with the model's tokenizer (read from its file here), else estimated; chunks are
    ranked with the `search` setting's embedding model through `client` (engine.client.EngineClient), the
    chunks not embedded before EMBED_BATCH at a time with report(done, total) between batches (the bridge's:
    it raises once the reply is stopped, which ends the embedding, the batches done kept)."""
    count = model_token_counter(model_path) if model_path else None
    other = sum(_content_tokens(m.get("content"), count) + 8 for m in conversation)  # 8: a turn's template
    budget = document_budget(n_ctx, max_tokens, other)
    embed, name = None, ""
    found = search_model(search) if client is not None else None
    if found is not None:
        path, name = found

        def embed_remote(texts, task):
            return client.embed(path, texts, task=task, truncate=True)

        embed = cached_embed(embed_remote, path, batch=EMBED_BATCH, report=report)
    conversation, selection = with_documents(conversation, documents, budget, count, embed, name)
    return conversation, {"sources": selection.sources(), "notice": selection.notice}


def _content_tokens(content, count=None) -> int:
    """A message's tokens (its text; an image's tokens are the engine's business)."""
    count = count or estimate_tokens
    if isinstance(content, str):
        return count(content)
    if isinstance(content, list):
        return sum(count(p.get("text", "")) for p in content if isinstance(p, dict))
    return 0


def event_stats(event: ChatEvent | None) -> dict:
    """The figures of a reply kept with its message (and speculative counters when the engine sends them)."""
    if event is None:
        return {}
    data = asdict(event) if hasattr(event, "__dataclass_fields__") else dict(vars(event))
    keep = {k: data[k] for k in STATS_KEYS if k in data}
    keep.update({k: data[k] for k in SPEC_KEYS if data.get(k)})
    return keep


class ChatController(QObject):
    """One window's chats.

    Signals:
        chatsChanged(): the chat list changed (new, renamed, deleted, reordered).
        chatOpened(chat_id: str): the current chat changed; the view reloads its messages.
        messageAdded(message: Message): a message was appended to the current chat.
        messageText(message_id: int, text: str): the streaming message's whole text so far (with tools,
            without the markup of the calls it is writing).
        messageDone(message: Message): a reply ended (state done, stopped or error).
        busyChanged(busy: bool): a reply started or ended.
        replyEvent(event: ChatEvent): the latest engine event of the reply (for the status bar).
        notice(text: str): something to tell the user in the chat (engine crash, errors).
        toolCallsChanged(message: Message, waiting: bool): a message's tool calls changed (new, decided, ran,
            stopped); waiting: they are under way (calls without a decision ask for one).
        toolCallPending(message_id: int, pending: bool, name: str): the streaming reply started writing a tool
            call (its text is held back; name: the tool, once it has arrived, else ""), or no longer is (the
            reply ended, or it was no call after all).
        sourcesChanged(message: Message): the streaming reply's documents were chosen (stats["sources"]).
        statusMessage(text: str): a passing note for the status bar (the document search fell back to
            keywords).
    """

    chatsChanged = Signal()
    chatOpened = Signal(str)
    messageAdded = Signal(object)
    messageText = Signal(int, str)
    messageDone = Signal(object)
    busyChanged = Signal(bool)
    replyEvent = Signal(object)
    notice = Signal(str)
    toolCallsChanged = Signal(object, bool)
    toolCallPending = Signal(int, bool, str)
    sourcesChanged = Signal(object)
    statusMessage = Signal(str)

    def __init__(
        self,
        store: ChatStore,
        bridge: EngineBridge,
        settings: Settings,
        parent: QObject | None = None,
        tools=None,
    ):
        super().__init__(parent)
        self.store = store
        self.bridge = bridge
        self.settings = settings
        self.chat: Chat | None = None
        self.busy = False
        self._turn = 0
        self._reply: Message | None = None
        self._text = ""
        self._flushed_text = ""
        self._last_event: ChatEvent | None = None
        self._sources: list[dict] = []  # what of the chat's documents the reply in progress got
        self._flush_timer = QTimer(self)
        self._flush_timer.setInterval(int(FLUSH_S * 1000))
        self._flush_timer.timeout.connect(self.flush)
        bridge.chunk.connect(self._on_chunk)
        bridge.progress.connect(self._on_progress)
        bridge.finished.connect(self._on_finished)
        bridge.failed.connect(self._on_failed)
        bridge.prepared.connect(self._on_prepared)
        bridge.preparing.connect(self._on_preparing)
        # tool use: the app's ToolManager (None: no tools), the message whose calls are under way
        self.tools = tools
        self._tool_message: Message | None = None
        self._outcomes: list[CallOutcome] = []
        self._futures: dict[str, object] = {}
        self._advancing = False
        # the streaming reply's text as shown, with tools: its answer through a tool-call gate
        self._gate: ToolCallStream | None = None
        self._thinking: ReasoningStream | None = None
        self._answer_len = 0  # characters of self._text that are the answer fed to the gate
        self._shown = ""  # what the gate let through
        self._displayed = ""
        self._pending_call: tuple[bool, str] = (False, "")
        if tools is not None:
            tools.callDone.connect(self._on_call_done)

    # ---- chats
    def new_chat(self) -> Chat:
        """Create and open an empty chat."""
        chat = self.store.create_chat(model=self.bridge.model.name if self.bridge.model else None)
        self.open_chat(chat.id)
        self.chatsChanged.emit()
        return chat

    def open_chat(self, chat_id: str) -> None:
        """Make `chat_id` the current chat (refused while a reply streams into another)."""
        if self.busy and self.chat and chat_id != self.chat.id:
            self.stop()
        self.chat = self.store.get_chat(chat_id)
        self.chatOpened.emit(chat_id)

    def rename_chat(self, chat_id: str, title: str) -> None:
        title = title.strip()
        if title:
            self.store.update_chat(chat_id, title=title)
            if self.chat and self.chat.id == chat_id:
                self.chat.title = title
            self.chatsChanged.emit()

    def delete_chat(self, chat_id: str) -> None:
        """Delete (undoable with undo_delete until the app restarts)."""
        if self.chat and self.chat.id == chat_id:
            if self.busy:
                self.stop()
            self.chat = None
            self.chatOpened.emit("")
        self.store.delete_chat(chat_id)
        self.chatsChanged.emit()

    def undo_delete(self, chat_id: str) -> None:
        self.store.undo_delete(chat_id)
        self.chatsChanged.emit()
        self.open_chat(chat_id)

    def set_chat_options(self, system_prompt: str, overrides: dict) -> None:
        """The current chat's system prompt and sampling overrides."""
        if self.chat is None:
            self.new_chat()
        assert self.chat is not None
        clean = clean_overrides(overrides)
        self.store.update_chat(self.chat.id, system_prompt=system_prompt, overrides=clean)
        self.chat.system_prompt, self.chat.overrides = system_prompt, clean

    def start_preset_chat(self, system_prompt: str, overrides: dict, opening: list[dict]) -> Chat:
        """A chat set up by a preset: the current chat when it has no messages yet, else a new one, with the
        preset's system prompt, overrides and opening messages ({role, content}: the conversation the preset
        starts every chat with, stored as the chat's first messages)."""
        if self.chat is None or self.messages() or self.busy:
            self.new_chat()
        assert self.chat is not None
        self.set_chat_options(system_prompt, overrides)
        for m in opening:
            self.store.add_message(self.chat.id, m["role"], m["content"])
        self.open_chat(self.chat.id)
        return self.chat

    def messages(self) -> list[Message]:
        return self.store.messages(self.chat.id) if self.chat else []

    # ---- turns
    def send(
        self, text: str, images: list[MessageImage] | None = None, documents: list[Document] | None = None
    ) -> bool:
        """Store the user's message (text, images, documents) and request a reply. False if not sent (empty,
        busy, no model, or images for a model that reads none: the notice says so)."""
        text = text.strip()
        images = list(images or [])
        documents = list(documents or [])
        if not (text or images or documents) or self.busy:
            return False
        if self.bridge.model is None:
            self.notice.emit("No model is loaded yet: pick one above (or wait for the load to finish).")
            return False
        if images and not self.bridge.model.vision:
            self.notice.emit(
                f"{self.bridge.model.name} does not read images: load a vision model, or remove the images "
                "(×) to send the text alone."
            )
            return False
        if self.chat is None:
            self.new_chat()
        assert self.chat is not None
        first = not self.store.messages(self.chat.id)
        msg = self.store.add_message(self.chat.id, "user", text, images=images, documents=documents)
        if first:
            title = chat_title(text, images, documents)
            self.store.update_chat(self.chat.id, title=title)
            self.chat.title = title
        self.messageAdded.emit(msg)
        self.chatsChanged.emit()
        self._start_reply()
        if self.tools is not None and self.tools.active and not self.bridge.model.tool_format:
            name = self.bridge.model.name
            self.notice.emit(f"{name}'s chat template takes no tools: it replies without them.")
        return True

    def regenerate(self) -> bool:
        """Replace the last assistant reply with a new one."""
        msgs = self.messages()
        if self.busy or not msgs or self.bridge.model is None:
            return False
        if msgs[-1].role == "assistant":
            first = len(msgs) - 1  # the turn's first reply: a reply that called tools is followed by more
            while first > 0 and msgs[first - 1].role == "assistant" and msgs[first - 1].tool_calls:
                first -= 1
            self.store.delete_from(self.chat.id, msgs[first].position)
            self.chatOpened.emit(self.chat.id)
        if not self.messages() or self.messages()[-1].role != "user":
            return False
        self._start_reply()
        return True

    def edit_and_resend(self, message_id: int, text: str) -> bool:
        """Replace a user message's text (its images stay) and drop everything after it, then ask for a
        reply."""
        text = text.strip()
        msgs = self.messages()
        target = next((m for m in msgs if m.id == message_id), None)
        if self.busy or target is None or target.role != "user" or self.bridge.model is None:
            return False
        if not (text or target.images or target.documents):
            return False
        self.store.delete_from(self.chat.id, target.position)
        self.store.add_message(self.chat.id, "user", text, images=target.images, documents=target.documents)
        self.chatOpened.emit(self.chat.id)
        self._start_reply()
        return True

    def continue_reply(self) -> bool:
        """Let the model go on writing the last assistant reply (after a stop or the length limit)."""
        msgs = self.messages()
        if self.busy or not msgs or msgs[-1].role != "assistant" or self.bridge.model is None:
            return False
        if msgs[-1].tool_calls:  # its calls ended it: the next reply, not more of this one (Regenerate, Send)
            return False
        self._start_reply(resume=msgs[-1])
        return True

    def stop(self) -> None:
        """Stop the reply in progress (what arrived is kept), or the tool calls waiting or running."""
        if self._tool_message is not None:
            self._stop_tools()
        elif self.busy:
            self.bridge.cancel()

    def _conversation(self, resume: Message | None) -> tuple[list[dict], int, list[list[Document]]]:
        """The messages for the engine, how many of the chat's images were left out of them, and the
        documents of each message (written in later, off the GUI thread: _add_documents)."""
        conv: list[dict] = []
        docs: list[list[Document]] = []  # per entry of conv
        if self.chat and self.chat.system_prompt.strip():
            conv.append({"role": "system", "content": self.chat.system_prompt})
        # earlier images in a chat now on a model that reads none are left out, with a notice, so the chat
        # goes on (send() refuses new images for such a model)
        vision = self.bridge.model is None or self.bridge.model.vision
        left_out = 0
        for m in self.messages():
            docs += [[]] * (len(conv) - len(docs))
            if m.role == "assistant" and m.tool_calls:
                conv += tool_loop.history_messages(m.content, m.tool_calls)
                continue
            if m.state == "error" and not m.content or (m.role == "assistant" and not m.content):
                continue
            if m.images and not vision:
                left_out += len(m.images)
                if not (m.content or m.documents):
                    continue
                conv.append({"role": m.role, "content": m.content})
            else:
                conv.append({"role": m.role, "content": message_content(m)})
            docs.append(list(m.documents))
        docs += [[]] * (len(conv) - len(docs))
        if resume is not None and conv and conv[-1]["role"] == "assistant":
            conv[-1]["continue"] = True
        return conv, left_out, docs


    def _start_reply(self, resume: Message | None = None) -> None:
        assert self.chat is not None
        conversation, left_out, docs = self._conversation(resume)
        self._turn += 1
        self._sources = []
        params = sampling_params(self.settings, self.chat.overrides)
        prepare = None
        if any(docs):  # counting, chunking and ranking a long document take a while: in the bridge's thread
            model = self.bridge.model
            n_ctx, path = (model.n_ctx, model.path) if model else (4096, "")
            search, client = self.settings.get("document_search"), self.bridge.client

            def prepare(conversation, report):
                return _add_documents(docs, n_ctx, params.max_tokens, path, conversation, search=search,
                                      client=client, report=report)
        if resume is None:
            self._reply = self.store.add_message(self.chat.id, "assistant", "", state="streaming")
            self._text = ""
            self.messageAdded.emit(self._reply)
        else:
            self._reply = resume
            self._text = resume.content
            self.store.update_message(resume.id, state="streaming")
        self._flushed_text = self._text
        self._last_event = None
        tools_on = self._tools_on()
        self._gate = ToolCallStream(self.bridge.model.tool_format) if tools_on else None
        self._thinking = ReasoningStream() if tools_on else None  # a stored reply spells its block out
        self._answer_len, self._shown, self._pending_call = 0, "", (False, "")
        self._displayed = self._display(self._text)  # a continued reply's text so far
        if left_out:  # after the reply's message is shown, which clears older notices
            self.notice.emit(
                f"{self.bridge.model.name} does not read images: the chat's {left_out} image(s) are left "
                "out of this reply (load a vision model to use them)."
            )
        self._set_busy(True)
        self._flush_timer.start()
        try:
            speculation = speculation_options(self.settings)
        except ValueError as e:
            self.notice.emit(str(e))
            speculation = None
        variables = template_vars(self.settings)
        if tools_on:
            variables["tools"] = [t.schema() for t in self.tools.tools()]
        self.bridge.generate(
            self._turn, conversation, params, self.chat.id, self.settings.get("context_policy"), speculation,
            template_vars=variables, prepare=prepare,
        )

    # ---- tools
    def _tools_on(self) -> bool:
        """Tools go with this reply: they are on, servers are up, and the model's template takes tools."""
        model = self.bridge.model
        return self.tools is not None and self.tools.active and bool(model and model.tool_format)

    def _take_calls(self, reply: Message) -> bool:
        """When the finished `reply` holds tool calls: store them on it (its text without them), show them,
        run the always-allowed ones and wait for the user's decision on the rest. False when it holds none."""
        if not self._tools_on() or self._text.strip() == "":
            return False
        split = split_reasoning(self._text)
        rest, calls = parse_tool_calls(split.answer, self.bridge.model.tool_format)
        if not calls:
            return False
        head = self._text[: len(self._text) - len(split.answer)] if split.thinking is not None else ""
        self._text = head + rest
        self._tool_message = reply
        self._outcomes = [CallOutcome(c) for c in calls]
        self._futures = {}
        for outcome in self._outcomes:
            if outcome.call.name in self.tools.always:
                outcome.decision = ALLOW_ALWAYS
        return True

    def decide(self, message_id: int, call_id: str, decision: str) -> None:
        """The user's answer to a tool call's card: tool_loop.ALLOW_ONCE, ALLOW_ALWAYS or DENY."""
        if self._tool_message is None or self._tool_message.id != message_id:
            return
        outcome = next((o for o in self._outcomes if o.call.id == call_id), None)
        if outcome is None or outcome.decision:
            return
        outcome.decision = decision
        if decision == ALLOW_ALWAYS:
            self.tools.always.add(outcome.call.name)
            for other in self._outcomes:  # the same tool's other calls of this reply go too
                if other.call.name == outcome.call.name and not other.decision:
                    other.decision = ALLOW_ALWAYS
        self._advance_tools()

    def _advance_tools(self) -> None:
        """Run what is allowed and not yet running, answer denials, store, and go on once all are done."""
        if self._advancing:  # a call that failed at once reports while it is being started
            return
        self._advancing = True
        try:
            for outcome in self._outcomes:
                if outcome.done or outcome.call.id in self._futures or not outcome.decision:
                    continue
                if outcome.decision == DENY:
                    outcome.result, outcome.is_error, outcome.done = DECLINED, True, True
                else:
                    self._futures[outcome.call.id] = self.tools.call(outcome)
        finally:
            self._advancing = False
        self._save_tools()
        if all(o.done for o in self._outcomes):
            self._tools_finished()

    def _save_tools(self, waiting: bool = True) -> None:
        message = self._tool_message
        message.tool_calls = [o.to_dict() for o in self._outcomes]
        self.store.update_message(message.id, tool_calls=message.tool_calls)
        self.toolCallsChanged.emit(message, waiting)

    @Slot(object, str, bool)
    def _on_call_done(self, outcome: CallOutcome, result: str, is_error: bool) -> None:
        if self._tool_message is None or outcome not in self._outcomes or outcome.done:
            return  # stopped meanwhile (the outcome says cancelled), or from a reply that is over
        outcome.result, outcome.is_error, outcome.done = result, is_error, True
        if not self._advancing:  # else (a call that failed at once) _advance_tools goes on after its loop
            self._advance_tools()

    def _tools_finished(self) -> None:
        """Every call of the reply has its result: the next reply starts, unless the rounds are used up."""
        self._tool_message, self._outcomes, self._futures = None, [], {}
        msgs = self.messages()
        rounds = 0
        for m in reversed(msgs):
            if m.role != "assistant" or not m.tool_calls:
                break
            rounds += 1
        limit = int(self.settings.get("tool_max_rounds"))
        if rounds >= limit:
            self._set_busy(False)
            self.notice.emit(tool_loop.rounds_notice(limit))
            return
        self._start_reply()

    def _stop_tools(self) -> None:
        """Stop: calls running are cancelled, undecided ones dropped; the reply ends "stopped"."""
        message = self._tool_message
        for future in self._futures.values():
            future.cancel()
        for outcome in self._outcomes:
            if not outcome.done:
                outcome.result, outcome.is_error = CANCELLED, True
        self._save_tools(waiting=False)
        self._tool_message, self._outcomes, self._futures = None, [], {}
        message.state = "stopped"
        self.store.update_message(message.id, state="stopped")
        self.messageDone.emit(message)
        self._set_busy(False)

    def _set_busy(self, busy: bool) -> None:
        if busy != self.busy:
            self.busy = busy
            self.busyChanged.emit(busy)

    @Slot()
    def flush(self) -> None:
        """Write the streaming reply's text to the store if it changed since the last write."""
        if self._reply is not None and self._text != self._flushed_text:
            self.store.update_message(self._reply.id, content=self._text)
            self._flushed_text = self._text

    def _display(self, delta: str) -> str:
        """The streaming reply's text as the view shows it, after `delta` (already in self._text) arrived:
        without tools, all of it; with tools, its thinking as it is and its answer as far as the gate lets
        it through (no call markup). Tells toolCallPending when a call starts or turns out to be none."""
        if self._gate is None:
            return self._text
        _, answer = self._thinking.feed(delta)
        self._answer_len += len(answer)  # the answer is the end of the text (engine.reasoning passes it on)
        self._shown += self._gate.feed(answer)
        self._set_pending(self._gate.pending, self._gate.pending_name)
        return self._text[: len(self._text) - self._answer_len] + self._shown

    def _set_pending(self, pending: bool, name: str = "") -> None:
        if (pending, name) != self._pending_call and self._reply is not None:
            self._pending_call = (pending, name)
            self.toolCallPending.emit(self._reply.id, pending, name)

    @Slot(int, str, object)
    def _on_chunk(self, turn: int, text: str, event: ChatEvent) -> None:
        if turn != self._turn or self._reply is None:
            return
        self._text += text
        self._last_event = event
        shown = self._display(text)
        if shown != self._displayed:  # a call being written changes nothing on screen
            self._displayed = shown
            self.messageText.emit(self._reply.id, shown)
        self.replyEvent.emit(event)

    @Slot(int, object)
    def _on_prepared(self, turn: int, info: dict) -> None:
        """The reply's documents were chosen: kept with it (and written now, should the app die) and shown."""
        if turn != self._turn or self._reply is None:
            return
        sources = info["sources"]
        if info.get("notice"):
            self.statusMessage.emit(info["notice"][:1].upper() + info["notice"][1:])
        self._sources = sources
        self._reply.stats = {**self._reply.stats, "sources": sources}
        self.store.update_message(self._reply.id, stats=self._reply.stats)
        self.sourcesChanged.emit(self._reply)

    @Slot(int, int, int)
    def _on_preparing(self, turn: int, done: int, total: int) -> None:
        """The document search model reads the chat's documents (the first question about a long one)."""
        if turn == self._turn and self._reply is not None:
            self.statusMessage.emit(f"Reading the documents for the search: {done} of {total} parts")

    @Slot(int, object)
    def _on_progress(self, turn: int, event: ChatEvent) -> None:
        if turn == self._turn:
            self.replyEvent.emit(event)

    def _end(self, state: str, event: ChatEvent | None) -> Message | None:
        self._flush_timer.stop()
        self._set_pending(False)  # the placeholder goes: the real cards (or the text, stopped) replace it
        self._gate = self._thinking = None
        reply, self._reply = self._reply, None
        if reply is None:
            return None
        stats = event_stats(event or self._last_event)
        stats["finish_reason"] = event.finish_reason if event else state
        sources = self._sources or reply.stats.get("sources")
        if sources:
            stats["sources"] = sources
        calls = state == "done" and self._take_calls(reply)
        if calls:
            stats["finish_reason"] = "tool_calls"
        self.store.update_message(reply.id, content=self._text, state=state, stats=stats)
        self._flushed_text = self._text
        reply.content, reply.state, reply.stats, reply.updated_at = self._text, state, stats, time.time()
        if not calls:
            self._set_busy(False)
        self.messageDone.emit(reply)
        if calls:
            self._advance_tools()  # shows the cards; runs the always-allowed calls
        return reply

    @Slot(int, object)
    def _on_finished(self, turn: int, event: ChatEvent) -> None:
        if turn != self._turn:
            return
        state = "stopped" if event.finish_reason == "cancelled" else "done"
        self._end(state, event)
        self.replyEvent.emit(event)

    @Slot(int, str, bool)
    def _on_failed(self, turn: int, message: str, crashed: bool) -> None:
        if turn != self._turn:
            return
        self._end("error", None)
        if crashed:
            self.notice.emit(
                f"The engine stopped unexpectedly ({message}). It is restarting; your chat is safe."
            )
        else:
            self.notice.emit(message)
