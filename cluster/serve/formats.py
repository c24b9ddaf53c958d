"""Response formats: /v1/completions and /v1/chat/completions chunks and whole responses, and the SSE stream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from cluster.serve.generation import Generation, Piece
from cluster.serve.protocol import (
    AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionResponse, ChatLogprobs,
    ChatStreamChoice, CompletionChoice, CompletionChunk, CompletionLogprobs, CompletionResponse, Delta,
    TokenLogprob, TopLogprob, Usage, now,
)


def _token_str(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


@dataclass(slots=True)
class CompletionFormat:
    """Builds /v1/completions chunks and responses; ``offsets`` keeps each choice's logprob text_offset."""

    tokenizer: Any
    id: str
    model: str
    num_logprobs: int | None
    offsets: dict[int, int] = field(default_factory=dict)
    created: int = field(default_factory=now)

    def opening(self, n: int, usage: bool) -> list[BaseModel]:
        return []

    def logprobs(self, p: Piece) -> CompletionLogprobs | None:
        """Offsets index the returned text: a token decoded alone can show half a character as U+FFFD, or
        text a stop string cut, so each advances by its own text but never past what its piece added."""
        if self.num_logprobs is None or not p.logprobs:
            return None
        out, offset = CompletionLogprobs(), self.offsets.get(p.index, 0)
        end = offset + len(p.text)
        for token_id, lp in zip(p.token_ids, p.logprobs):
            token = _token_str(self.tokenizer, token_id)
            out.tokens.append(token)
            out.token_logprobs.append(lp.logprob)
            out.text_offset.append(offset)
            out.top_logprobs.append({_token_str(self.tokenizer, t): v
                                     for t, v in zip(lp.top_token_ids, lp.top_logprobs)})
            offset = min(offset + len(token), end)
        self.offsets[p.index] = end
        return out

    def chunk(self, pieces: list[Piece], usage: bool) -> BaseModel:
        choices = [CompletionChoice(index=p.index, text=p.text, logprobs=self.logprobs(p),
                                    finish_reason=p.finish_reason) for p in pieces]
        return CompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                               **({"usage": None} if usage else {}))

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return CompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def response(self, gen: Generation, texts: list[str], logprobs: list[list[BaseModel]]) -> BaseModel:
        choices = [CompletionChoice(index=i, text=t, finish_reason=s.finish_reason,
                                    logprobs=_merge_completion_logprobs(lps) if self.num_logprobs is not None
                                    else None)
                   for i, (s, t, lps) in enumerate(zip(gen.samples, texts, logprobs))]
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                  usage=gen.usage())


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
    """Builds /v1/chat/completions chunks and responses (the role comes once per choice, first)."""

    tokenizer: Any
    id: str
    model: str
    num_logprobs: int | None
    created: int = field(default_factory=now)

    def opening(self, n: int, usage: bool) -> list[BaseModel]:
        return [ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[
            ChatStreamChoice(index=i, delta=Delta(role="assistant", content="")) for i in range(n)],
            **({"usage": None} if usage else {}))]

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        token = _token_str(self.tokenizer, token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

    def logprobs(self, p: Piece) -> ChatLogprobs | None:
        if self.num_logprobs is None or not p.logprobs:
            return None
        return ChatLogprobs(content=[
            TokenLogprob(**self._top(t, lp.logprob).model_dump(),
                         top_logprobs=[self._top(i, v) for i, v in zip(lp.top_token_ids, lp.top_logprobs)])
            for t, lp in zip(p.token_ids, p.logprobs)])

    def chunk(self, pieces: list[Piece], usage: bool) -> BaseModel:
        choices = [ChatStreamChoice(index=p.index, delta=Delta(content=p.text or None), logprobs=self.logprobs(p),
                                    finish_reason=p.finish_reason) for p in pieces]
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                   **({"usage": None} if usage else {}))

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def response(self, gen: Generation, texts: list[str], logprobs: list[list[BaseModel]]) -> BaseModel:
        choices = [ChatChoice(index=i, message=AssistantMessage(content=t), finish_reason=s.finish_reason,
                              logprobs=ChatLogprobs(content=[c for lp in lps for c in lp.content])
                              if self.num_logprobs is not None else None)
                   for i, (s, t, lps) in enumerate(zip(gen.samples, texts, logprobs))]
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=gen.usage())


Format = CompletionFormat | ChatFormat


def _sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


async def stream_sse(gen: Generation, fmt: Format, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: ``data: {chunk}`` per delta, an error event if the engine fails, then [DONE]."""
    for chunk in fmt.opening(len(gen.samples), include_usage):
        yield _sse(chunk)
    async with aclosing(gen.pieces()) as stream:
        async for pieces in stream:
            pieces = [p for p in pieces if p.text or p.finish_reason or p.logprobs]
            errors = [p.error for p in pieces if p.finish_reason == "error"]
            if errors:
                yield _sse(errors[0].body())
                break
            if pieces:
                yield _sse(fmt.chunk(pieces, include_usage))
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


