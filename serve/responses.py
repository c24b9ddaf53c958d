"""One /v1/responses request's output: the chat generation's text turned into output items (a message, function
calls), as one Response or as the Responses API's stream of events."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from serve.generation import Generation
from serve.protocol.chat import ChatMessage, FunctionCall, StreamedToolCall, ToolCall
from serve.protocol.output import new_id, now
from serve.protocol.responses import (
    InputTokensDetails,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
    Response,
    ResponsesRequest,
    ResponseUsage,
)
from serve.tools import ToolCalling, ToolCallStream


@dataclass(slots=True)
class ResponsesRun:
    """Builds one request's Response and events. ``conversation`` is what its input adds to the stored history
    (the history included); ``store`` is called once with the final Response and the whole conversation, its
    output appended, when the request asked to be stored and finished without error.

    Stream invariants: events carry ``sequence_number`` 0, 1, ...; ``response.created`` and
    ``response.in_progress`` come first and ``response.completed`` (``response.incomplete`` when cut at
    max_output_tokens) last; each item is announced (``output_item.added``) before its deltas and closed
    (``..._done``, ``output_item.done``) before the next opens, so the deltas of an item concatenate to its final
    text or arguments. Whitespace between the content and a call opens no message.
    """

    req: ResponsesRequest
    model: str
    tools: ToolCalling | None
    conversation: list[ChatMessage]
    store: Callable[[Response, list[ChatMessage]], None]
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=now)
    items: list[OutputItem] = field(default_factory=list)
    open: OutputItem | None = None
    held: str = ""  # whitespace not yet known to belong to a message
    seq: int = 0

    def response(self, status: str, gen: Generation | None = None, reason: str | None = None) -> Response:
        req = self.req
        usage = None
        if gen is not None:
            u = gen.usage()
            usage = ResponseUsage(
                input_tokens=u.prompt_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=gen.num_cached_tokens),
                output_tokens=u.completion_tokens,
                total_tokens=u.total_tokens,
            )
        return Response(
            id=self.id,
            created_at=self.created_at,
            status=status,
            model=self.model,
            output=list(self.items),
            incomplete_details={"reason": "max_output_tokens"} if reason == "length" else None,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            previous_response_id=req.previous_response_id,
            reasoning=req.reasoning,
            store=req.store,
            temperature=req.temperature,
            text=req.text.model_dump(by_alias=True, exclude_none=True) if req.text else {"format": {"type": "text"}},
            tool_choice=(
                req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump") else req.tool_choice or "auto"
            ),
            tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
            top_p=req.top_p,
            usage=usage,
            metadata=req.metadata or {},
            user=req.user,
        )

    def finish(self, gen: Generation) -> Response:
        """The final Response; stored when asked."""
        reason = gen.samples[0].finish_reason
        response = self.response("incomplete" if reason == "length" else "completed", gen, reason)
        if self.req.store:
            calls = [
                ToolCall(id=c.call_id, function=FunctionCall(name=c.name, arguments=c.arguments))
                for c in self.items
                if isinstance(c, OutputFunctionCall)
            ]
            text = "".join(p.text for m in self.items if isinstance(m, OutputMessage) for p in m.content)
            reply = ChatMessage(role="assistant", content=text or None, tool_calls=calls or None)
            self.store(response, [*self.conversation, reply])
        return response

    # ---- whole ----

    async def collect(self, gen: Generation) -> Response:
        parts = []
        async with aclosing(gen.pieces()) as stream:
            async for pieces in stream:
                for p in pieces:
                    if p.finish_reason == "error":
                        raise p.error
                    parts.append(p.text)
        text = "".join(parts)
        content, calls = self.tools.parse(text) if self.tools else (text, [])
        status = "incomplete" if gen.samples[0].finish_reason == "length" else "completed"
        if content:
            self.items.append(OutputMessage(id=new_id("msg"), status=status, content=[OutputText(text=content)]))
        self.items += [
            OutputFunctionCall(
                id=new_id("fc"), call_id=c.id, name=c.function.name, arguments=c.function.arguments, status="completed"
            )
            for c in calls
        ]
        return self.finish(gen)

    # ---- streamed ----

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open.id, "output_index": len(self.items) - 1}

    def _open(self, item: OutputItem) -> list[str]:
        events = self._close()
        self.items.append(item)
        self.open = item
        events.append(self._event("response.output_item.added", output_index=len(self.items) - 1, item=_dump(item)))
        if isinstance(item, OutputMessage):
            part = OutputText(text="")
            item.content.append(part)
            events.append(
                self._event("response.content_part.added", content_index=0, part=_dump(part), **self._where())
            )
        return events

    def _close(self, status: str = "completed") -> list[str]:
        item, events = self.open, []
        if item is None:
            return events
        if isinstance(item, OutputMessage):
            part = item.content[0]
            events.append(
                self._event("response.output_text.done", content_index=0, text=part.text, logprobs=[], **self._where())
            )
            events.append(self._event("response.content_part.done", content_index=0, part=_dump(part), **self._where()))
        else:
            events.append(
                self._event("response.function_call_arguments.done", arguments=item.arguments, **self._where())
            )
        item.status = status
        events.append(self._event("response.output_item.done", output_index=len(self.items) - 1, item=_dump(item)))
        self.open = None
        return events

    def _content(self, text: str) -> list[str]:
        text, self.held, events = self.held + text, "", []
        if not isinstance(self.open, OutputMessage):
            if not text.strip():
                self.held = text
                return events
            events = self._open(OutputMessage(id=new_id("msg"), status="in_progress", content=[]))
        self.open.content[0].text += text
        return [
            *events,
            self._event("response.output_text.delta", content_index=0, delta=text, logprobs=[], **self._where()),
        ]

    def _call(self, d: StreamedToolCall) -> list[str]:
        events = []
        if d.id is not None:
            self.held = ""
            events += self._open(
                OutputFunctionCall(
                    id=new_id("fc"), call_id=d.id, name=d.function.name, arguments="", status="in_progress"
                )
            )
        if d.function.arguments:
            self.open.arguments += d.function.arguments
            events.append(
                self._event("response.function_call_arguments.delta", delta=d.function.arguments, **self._where())
            )
        return events

    async def events(self, gen: Generation) -> AsyncIterator[str]:
        """Server-sent events in OpenAI's order; an engine failure is an ``error`` event, then the stream ends."""
        yield self._event("response.created", response=_dump(self.response("in_progress")))
        yield self._event("response.in_progress", response=_dump(self.response("in_progress")))
        calls = ToolCallStream(self.tools) if self.tools else None
        async with aclosing(gen.pieces()) as stream:
            async for pieces in stream:
                for p in pieces:
                    if p.finish_reason == "error":
                        e = p.error
                        yield self._event("error", code=e.code, message=e.message, param=e.param)
                        return
                    text = p.text
                    if calls is not None:
                        text = calls.feed(text) + (calls.finish() if p.finish_reason else "")
                    for event in self._content(text) if text else []:
                        yield event
                    for d in calls.take_deltas() if calls is not None else []:
                        for event in self._call(d):
                            yield event
        for event in self._close("incomplete" if gen.samples[0].finish_reason == "length" else "completed"):
            yield event
        final = self.finish(gen)
        kind = "response.incomplete" if final.status == "incomplete" else "response.completed"
        yield self._event(kind, response=_dump(final))


def _dump(model: Any) -> dict[str, Any]:
    return model.model_dump(mode="json")
