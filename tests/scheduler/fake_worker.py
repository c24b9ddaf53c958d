"""A worker without a model: rebuilds request state from SchedulerOutput diffs and its own samples, and checks it.

It keeps a fake KV cache (the token id written at each slot), and a fake host
tier the step's swaps copy whole blocks to and from (out, then in, then the
step's writes, as the real workers do), so that any prefix-cache hit whose
blocks do not hold exactly the request's tokens, a swap that brings back the
wrong content, or a block overwritten while another request still reads it,
fails loudly.

With ``draft_k`` it plays a draft model (speculative_method "draft_model"):
after a step samples a speculable request, it proposes up to k tokens (the
fake's own next token with probability 0.7, else a random one) and writes
their KV as a draft does, at the newest token's position and past it, only
into blocks the request holds. Those slots lie past the computed tokens, so
a step that reads them as context before rewriting them fails the check.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from scheduler import ModelRunnerOutput, SchedulerOutput


@dataclass(slots=True)
class FakeState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    parked: bool = False
    sampled: list[int] = field(default_factory=list)
    speculable: bool = False


class FakeWorker:
    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        vocab_size: int = 1000,
        eos_token_id: int | None = None,
        eos_every: int = 0,
        num_host_blocks: int = 0,
        samples: bool = True,
        draft_k: int = 0,
        draft_seed: int = 0,
    ) -> None:
        # samples=False: a pipeline stage before the last, which gets each request's tokens from the scheduler
        # (CachedRequestData.new_token_ids) and never samples.
        self.samples = samples
        self.block_size = block_size
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.host: list[list[int | None]] = [[None] * block_size for _ in range(num_host_blocks)]
        self.states: dict[str, FakeState] = {}
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.eos_every = eos_every
        self.steps = 0
        self.draft_k, self.draft_rng = draft_k, random.Random(draft_seed)

    def next_token(self, rid: str, state: FakeState) -> int:
        n = len(state.token_ids)
        if self.eos_every and self.eos_token_id is not None and n % self.eos_every == 0:
            return self.eos_token_id
        return (sum(map(ord, rid)) * 31 + n * 7) % self.vocab_size

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.steps += 1
        self._swap(so)
        for rid in so.finished_req_ids:
            del self.states[rid]
        for rid in so.preempted_req_ids:
            self.states[rid].parked = True
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.states, f"{new.req_id} sent as new twice"
            self.states[new.req_id] = FakeState(
                list(new.prompt_token_ids),
                list(new.block_ids),
                new.num_computed_tokens,
                speculable=new.sampling_params.speculable,
            )
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self.states[rid]
            if cached.resumed_from_preemption[i]:
                assert st.parked, f"{rid} resumed without having been preempted"
                st.parked = False
                st.block_ids = list(cached.new_block_ids[i])
                st.num_computed_tokens = cached.num_computed_tokens[i]
            else:
                assert not st.parked, f"{rid} scheduled while parked"
                assert st.num_computed_tokens == cached.num_computed_tokens[i], rid
                st.block_ids.extend(cached.new_block_ids[i])
            if not self.samples:
                st.token_ids.extend(cached.new_token_ids[i])
        req_ids, sampled = [], []
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        num_accepted = []
        for rid, n in so.num_scheduled_tokens.items():
            st = self.states[rid]
            assert n >= 1
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            tokens = st.token_ids + drafts
            start = st.num_computed_tokens
            assert start + n <= len(tokens), f"{rid} scheduled past its tokens"
            assert len(st.block_ids) * self.block_size >= start + n, f"{rid} has too few blocks"
            self._check_context(rid, st, start)
            for pos in range(start, start + n):
                blk, off = st.block_ids[pos // self.block_size], pos % self.block_size
                self.kv[blk][off] = tokens[pos]
            st.num_computed_tokens = start + n
            if st.num_computed_tokens == len(tokens) and self.samples:
                # Verification as greedy requests get it: a proposal is accepted while it is the token the
                # fake samples there; the sample after the accepted ones is the step's token.
                accepted = 0
                while accepted < len(drafts) and drafts[accepted] == self.next_token(rid, st):
                    st.token_ids.append(drafts[accepted])
                    accepted += 1
                token = self.next_token(rid, st)
                st.token_ids.append(token)  # a worker appends its own sample, as the real ranks do
                st.num_computed_tokens -= len(drafts) - accepted
                req_ids.append(rid)
                sampled.append(token)
                num_accepted.append(accepted)
        drafts = {rid: self._draft(rid, self.states[rid]) for rid in req_ids} if self.draft_k else None
        return ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=sampled, num_accepted_tokens=num_accepted, draft_token_ids=drafts
        )

    def _swap(self, so: SchedulerOutput) -> None:
        assert len({h for _, h in so.blocks_to_swap_out}) == len(so.blocks_to_swap_out), "two copies to a host block"
        assert len({d for _, d in so.blocks_to_swap_in}) == len(so.blocks_to_swap_in), "two copies to a device block"
        out = [(h, list(self.kv[d])) for d, h in so.blocks_to_swap_out]
        for h, content in out:
            self.host[h] = content
        into = [(d, list(self.host[h])) for h, d in so.blocks_to_swap_in]
        for d, content in into:
            self.kv[d] = content

    def _draft(self, rid: str, st: FakeState) -> list[int]:
        """A draft's proposals after the newest token, and its KV writes: the newest token's at its position,
        each proposal's at the next, within the slots the request holds."""
        if not st.speculable:
            return []
        newest = len(st.token_ids) - 1
        room = len(st.block_ids) * self.block_size - newest
        out: list[int] = []
        for j in range(min(self.draft_k, room)):
            pos = newest + j
            self.kv[st.block_ids[pos // self.block_size]][pos % self.block_size] = (st.token_ids + out)[pos]
            right = self.next_token(rid, FakeState(st.token_ids + out, [], 0))
            out.append(right if self.draft_rng.random() < 0.7 else self.draft_rng.randrange(50))
        return out

    def _check_context(self, rid: str, st: FakeState, upto: int) -> None:
        for pos in range(upto):
            blk, off = st.block_ids[pos // self.block_size], pos % self.block_size
            assert blk != 0, f"{rid} reads the null block"
            assert self.kv[blk][off] == st.token_ids[pos], (
                f"{rid}: KV at position {pos} (block {blk}) holds {self.kv[blk][off]}, expected {st.token_ids[pos]}"
            )
