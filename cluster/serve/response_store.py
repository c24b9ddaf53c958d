"""The responses a replica keeps for ``previous_response_id``: in memory, bounded in count and age."""

from __future__ import annotations

import time
from collections import OrderedDict

from cluster.serve.protocol.chat import ChatMessage
from cluster.serve.protocol.parsing import APIError

MAX_STORED_RESPONSES = 1024
STORED_RESPONSE_TTL_S = 3600.0


class ResponseStore:
    """Each stored response's conversation (its input, earlier turns included, and its output, as chat messages;
    never its instructions, which OpenAI does not carry over), by response id.

    Invariants: at most ``capacity`` entries, none older than ``ttl_s`` is returned (the oldest go first, when
    full or expired). Per replica and in memory: a replica that restarts, or another replica that gets the
    follow-up, does not know the id, and the follow-up is a 404 naming it, never a silent fresh conversation.
    """

    def __init__(self, capacity: int = MAX_STORED_RESPONSES, ttl_s: float = STORED_RESPONSE_TTL_S) -> None:
        self.capacity, self.ttl_s = capacity, ttl_s
        self.entries: OrderedDict[str, tuple[float, list[ChatMessage]]] = OrderedDict()

    def put(self, response_id: str, messages: list[ChatMessage]) -> None:
        self._expire()
        self.entries[response_id] = (time.monotonic(), messages)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def get(self, response_id: str) -> list[ChatMessage]:
        self._expire()
        if response_id not in self.entries:
            raise APIError(
                404,
                f"previous_response_id: no response {response_id!r} is stored on this replica (a replica keeps the "
                f"{self.capacity} latest responses made with store=true, for {self.ttl_s:g} s); send the "
                f"conversation as input items instead",
                "previous_response_id",
                "previous_response_not_found",
            )
        return list(self.entries[response_id][1])

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        while self.entries and next(iter(self.entries.values()))[0] < cutoff:
            self.entries.popitem(last=False)
