"""Speculative decoding's share of the scheduler: whose proposals a step carries, the slots they need, the counts."""

from __future__ import annotations

from scheduler.config import SchedulerConfig
from scheduler.ngram import DraftModelProposals, NgramProposer
from scheduler.request import Request


class Speculation:
    """Up to k proposed tokens for a decoding request each step (``num_speculative_tokens`` k; 0: off), and
    vLLM's spec-decode counters.

    Invariants the scheduler keeps with it:
    - a request with proposals is scheduled for its last token and its proposals (1 + k tokens, within the
      budget, their slots allocated as lookahead), and its computed count counts the proposals until the step
      returns. The step's output says how many were accepted; the count rolls back over the rejected ones,
      whose slots the next step overwrites. A block filled only by rejected tokens has no hash (hashes cover
      known tokens) and lies past the computed count, so it is never cached; the block stays in the table;
    - proposals are made from the request's known tokens, so a request that may get them
      (``SamplingParams.speculable``) is not scheduled while a step in flight samples it (as with pipelining):
      its placeholder is one per step, not k, and it is never in two steps in flight;
    - only requests whose sampling does not depend on the position in the run get proposals (no penalties, bad
      words, min_tokens, structured outputs, seeds of sampled requests): the ranks verify every position with
      the same processed distribution, so the output is exactly the target's, and a seeded request's random
      stream is the one it has without speculation;
    - proposals never reach past max_tokens or max_model_len.
    Prompt lookup (``NgramProposer``) proposes here. A draft model (``speculative_method="draft_model"``)
    proposes on the sampling rank, after the step is verified, from the request's newest token; the step's
    output carries the proposals (``draft_token_ids``), kept on the request for its next step. The draft's KV
    uses the target's block table and slots: its k passes write positions up to 2k past the computed ones (k
    proposals verified, then k passes from the sampled token after them), so a step that samples a speculable
    request allocates k lookahead slots beyond its proposals' (``plan``).
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.num_spec = k = config.num_speculative_tokens
        self.max_model_len = config.max_model_len
        draft = config.speculative_method == "draft_model"
        self.proposer = None
        if k:
            self.proposer = (
                DraftModelProposals() if draft else NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
            )
        # With a draft model, the slots its k proposal passes write after a step that samples (see plan).
        self.draft_lookahead = k if draft else 0
        self.num_drafts = self.num_draft_tokens = self.num_accepted = 0
        self.accepted_per_pos = [0] * k

    def plan(self, request: Request, num_tokens: int, num_new: int, budget: int) -> tuple[list[int], int]:
        """A speculable running request's proposals this step (when it decodes) and the lookahead slots to allocate
        after its new tokens: the proposals', and with a draft model k more when the step samples it (the draft's
        passes then write from the sampled token, up to k past the proposals), short of max_model_len and the
        request's last position (whose KV is never computed). The ranks' draft writes no slot it was not given."""
        num_computed = request.num_computed_tokens
        drafts = self._propose(request, budget) if num_computed + 1 == num_tokens else []
        lookahead = len(drafts)
        if self.draft_lookahead and num_computed + num_new == num_tokens:
            end = min(self.max_model_len, request.max_total_tokens)
            lookahead = max(min(lookahead + self.draft_lookahead, end - num_computed - num_new), len(drafts))
        return drafts, lookahead

    def _propose(self, request: Request, budget: int) -> list[int]:
        """Up to k proposed tokens for a decoding request, within the step's budget (its last token takes one)
        and short of max_tokens and max_model_len (the token sampled after the accepted ones needs room too)."""
        max_k = min(
            self.num_spec,
            budget - 1,
            request.sampling_params.max_tokens - len(request.output_token_ids) - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        return self.proposer.propose(request, max_k) if max_k > 0 else []

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verified proposal: vLLM's counters, and acceptance per position (accepted ones are a prefix)."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1
