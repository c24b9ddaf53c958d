"""Tool calling: tools into the prompt, tool_choice into a constraint, and the model's calls out of its text.

Two formats, picked from the chat template: Hermes/Qwen (``<tool_call>{"name": ..., "arguments": ...}
</tool_call>``, also used for templates that know no tools, whose prompt then gets a Hermes system
message) and Llama 3 (a bare ``{"name": ..., "parameters": ...}`` object, the template renders the tools).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.client import closed_schema
from scheduler import StructuredOutputsParams
from serve.protocol.chat import (
    ChatMessage,
    FunctionCall,
    StreamedFunctionCall,
    StreamedToolCall,
    Tool,
    ToolCall,
)
from serve.protocol.parsing import bad_request

START, END = "<tool_call>", "</tool_call>"
HERMES, LLAMA3 = "hermes", "llama3"

HERMES_SYSTEM = (
    "You may call one or more functions to assist with the user query. The functions are described in "
    "<tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return a JSON object with "
    "the function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCalling:
    """One chat request's tools: how its prompt shows them, what its output must be, how calls are read back.

    ``fmt`` is HERMES or LLAMA3; ``native`` says the chat template renders
    ``tools`` itself; ``only_one`` is ``parallel_tool_calls=false`` or a named
    ``tool_choice`` (one call of that function, as OpenAI and vLLM answer it: a
    grammar that admitted more let a small model repeat the call until
    max_tokens); calls past the first are not returned. ``forced`` names the
    tools a call must use (``required``: all; a named function: that one),
    enforced by a grammar so that the output always parses; empty under ``auto``.
    """

    tools: list[Tool]
    fmt: str
    native: bool
    only_one: bool
    forced: list[Tool] = field(default_factory=list)

    @classmethod
    def from_request(
        cls, tools: list[Tool] | None, tool_choice: Any, parallel_tool_calls: bool | None, chat_template: str | None
    ) -> ToolCalling | None:
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
                raise bad_request(
                    f"tool_choice names the function {name!r}, which is not in tools ({names})", "tool_choice"
                )
        template = chat_template or ""
        native = "tools" in template
        fmt = HERMES if START in template or not native else LLAMA3
        named = tool_choice not in (None, "auto", "required")
        return cls(tools, fmt, native, parallel_tool_calls is False or named, forced)

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

    def constraint(self, close_objects: bool = True) -> StructuredOutputsParams | None:
        """A grammar that admits only calls of the forced tools, their arguments held to their parameters (their
        objects closed as response_format's are, unless ``close_objects`` is off). Each tool's call is its own JSON
        document, its parameters' ``$defs`` at that document's root, where their ``#/$defs/...`` refs point."""
        if not self.forced:
            return None
        key = "arguments" if self.fmt == HERMES else "parameters"
        docs = []
        for t in self.forced:
            params = dict(closed_schema(t.function.parameters, close_objects) or {"type": "object"})
            defs = {k: params.pop(k) for k in ("$defs", "definitions") if k in params}
            docs.append(
                defs
                | {
                    "type": "object",
                    "properties": {"name": {"const": t.function.name}, key: params},
                    "required": ["name", key],
                    "additionalProperties": False,
                }
            )
        call = "(" + " | ".join(f"%json {json.dumps(d)}" for d in docs) + ")"
        if self.fmt == HERMES:
            call = f'"{START}\\n" {call} "\\n{END}"'
        repeat = "" if self.only_one else f'("\\n" {call})*'
        return StructuredOutputsParams(grammar=f"start: {call} {repeat}")

    # ---- reading calls back ----

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output: its content (text outside calls; None when there is none) and its calls."""
        stream = ToolCallStream(self)
        content = stream.feed(text) + stream.finish()
        calls = [
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in stream.returned_calls()
        ]
        return (content.strip() or None) if calls else content, calls


@dataclass(slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str
    skipped: bool = False  # a call past the first under parallel_tool_calls=false: read, never returned


# The head of a Hermes call, up to where its arguments begin: what lets the arguments stream as they come.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def _read_call(text: str, key: str) -> ParsedCall | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments", {}))
    return ParsedCall(new_call_id(), obj["name"], args if isinstance(args, str) else json.dumps(args))


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


def _without_close(args: str) -> str:
    """Arguments text less a trailing ``}`` and whitespace: that brace may close the call's own object."""
    args = args.rstrip()
    return args[:-1].rstrip() if args.endswith("}") else args


class ToolCallStream:
    """One choice's text, split as it streams into content and tool calls.

    Invariants: content never holds any part of a call (text that may still
    become a ``<tool_call>`` tag is held back, and so is a Llama 3 output that
    starts with ``{``). A Hermes call streams as OpenAI's do: a delta with its
    id and name once its head (``{"name": ..., "arguments":``) is read, then
    deltas of its arguments' text as they come, holding back only what may be
    the call's closing brace or end tag; the arguments' deltas concatenate to
    ``calls[i].arguments``. A call whose head comes in another shape is
    parsed whole at its end tag. ``deltas`` are those not yet taken.
    """

    def __init__(self, tools: ToolCalling) -> None:
        self.tools = tools
        self.held = ""
        self.calls: list[ParsedCall] = []
        self.current: ParsedCall | None = None  # a call whose head was read and whose end tag was not
        self.in_tag = False  # inside <tool_call>, head not read yet
        self.deltas: list[StreamedToolCall] = []
        self.seen_text = False

    def feed(self, text: str) -> str:
        """The content ``text`` adds; what it adds to calls goes to ``deltas``."""
        if self.tools.fmt == LLAMA3:
            return self._feed_llama3(text)
        self.held += text
        out = []
        while self._step(out):
            pass
        return "".join(out)

    def _step(self, out: list[str]) -> bool:
        """Consume what ``held`` allows; True while there may be more to consume."""
        held = self.held
        if self.current is not None:
            end = held.find(END)
            if end < 0:
                body = held[: len(held) - _partial_suffix(held, END)]
                self._add_arguments(_without_close(body))
                self.held = held[len(_without_close(body)) :]
                return False
            self._add_arguments(_without_close(held[:end]))
            self.current, self.held = None, held[end + len(END) :]
            return True
        if self.in_tag:
            head, end = _HEAD.match(held), held.find(END)
            # A head is read once the arguments' first character is there: whitespace before it is not theirs.
            if head is not None and (head.end() < end if end >= 0 else head.end() < len(held)):
                self._open(json.loads(f'"{head.group(1)}"'), "")
                self.in_tag, self.held = False, held[head.end() :]
                return True
            if end < 0:
                return False
            call = _read_call(held[:end].strip(), "arguments")
            if call is None:
                out.append(START + held[: end + len(END)])
            else:
                self._open(call.name, call.arguments)
                self.current = None
            self.in_tag, self.held = False, held[end + len(END) :]
            return True
        start = held.find(START)
        if start < 0:
            keep = _partial_suffix(held, START)
            self._content(out, held[: len(held) - keep])
            self.held = held[len(held) - keep :]
            return False
        self._content(out, held[:start])
        self.in_tag, self.held = True, held[start + len(START) :]
        return True

    def _content(self, out: list[str], text: str) -> None:
        if text.strip() or not self.calls:  # not the newlines between and after calls
            out.append(text)

    def _open(self, name: str, arguments: str) -> None:
        call = ParsedCall(
            new_call_id(), name, "", skipped=self.tools.only_one and any(not c.skipped for c in self.calls)
        )
        self.calls.append(call)
        self.current = call
        if not call.skipped:
            self.deltas.append(
                StreamedToolCall(
                    index=self._index(call),
                    id=call.id,
                    type="function",
                    function=StreamedFunctionCall(name=name, arguments=""),
                )
            )
        self._add_arguments(arguments)

    def _index(self, call: ParsedCall) -> int:
        return [c for c in self.calls if not c.skipped].index(call)

    def _add_arguments(self, new: str) -> None:
        """``new`` continues the current call's arguments."""
        call = self.current
        if new:
            call.arguments += new
            if not call.skipped:
                self.deltas.append(
                    StreamedToolCall(index=self._index(call), function=StreamedFunctionCall(arguments=new))
                )

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

    def finish(self) -> str:
        """At the end: a call left open (or a Llama 3 object) is a call if it parses, else content."""
        held, self.held = self.held, ""
        if self.tools.fmt == LLAMA3:
            body = held.lstrip().removeprefix("<|python_tag|>")
            parsed = [_read_call(p, "parameters") for p in body.split(";") if p.strip()]
            if not parsed or None in parsed:
                return held
            for call in parsed[:1] if self.tools.only_one else parsed:
                self._open(call.name, call.arguments)
            return ""
        if self.current is not None:
            self._add_arguments(_without_close(held))
            return ""
        if self.in_tag:
            call = _read_call(held.strip(), "arguments")
            if call is None:
                return START + held
            self._open(call.name, call.arguments)
            return ""
        return held

    def returned_calls(self) -> list[ParsedCall]:
        return [c for c in self.calls if not c.skipped]

    def take_deltas(self) -> list[StreamedToolCall]:
        deltas, self.deltas = self.deltas, []
        return deltas
