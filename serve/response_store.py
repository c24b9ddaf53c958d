"""The responses a replica keeps for ``previous_response_id`` and ``GET /v1/responses/{id}``: in memory, bounded in
count and age (``responses_store_max_entries``, ``responses_store_ttl_s``)."""

from __future__ import annotations

import time
from collections import OrderedDict

from serve.protocol.chat import ChatMessage
from serve.protocol.parsing import APIError
from serve.protocol.responses import Response


class ResponseStore:
    """Each stored response, and its conversation (its input, earlier turns included, and its output, as chat
    messages; never its instructions, which OpenAI does not carry over), by response id.

    Invariants: at most ``capacity`` entries, none older than ``ttl_s`` is returned (the oldest go first, when
    full or expired). Per replica and in memory: a replica that restarts, or another replica that gets the
    follow-up, does not know the id, and the follow-up is a 404 naming it, never a silent fresh conversation.
    """

    def __init__(self, capacity: int, ttl_s: float) -> None:
        self.capacity, self.ttl_s = capacity, ttl_s
        self.entries: OrderedDict[str, tuple[float, Response, list[ChatMessage]]] = OrderedDict()

    def put(self, response: Response, messages: list[ChatMessage]) -> None:
        self._expire()
        self.entries[response.id] = (time.monotonic(), response, messages)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def get(self, response_id: str) -> list[ChatMessage]:
        """The conversation up to and including the response, for ``previous_response_id``."""
        return list(self._entry(response_id, "previous_response_id", "; send the conversation as input items")[2])

    def response(self, response_id: str) -> Response:
        return self._entry(response_id, None, "")[1]

    def _entry(self, response_id: str, param: str | None, hint: str) -> tuple[float, Response, list[ChatMessage]]:
        self._expire()
        if response_id not in self.entries:
            raise APIError(
                404,
                f"{param + ': ' if param else ''}no response {response_id!r} is stored on this replica (a replica "
                f"keeps the {self.capacity} latest responses made with store=true, for {self.ttl_s:g} s){hint}",
                param,
                "previous_response_not_found" if param else "response_not_found",
            )
        return self.entries[response_id]

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        while self.entries and next(iter(self.entries.values()))[0] < cutoff:
            self.entries.popitem(last=False)
