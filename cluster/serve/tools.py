"""Tool calling: tools into the prompt, tool_choice into a constraint, and the model's calls out of its text.

Two formats, picked from the chat template: Hermes/Qwen (``<tool_call>{"name": ..., "arguments": ...}
</tool_call>``, also used for templates that know no tools, whose prompt then gets a Hermes system
message) and Llama 3 (a bare ``{"name": ..., "parameters": ...}`` object, the template renders the tools).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from cluster.serve.protocol import (
    ChatMessage, FunctionCall, StreamedFunctionCall, StreamedToolCall, Tool, ToolCall, bad_request,
)
from scheduler import StructuredOutputsParams

START, END = "<tool_call>", "</tool_call>"
HERMES, LLAMA3 = "hermes", "llama3"

HERMES_SYSTEM = (
    "You may call one or more functions to assist with the user query. The functions are described in "
    "<tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return a JSON object with "
    "the function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCalling:
    """One chat request's tools: how its prompt shows them, what its output must be, how calls are read back.

    ``fmt`` is HERMES or LLAMA3; ``native`` says the chat template renders
    ``tools`` itself; ``only_one`` is ``parallel_tool_calls=false`` (calls past
    the first are not returned). ``forced`` names the tools a call must use
    (``required``: all; a named function: that one), enforced by a grammar so
    that the output always parses; empty under ``auto``.
    """

    tools: list[Tool]
    fmt: str
    native: bool
    only_one: bool
    forced: list[Tool] = field(default_factory=list)

    @classmethod
    def from_request(cls, tools: list[Tool] | None, tool_choice: Any, parallel_tool_calls: bool | None,
                     chat_template: str | None) -> ToolCalling | None:
        """None when no tool may be called (no tools, or tool_choice "none"); a 400 for a choice naming no tool."""
        if not tools:
            if tool_choice not in (None, "none"):
                raise bad_request("tool_choice needs tools", "tool_choice")
            return None
        if tool_choice == "none":
            return None
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise bad_request(f"tools: two tools share a name ({names})", "tools")
        forced = []
        if tool_choice == "required":
            forced = tools
        elif tool_choice not in (None, "auto"):
            name = tool_choice.function.name
            forced = [t for t in tools if t.function.name == name]
            if not forced:
                raise bad_request(f"tool_choice names the function {name!r}, which is not in tools ({names})",
                                  "tool_choice")
        template = chat_template or ""
        native = "tools" in template
        fmt = HERMES if START in template or not native else LLAMA3
        return cls(tools, fmt, native, parallel_tool_calls is False, forced)

    # ---- the prompt ----

    def template_messages(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        """The history as the chat template takes it. A template that knows no tools gets the Hermes system
        message and sees earlier calls and results as text."""
        out = [m.template_dict(native_tools=self.native) for m in messages]
        if self.native:
            return out
        system = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t.model_dump(exclude_none=True)) for t in self.tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = out[0] | {"content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
        return out

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.native else None

    # ---- the constraint ----

    def constraint(self) -> StructuredOutputsParams | None:
        """A grammar that admits only calls of the forced tools, their arguments held to their parameters."""
        if not self.forced:
            return None
        key = "arguments" if self.fmt == HERMES else "parameters"
        schema = {"anyOf": [{"type": "object", "properties": {
            "name": {"const": t.function.name},
            key: t.function.parameters or {"type": "object"}}, "required": ["name", key],
            "additionalProperties": False} for t in self.forced]}
        call = f"%json {json.dumps(schema)}"
        if self.fmt == HERMES:
            call = f'"{START}\\n" {call} "\\n{END}"'
        repeat = "" if self.only_one else f'("\\n" {call})*'
        return StructuredOutputsParams(grammar=f"start: {call} {repeat}")

    # ---- reading calls back ----

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output: its content (text outside calls; None when there is none) and its calls."""
        stream = ToolCallStream(self)
        content = stream.feed(text) + stream.finish()
        calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in stream.calls]
        return (content or None) if calls else content, calls


@dataclass(slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str


def _read_call(text: str, key: str) -> ParsedCall | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments", {}))
    return ParsedCall(new_call_id(), obj["name"], args if isinstance(args, str) else json.dumps(args))


class ToolCallStream:
    """One choice's text, split as it streams into content and tool calls.

    Invariants: content never holds any part of a call (text that may still
    become a ``<tool_call>`` tag is held back, and so is everything from a tag
    to its end tag, or for Llama 3 an output that starts with ``{``); each
    call is emitted once, complete, as soon as its end is seen. ``calls`` lists
    them in order.
    """

    def __init__(self, tools: ToolCalling) -> None:
        self.tools = tools
        self.held = ""
        self.calls: list[ParsedCall] = []
        self.new: list[ParsedCall] = []
        self.seen_text = False

    def feed(self, text: str) -> str:
        """The content ``text`` adds; calls it completes go to ``new`` (and ``calls``)."""
        if self.tools.fmt == LLAMA3:
            return self._feed_llama3(text)
        self.held += text
        out = []
        while True:
            start = self.held.find(START)
            if start < 0:
                keep = next((k for k in range(min(len(START) - 1, len(self.held)), 0, -1)
                             if self.held.endswith(START[:k])), 0)
                out.append(self.held[:len(self.held) - keep])
                self.held = self.held[len(self.held) - keep:]
                break
            out.append(self.held[:start])
            end = self.held.find(END, start)
            if end < 0:
                self.held = self.held[start:]
                break
            self._add(self.held[start + len(START):end], "arguments")
            self.held = self.held[end + len(END):]
        content = "".join(out)
        return content.strip("\n") if self.calls else content

    def _feed_llama3(self, text: str) -> str:
        if not self.seen_text:
            self.held += text
            stripped = self.held.lstrip().removeprefix("<|python_tag|>").lstrip()
            if not stripped:
                return ""
            self.seen_text = True
            if stripped.startswith("{"):
                return ""
            text, self.held = self.held, ""
            return text
        if self.held:
            self.held += text
            return ""
        return text

    def _add(self, body: str, key: str) -> bool:
        call = _read_call(body.strip(), key)
        if call is None or (self.tools.only_one and self.calls):
            return False
        self.calls.append(call)
        self.new.append(call)
        return True

    def finish(self) -> str:
        """At the end: a call left open (or a Llama 3 object) is a call if it parses, else content."""
        held, self.held = self.held, ""
        if not held:
            return ""
        if self.tools.fmt == LLAMA3:
            body = held.lstrip().removeprefix("<|python_tag|>")
            parts = [p for p in body.split(";") if p.strip()]
            if parts and all(self._add(p, "parameters") for p in parts[:1 if self.tools.only_one else None]):
                return ""
            return held
        if held.startswith(START) and self._add(held[len(START):], "arguments"):
            return ""
        return held

    def take_new(self) -> list[StreamedToolCall]:
        """The calls completed since the last take, as OpenAI streams them: id and name, then the arguments."""
        out = []
        first = len(self.calls) - len(self.new)
        for i, c in enumerate(self.new, first):
            out.append(StreamedToolCall(index=i, id=c.id, type="function",
                                        function=StreamedFunctionCall(name=c.name, arguments="")))
            out.append(StreamedToolCall(index=i, function=StreamedFunctionCall(arguments=c.arguments)))
        self.new = []
        return out
