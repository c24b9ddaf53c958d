"""A request's prompt as token ids: the chat template's rendering, or the prompt's text encoded. The replica
and the request router both call these, so that the router hashes exactly the tokens the engine caches."""

from __future__ import annotations

from typing import Any

from serve.protocol.chat import ChatCompletionRequest, ChatMessage
from serve.protocol.completions import CompletionRequest
from serve.protocol.parsing import bad_request, parse
from serve.tools import ToolCalling


def chat_ids(
    tokenizer: Any,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    tools: ToolCalling | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    dicts = tools.template_messages(messages) if tools else [m.template_dict() for m in messages]
    extra = {"tools": tools.template_tools()} if tools and tools.native else {}
    try:
        return list(
            tokenizer.apply_chat_template(
                dicts,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
                **(template_kwargs or {}) | extra,
            )
        )
    except Exception as e:  # templates raise on what they cannot render (roles out of order, ...)
        raise bad_request(f"messages: the chat template failed: {e}", "messages") from None


def chat_request_ids(tokenizer: Any, req: ChatCompletionRequest) -> tuple[list[int], ToolCalling | None]:
    """A chat request's prompt ids, its tools rendered as its template shows them, and those tools."""
    tools = ToolCalling.from_request(req.tools, req.tool_choice, req.parallel_tool_calls, tokenizer.chat_template)
    return chat_ids(tokenizer, req.messages, req.add_generation_prompt, tools, req.chat_template_kwargs), tools


def prompt_ids(tokenizer: Any, prompt: str | list[int]) -> list[int]:
    """Token ids as they are: the engine rejects an empty prompt or ids outside the vocabulary (a 400)."""
    return tokenizer.encode(prompt) if isinstance(prompt, str) else prompt


def body_prompt_ids(tokenizer: Any, body: Any) -> list[int]:
    """The prompt of a decoded /v1/chat/completions or /v1/completions body (the keys tell which), validated as
    the replica validates it: an APIError (400) for what the replica would refuse."""
    if isinstance(body, dict) and "messages" in body:
        return chat_request_ids(tokenizer, parse(ChatCompletionRequest, body))[0]
    return prompt_ids(tokenizer, parse(CompletionRequest, body).single_prompt())
