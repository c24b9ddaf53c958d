"""A request's prompt as token ids: the chat template's rendering, or the prompt's text encoded. The replica
and the request router both call these, so that the router hashes exactly the tokens the engine caches."""

from __future__ import annotations

from typing import Any

from cluster.serve.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, bad_request, parse


def chat_ids(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
    try:
        return list(tokenizer.apply_chat_template(
            [m.template_dict() for m in messages], add_generation_prompt=add_generation_prompt,
            tokenize=True, return_dict=False))
    except Exception as e:  # templates raise on what they cannot render (roles out of order, ...)
        raise bad_request(f"messages: the chat template failed: {e}", "messages") from None


def prompt_ids(tokenizer: Any, prompt: str | list[int]) -> list[int]:
    """Token ids as they are: the engine rejects an empty prompt or ids outside the vocabulary (a 400)."""
    return tokenizer.encode(prompt) if isinstance(prompt, str) else prompt


def body_prompt_ids(tokenizer: Any, body: Any) -> list[int]:
    """The prompt of a decoded /v1/chat/completions or /v1/completions body (the keys tell which), validated as
    the replica validates it: an APIError (400) for what the replica would refuse."""
    if isinstance(body, dict) and "messages" in body:
        req = parse(ChatCompletionRequest, body)
        return chat_ids(tokenizer, req.messages, req.add_generation_prompt)
    return prompt_ids(tokenizer, parse(CompletionRequest, body).single_prompt())
