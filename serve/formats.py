"""Response formats: /v1/completions and /v1/chat/completions chunks and whole responses, and the SSE stream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from scheduler import SampledLogprobs
from serve.generation import Generation, Piece
from serve.protocol.chat import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    Delta,
    TokenLogprob,
    TopLogprob,
)
from serve.protocol.completions import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    PromptLogprob,
)
from serve.protocol.output import Usage, now
from serve.tools import ToolCalling, ToolCallStream


def _token_str(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


@dataclass(slots=True)
class CompletionFormat:
    """Builds /v1/completions chunks and responses; ``offsets`` keeps each choice's logprob text_offset.
    ``echo`` (the prompt's text, for ``echo=true``) leads each choice's first chunk; ``echoed`` holds
    the choices that have had it. The prompt's logprobs (``prompt_token_ids``' tokens after the first) come on
    each choice's first piece: with echo and logprobs they lead its ``logprobs``, and with
    ``num_prompt_logprobs`` they also fill its vLLM ``prompt_logprobs``."""

    tokenizer: Any
    id: str
    model: str
    num_logprobs: int | None
    offsets: dict[int, int] = field(default_factory=dict)
    created: int = field(default_factory=now)
    echo: str = ""
    echoed: set[int] = field(default_factory=set)
    prompt_token_ids: list[int] = field(default_factory=list)
    num_prompt_logprobs: int | None = None

    def _text(self, p: Piece) -> str:
        if not self.echo or p.index in self.echoed:
            return p.text
        self.echoed.add(p.index)
        return self.echo + p.text

    def opening(self, n: int, usage: bool) -> list[BaseModel]:
        return []

    def logprobs(self, p: Piece) -> CompletionLogprobs | None:
        """Offsets index the returned text: a token decoded alone can show half a character as U+FFFD, or
        text a stop string cut, so each advances by its own text but never past what its piece added."""
        if self.num_logprobs is None or not p.logprobs:
            return None
        out = CompletionLogprobs()
        if self.echo and p.prompt_logprobs is not None:
            self._add(out, 0, len(self.echo), self.prompt_token_ids, [None, *p.prompt_logprobs])
            self.offsets[p.index] = len(self.echo)
        offset = self.offsets.get(p.index, 0)
        self.offsets[p.index] = self._add(out, offset, offset + len(p.text), p.token_ids, p.logprobs)
        return out

    def _add(
        self,
        out: CompletionLogprobs,
        offset: int,
        end: int,
        token_ids: list[int],
        logprobs: list[SampledLogprobs | None],
    ) -> int:
        for token_id, lp in zip(token_ids, logprobs):
            token = _token_str(self.tokenizer, token_id)
            out.tokens.append(token)
            out.token_logprobs.append(None if lp is None else lp.logprob)
            out.text_offset.append(offset)
            out.top_logprobs.append(
                None
                if lp is None
                else {
                    _token_str(self.tokenizer, t): v
                    for t, v in zip(lp.top_token_ids[: self.num_logprobs], lp.top_logprobs[: self.num_logprobs])
                }
            )
            offset = min(offset + len(token), end)
        return end

    def prompt_logprobs(self, entries: list[SampledLogprobs] | None) -> list[dict[int, PromptLogprob] | None] | None:
        """vLLM's form: per prompt token, its own logprob and rank, and the top-k (ranks 1..k)."""
        if self.num_prompt_logprobs is None or entries is None:
            return None
        out: list[dict[int, PromptLogprob] | None] = [None]
        for token_id, lp in zip(self.prompt_token_ids[1:], entries):
            d = {
                token_id: PromptLogprob(
                    logprob=lp.logprob, rank=lp.rank, decoded_token=_token_str(self.tokenizer, token_id)
                )
            }
            top = zip(lp.top_token_ids[: self.num_prompt_logprobs], lp.top_logprobs[: self.num_prompt_logprobs])
            for rank, (t, v) in enumerate(top, 1):
                d.setdefault(t, PromptLogprob(logprob=v, rank=rank, decoded_token=_token_str(self.tokenizer, t)))
            out.append(d)
        return out

    def chunk(self, pieces: list[Piece], usage: bool) -> list[BaseModel]:
        choices = [
            CompletionChoice(
                index=p.index,
                text=self._text(p),
                logprobs=self.logprobs(p),
                finish_reason=p.finish_reason,
                prompt_logprobs=self.prompt_logprobs(p.prompt_logprobs),
            )
            for p in pieces
        ]
        return [
            CompletionChunk(
                id=self.id,
                created=self.created,
                model=self.model,
                choices=choices,
                **({"usage": None} if usage else {}),
            )
        ]

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return CompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def response(self, gen: Generation, texts: list[str], logprobs: list[list[BaseModel]]) -> BaseModel:
        choices = [
            CompletionChoice(
                index=i,
                text=self.echo + t,
                finish_reason=s.finish_reason,
                logprobs=_merge_completion_logprobs(lps) if self.num_logprobs is not None else None,
                prompt_logprobs=self.prompt_logprobs(s.prompt_logprobs),
            )
            for i, (s, t, lps) in enumerate(zip(gen.samples, texts, logprobs))
        ]
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=gen.usage()
        )


def _merge_completion_logprobs(parts: list[CompletionLogprobs]) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for p in parts:
        out.tokens += p.tokens
        out.token_logprobs += p.token_logprobs
        out.text_offset += p.text_offset
        out.top_logprobs += p.top_logprobs
    return out


@dataclass(slots=True)
class ChatFormat:
    """Builds /v1/chat/completions chunks and responses (the role comes once per choice, first).

    With ``tools``, each choice's text goes through a ToolCallStream (``streams``): calls leave the
    content and stream as OpenAI's do, a chunk with each call's id and name, then one with its arguments;
    a choice that called ends with ``tool_calls``.
    """

    tokenizer: Any
    id: str
    model: str
    num_logprobs: int | None
    created: int = field(default_factory=now)
    tools: ToolCalling | None = None
    streams: dict[int, ToolCallStream] = field(default_factory=dict)

    def opening(self, n: int, usage: bool) -> list[BaseModel]:
        return [
            ChatCompletionChunk(
                id=self.id,
                created=self.created,
                model=self.model,
                choices=[ChatStreamChoice(index=i, delta=Delta(role="assistant", content="")) for i in range(n)],
                **({"usage": None} if usage else {}),
            )
        ]

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        token = _token_str(self.tokenizer, token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

    def logprobs(self, p: Piece) -> ChatLogprobs | None:
        if self.num_logprobs is None or not p.logprobs:
            return None
        return ChatLogprobs(
            content=[
                TokenLogprob(
                    **self._top(t, lp.logprob).model_dump(),
                    top_logprobs=[self._top(i, v) for i, v in zip(lp.top_token_ids, lp.top_logprobs)],
                )
                for t, lp in zip(p.token_ids, p.logprobs)
            ]
        )

    def _chunk(self, choices: list[ChatStreamChoice], usage: bool) -> BaseModel:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=choices, **({"usage": None} if usage else {})
        )

    def chunk(self, pieces: list[Piece], usage: bool) -> list[BaseModel]:
        if self.tools is None:
            return [
                self._chunk(
                    [
                        ChatStreamChoice(
                            index=p.index,
                            delta=Delta(content=p.text or None),
                            logprobs=self.logprobs(p),
                            finish_reason=p.finish_reason,
                        )
                        for p in pieces
                    ],
                    usage,
                )
            ]
        chunks = []
        for p in pieces:  # a chunk per tool call delta, as OpenAI streams them
            stream = self.streams.setdefault(p.index, ToolCallStream(self.tools))
            content = stream.feed(p.text) + (stream.finish() if p.finish_reason else "")
            choices = [ChatStreamChoice(index=p.index, delta=Delta(content=content or None), logprobs=self.logprobs(p))]
            choices += [ChatStreamChoice(index=p.index, delta=Delta(tool_calls=[d])) for d in stream.take_deltas()]
            if content or p.logprobs or len(choices) == 1:
                chunks.append(choices[0])
            chunks += choices[1:]
            chunks[-1].finish_reason = _finish_reason(p.finish_reason, bool(stream.returned_calls()))
        return [self._chunk([c], usage) for c in chunks]

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def response(self, gen: Generation, texts: list[str], logprobs: list[list[BaseModel]]) -> BaseModel:
        choices = []
        for i, (s, t, lps) in enumerate(zip(gen.samples, texts, logprobs)):
            content, calls = self.tools.parse(t) if self.tools else (t, [])
            choices.append(
                ChatChoice(
                    index=i,
                    message=AssistantMessage(content=content, tool_calls=calls or None),
                    finish_reason=_finish_reason(s.finish_reason, bool(calls)),
                    logprobs=ChatLogprobs(content=[c for lp in lps for c in lp.content])
                    if self.num_logprobs is not None
                    else None,
                )
            )
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=gen.usage()
        )


def _finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


Format = CompletionFormat | ChatFormat


def _sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


async def stream_sse(gen: Generation, fmt: Format, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: ``data: {chunk}`` per delta, an error event if the engine fails, then [DONE]."""
    for chunk in fmt.opening(len(gen.samples), include_usage):
        yield _sse(chunk)
    async with aclosing(gen.pieces()) as stream:
        async for pieces in stream:
            pieces = [p for p in pieces if p.text or p.finish_reason or p.logprobs or p.prompt_logprobs is not None]
            errors = [p.error for p in pieces if p.finish_reason == "error"]
            if errors:
                yield _sse(errors[0].body())
                break
            for chunk in fmt.chunk(pieces, include_usage) if pieces else []:
                yield _sse(chunk)
        else:
            if include_usage:
                yield _sse(fmt.usage_chunk(gen.usage()))
    yield "data: [DONE]\n\n"


async def collect(gen: Generation, fmt: Format) -> BaseModel:
    n = len(gen.samples)
    texts, logprobs = [[] for _ in range(n)], [[] for _ in range(n)]
    async with aclosing(gen.pieces()) as stream:
        async for pieces in stream:
            for p in pieces:
                if p.finish_reason == "error":
                    raise p.error
                texts[p.index].append(p.text)
                if (lp := fmt.logprobs(p)) is not None:
                    logprobs[p.index].append(lp)
    return fmt.response(gen, ["".join(t) for t in texts], logprobs)
