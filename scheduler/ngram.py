"""Where a request's proposals come from: prompt lookup (n-gram, made here) or a draft model (made on the ranks)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from scheduler.request import Request


class NgramProposer:
    """Proposes up to k tokens by matching the request's last n tokens (n from ``max_n`` down to ``min_n``, the
    longest first) earlier in its prompt and output, and copying what followed the earliest match.

    Runs in the scheduler, which holds every request's token ids (prompt and outputs) as they are applied: a
    proposal must be made from the request's latest tokens, and the scheduler schedules the proposals as
    input tokens of the next step, so on the ranks they would have to travel back anyway. The cost is one
    numpy pass over the request's tokens per step (tens of microseconds at a few thousand tokens), while
    the ranks run the step in flight.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, request: Request, max_k: int) -> list[int]:
        token_ids = request.all_token_ids
        num_tokens = len(token_ids)
        if num_tokens < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        earlier = tokens[:-1]  # a match must have at least one token after it
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            windows = sliding_window_view(earlier, n)
            hits = np.flatnonzero((windows == tokens[num_tokens - n :]).all(axis=1))
            if hits.size:
                start = int(hits[0]) + n
                return token_ids[start : start + max_k]
        return []


class DraftModelProposals:
    """A draft model's proposals (speculative_method "draft_model"): the draft runs on the sampling rank after
    each step and the step's output carries them; ``Scheduler.update_from_output`` keeps them on the request
    (``draft_token_ids``). They are always for the request's latest token: a speculable request is never in two
    steps in flight, and every step that samples it replaces them."""

    def propose(self, request: Request, max_k: int) -> list[int]:
        return request.draft_token_ids[:max_k]
