"""Batched token sampling: penalties, temperature, min-p, top-k, top-p, seeds, logprobs; verification of proposals.

The model runner builds one ``SamplingMetadata`` per step (Python lists to
tensors, once, before it queues the forward); penalties read a ``PenaltyState`` the
runner keeps up to date on the device. ``Sampler`` then works on the whole batch with tensor ops.
Everything a batch does not use is ``None`` in the metadata, so the common
cases (all greedy, no penalties, no top-k/top-p/min-p) skip that work entirely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.cpu_ops import sample_categorical, top_p_mask_
from scheduler.outputs import SampledLogprobs
from scheduler.sampling_params import SamplingParams


@dataclass(slots=True)
class Penalties:
    """Per-row penalty parameters and the token statistics they act on.

    Invariants: every tensor has S rows on the sampling device; ``seen`` is
    True exactly at the tokens of the row's prompt or outputs (repetition
    penalty scope, as in vLLM); ``output_counts`` counts output tokens only
    (presence/frequency scope, as in OpenAI). Rows whose penalties are neutral
    (1, 0, 0) still have rows here so that the batch stays one tensor op.
    """

    repetition: Tensor  # [S] fp32
    presence: Tensor  # [S] fp32
    frequency: Tensor  # [S] fp32
    seen: Tensor  # [S, V] bool
    output_counts: Tensor  # [S, V] fp32


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling state for one step; row i is the i-th request that samples.

    Invariants, so that ``Sampler`` needs no per-row Python on the hot path:
    - A tensor field is ``None`` iff no row needs that stage: the field is the
      flag (``all_greedy`` reads ``temperature``), so no flag can disagree with its data.
    - Greedy rows (``SamplingParams.greedy``: top_k 1, or a temperature below
      1e-5, which would overflow the logits it divides) are argmaxed after
      min_tokens and penalties. Temperature, min-p, top-k and top-p cannot
      change an argmax, so greedy rows hold neutral values there (temperature
      1, top_k V, top_p 1, min_p 0) and do not turn those stages on.
    - ``top_k`` is in [1, V]; rows with top-k off hold V, which keeps
      everything. ``max_top_k`` is the largest k among rows with top-k on (V if
      none), so one ``topk(max_top_k)`` covers every row that filters.
    - ``generators`` maps random rows that have a seed to their own generator
      (on the sampling device); greedy rows draw nothing, so a seeded request's
      stream does not depend on which steps it shared with whom.
    - ``banned`` is (row ids, token ids) set to -inf: while a row has fewer
      than ``min_tokens`` outputs, its EOS and stop ids; and the last token of
      each bad word whose other tokens end the row's output.
    - ``bias`` is (row ids, token ids, values) added for ``logit_bias``;
      ``allowed`` is [S, V] bool, True at the tokens ``allowed_token_ids`` leave out;
      ``grammar`` is [S, V] bool, True at the tokens a row's structured-output
      constraint bans, set by the runner after it has queued the forward (the
      masks are filled on the host while the device computes).
    """

    temperature: Tensor | None  # [S] fp32; None iff all rows are greedy
    greedy: Tensor | None  # [S] bool; None iff no row is greedy
    top_k: Tensor | None  # [S] int64
    max_top_k: int
    top_p: Tensor | None  # [S] fp32
    min_p: Tensor | None  # [S] fp32
    penalties: Penalties | None
    banned: tuple[Tensor, Tensor] | None
    generators: dict[int, torch.Generator]
    num_logprobs: list[int | None]
    max_num_logprobs: int | None
    bias: tuple[Tensor, Tensor, Tensor] | None = None
    allowed: Tensor | None = None
    grammar: Tensor | None = None

    @property
    def all_greedy(self) -> bool:
        return self.temperature is None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        num_outputs: list[int],
        eos_token_id: int | None,
        vocab_size: int,
        device: torch.device | str,
        penalties: Penalties | None = None,
        outputs: list[list[int]] | None = None,
    ) -> SamplingMetadata:
        """`num_outputs[i]`: tokens row i's request has generated (for min_tokens); `penalties` from
        `PenaltyState.penalties`, None when no row has any; `outputs[i]`: those tokens (for bad words; only
        rows with bad words are read)."""
        greedy = [p.greedy for p in params]
        random_params = [p for p, is_greedy in zip(params, greedy) if not is_greedy]

        def per_row(field: str, neutral: float) -> list:
            return [neutral if is_greedy else getattr(p, field) for p, is_greedy in zip(params, greedy)]

        def fp32(values: list) -> Tensor:
            return _to_device(values, torch.float32, device)

        def fp32_if_used(field: str, neutral: float) -> Tensor | None:
            return fp32(per_row(field, neutral)) if any(getattr(p, field) != neutral for p in random_params) else None

        top_k_on = [min(p.top_k, vocab_size) for p in random_params if p.top_k != -1]
        top_k = [vocab_size if k == -1 else min(k, vocab_size) for k in per_row("top_k", -1)]
        logprobs = [p.logprobs for p in params]
        asked = [k for k in logprobs if k is not None]
        return cls(
            temperature=fp32(per_row("temperature", 1.0)) if random_params else None,
            greedy=_to_device(greedy, torch.bool, device) if any(greedy) else None,
            top_k=_to_device(top_k, torch.int64, device) if top_k_on else None,
            max_top_k=max(top_k_on, default=vocab_size),
            top_p=fp32_if_used("top_p", 1.0),
            min_p=fp32_if_used("min_p", 0.0),
            penalties=penalties,
            banned=_build_banned(params, num_outputs, eos_token_id, vocab_size, device, outputs),
            generators={i: gen for i, gen in enumerate(generators) if gen is not None and not greedy[i]},
            num_logprobs=logprobs,
            max_num_logprobs=max(asked) if asked else None,
            bias=_build_bias(params, vocab_size, device),
            allowed=_build_allowed(params, vocab_size, device),
        )


def _to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    # Built on the host, copied without waiting for the device: the runner does this before it queues
    # the forward, so on CUDA the copy never waits behind a step's kernels.
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


NEUTRAL_PENALTIES = (1.0, 0.0, 0.0)


def has_penalties(p: SamplingParams) -> bool:
    return (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) != NEUTRAL_PENALTIES


class PenaltyState:
    """The token statistics penalties act on, one row per runner row, kept on the sampling device.

    Invariants, for each row a live request with penalties holds: ``prompt_seen[row]`` is True
    exactly at its prompt's tokens and ``output_counts[row, t]`` is how often it sampled t.
    ``start`` sets a row up once per request, ``count`` adds each step's sampled tokens on the
    device, so a step costs O(rows) and never rebuilds the statistics from every token of every
    request. The [rows, V] tensors are allocated for the first request with penalties (most batches
    have none) and grow with the runner's rows.
    """

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.prompt_seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=self.device)

    def start(self, row: int, prompt_token_ids: list[int], num_rows: int) -> None:
        """Row `row` now belongs to a new request with penalties (the runner has `num_rows` rows)."""
        if self.prompt_seen.shape[0] < num_rows:
            grow = num_rows - self.prompt_seen.shape[0]
            self.prompt_seen = torch.cat([self.prompt_seen, self.prompt_seen.new_zeros(grow, self.vocab_size)])
            self.output_counts = torch.cat([self.output_counts, self.output_counts.new_zeros(grow, self.vocab_size)])
        self.prompt_seen[row] = False
        self.output_counts[row] = 0
        self.prompt_seen[row, _to_device(prompt_token_ids, torch.int64, self.device)] = True

    def count(self, rows: Tensor, tokens: Tensor) -> None:
        """One more output of `tokens[i]` for row `rows[i]` (at most one per row)."""
        self.output_counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)

    def penalties(self, params: list[SamplingParams], rows: Tensor) -> Penalties | None:
        """The penalties of a batch whose row i is runner row rows[i]; None when every row is neutral."""
        triples = [(p.repetition_penalty, p.presence_penalty, p.frequency_penalty) for p in params]
        if all(t == NEUTRAL_PENALTIES for t in triples):
            return None
        repetition, presence, frequency = _to_device(triples, torch.float32, self.device).unbind(1)
        output_counts = self.output_counts.index_select(0, rows)
        seen = self.prompt_seen.index_select(0, rows) | (output_counts > 0)
        return Penalties(repetition, presence, frequency, seen, output_counts)


def _build_banned(
    params: list[SamplingParams],
    num_outputs: list[int],
    eos_token_id: int | None,
    vocab_size: int,
    device: torch.device | str,
    outputs: list[list[int]] | None = None,
) -> tuple[Tensor, Tensor] | None:
    rows: list[int] = []
    tokens: list[int] = []
    for i, (p, num_output) in enumerate(zip(params, num_outputs)):
        if p.bad_words_token_ids:
            # vLLM's rule: a bad word's last token is banned when the output ends with the rest of it.
            output = outputs[i] if outputs is not None else []
            ids = {
                word[-1]
                for word in p.bad_words_token_ids
                if len(word) == 1 or len(output) >= len(word) - 1 and output[len(output) - len(word) + 1 :] == word[:-1]
            }
            ids = [t for t in ids if t < vocab_size]
            rows += [i] * len(ids)
            tokens += ids
        if num_output >= p.min_tokens:
            continue
        # EOS is banned even with ignore_eos: min_tokens promises that many real tokens.
        ids = {*p.stop_token_ids, *([] if eos_token_id is None else [eos_token_id])}
        # Tokenizers may know ids the model's (padded) vocab lacks; those can't be sampled anyway.
        ids = [t for t in ids if t < vocab_size]
        rows += [i] * len(ids)
        tokens += ids
    if not rows:
        return None
    return _to_device(rows, torch.int64, device), _to_device(tokens, torch.int64, device)


def _build_bias(
    params: list[SamplingParams], vocab_size: int, device: torch.device | str
) -> tuple[Tensor, Tensor, Tensor] | None:
    entries = [
        (i, t, v) for i, p in enumerate(params) if p.logit_bias for t, v in p.logit_bias.items() if t < vocab_size
    ]
    if not entries:
        return None
    rows, tokens, values = zip(*entries)
    return (
        _to_device(rows, torch.int64, device),
        _to_device(tokens, torch.int64, device),
        _to_device(values, torch.float32, device),
    )


def _build_allowed(params: list[SamplingParams], vocab_size: int, device: torch.device | str) -> Tensor | None:
    """[S, V] bool, True at the tokens ``allowed_token_ids`` leave out (a whole-batch mask: one in-place op,
    where gathering and scattering rows would copy them twice)."""
    if all(p.allowed_token_ids is None for p in params):
        return None
    banned = torch.zeros(len(params), vocab_size, dtype=torch.bool)
    for i, p in enumerate(params):
        if p.allowed_token_ids is not None:
            banned[i] = True
            banned[i, [t for t in p.allowed_token_ids if t < vocab_size]] = False
    return banned.to(device, non_blocking=True)


class Sampler:
    """Picks one token per row of a [S, V] fp32 logits batch.

    Stateless: everything per request lives in ``SamplingMetadata`` (the
    seeded generators are owned by the runner, which keeps them across steps).
    The logits passed in are modified in place, to avoid copying [S, V] per stage.
    """

    def __call__(self, logits: Tensor, metadata: SamplingMetadata) -> tuple[Tensor, LogprobRows | None]:
        # Logprobs describe the model's own distribution (vLLM v1's default), so
        # they come from the raw logits, before any processing below.
        raw_logprobs = None if metadata.max_num_logprobs is None else logits.log_softmax(-1)
        logits = self.process_logits(logits, metadata)
        if metadata.all_greedy:
            sampled = argmax(logits)
        else:
            sampled = _draw(logits.softmax(-1), metadata.generators)
            if metadata.greedy is not None:
                sampled = torch.where(metadata.greedy, argmax(logits), sampled)
        if raw_logprobs is None:
            return sampled, None
        return sampled, _logprob_rows(raw_logprobs, sampled, metadata)

    def verify(
        self, logits: Tensor, metadata: SamplingMetadata, draft_ids: Tensor, num_drafts: list[int]
    ) -> tuple[Tensor, LogprobRows | None]:
        """Speculative decoding: accept a prefix of each request's proposals and sample the token after it.

        Request i has ``num_drafts[i] + 1`` consecutive rows (its logits at its last token and at each proposal);
        ``draft_ids[r]`` is the proposal row r verifies, -1 on a request's last row (and on requests without
        proposals, which have one row and are sampled as ``__call__`` samples them). Every row's distribution is
        the request's fully processed one (``process_logits``: every sampling feature applied), so:
        - greedy rows accept while the argmax is the proposal; the token after is that row's argmax;
        - sampled rows accept proposal t with probability p(t) (rejection sampling with a one-hot draft
          distribution q: min(1, p/q)); the first rejected row samples from p with t removed, renormalized
          (the residual max(0, p - q)), and a request that accepted all samples its last row from p. The
          output is distributed exactly as p's, position by position.
        Returns, per request, [its sampled token, its number of accepted proposals] as an [S, 2] tensor, and the
        logprobs of every row's token (the model's own distribution, as ``__call__`` reports it; None when nobody
        asked for logprobs): a request's accepted proposals' rows, then its sampled token's, then rows past it,
        which ``verified_logprobs`` drops once the counts are read back with the tokens.
        """
        raw_logprobs = None if metadata.max_num_logprobs is None else logits.log_softmax(-1)
        logits = self.process_logits(logits, metadata)
        has_draft = draft_ids >= 0
        drafts = draft_ids.clamp_min(0).unsqueeze(1)
        greedy_ids = argmax(logits) if metadata.all_greedy or metadata.greedy is not None else None
        if metadata.all_greedy:
            candidates, accept = greedy_ids, has_draft & (greedy_ids == draft_ids)
        else:
            probs = logits.softmax(-1)
            p_draft = probs.gather(1, drafts).squeeze(1)
            accept = has_draft & (torch.rand_like(p_draft) < p_draft)
            # The residual: p without the proposal, left unnormalised (the race's argmax(p / q) is scale-free; the
            # inversion scales its uniform by the row's total).
            residual = probs.scatter_(1, drafts, torch.where(has_draft, 0.0, p_draft).unsqueeze(1))
            candidates = _draw(residual, metadata.generators)
            if metadata.greedy is not None:
                candidates = torch.where(metadata.greedy, greedy_ids, candidates)
                accept = torch.where(metadata.greedy, has_draft & (greedy_ids == draft_ids), accept)
        # A request's accepted count is the offset of its first row that does not accept (its last row never does).
        counts = torch.tensor(num_drafts) + 1
        group = torch.repeat_interleave(torch.arange(len(num_drafts)), counts).to(logits.device, non_blocking=True)
        first = (torch.cumsum(counts, 0) - counts).to(logits.device, non_blocking=True)
        offset = torch.arange(logits.shape[0], device=logits.device) - first[group]
        stop = torch.where(accept, logits.shape[0], offset)
        num_accepted = torch.full_like(first, logits.shape[0]).scatter_reduce_(0, group, stop, "amin")
        final_rows = first + num_accepted
        sampled = candidates[final_rows]
        out = torch.stack([sampled, num_accepted], 1)
        if raw_logprobs is None:
            return out, None
        chosen = torch.where(has_draft, draft_ids, candidates).index_put_((final_rows,), sampled)
        return out, _logprob_rows(raw_logprobs, chosen, metadata)

    def process_logits(self, logits: Tensor, metadata: SamplingMetadata) -> Tensor:
        """The logits random rows sample from (greedy rows: the logits they argmax)."""
        if metadata.allowed is not None:
            logits.masked_fill_(metadata.allowed, float("-inf"))
        if metadata.bias is not None:
            rows, tokens, values = metadata.bias
            logits.index_put_((rows, tokens), values, accumulate=True)
        if metadata.grammar is not None:
            logits.masked_fill_(metadata.grammar, float("-inf"))
        if metadata.banned is not None:
            logits[metadata.banned] = float("-inf")
        if metadata.penalties is not None:
            logits = apply_penalties(logits, metadata.penalties)
        if metadata.temperature is not None:
            logits.div_(metadata.temperature.unsqueeze(1))
        if metadata.min_p is not None:
            apply_min_p(logits, metadata.min_p)
        return apply_top_k_top_p(logits, metadata)


def apply_penalties(logits: Tensor, penalties: Penalties) -> Tensor:
    repetition = torch.where(penalties.seen, penalties.repetition.unsqueeze(1), 1.0)
    # Dividing positive and multiplying negative logits both push a seen token down.
    logits = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits -= penalties.frequency.unsqueeze(1) * penalties.output_counts
    logits -= penalties.presence.unsqueeze(1) * (penalties.output_counts > 0)
    return logits


def apply_min_p(logits: Tensor, min_p: Tensor) -> None:
    probs = logits.softmax(-1)
    threshold = min_p.unsqueeze(1) * probs.amax(-1, keepdim=True)
    logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: Tensor, metadata: SamplingMetadata) -> Tensor:
    """Top-k, then top-p on what top-k left (vLLM's order), in place."""
    if metadata.top_k is not None:
        # topk(max_top_k) is much cheaper than a full sort when every row's k is small.
        k = metadata.top_k.unsqueeze(1)
        kth = logits.topk(metadata.max_top_k, dim=-1).values.gather(1, k.clamp(max=metadata.max_top_k) - 1)
        kth.masked_fill_(k > metadata.max_top_k, float("-inf"))  # top-k off: keep everything
        logits.masked_fill_(logits < kth, float("-inf"))
    if metadata.top_p is not None:
        top_p_mask_(logits, metadata.top_p)
    return logits


def argmax(x: Tensor) -> Tensor:
    """Each row's index of its largest value (the first of equal ones; NaN counts as largest), as
    ``x.argmax(-1)`` gives, but faster on CPU: for a decode step's [64, 49,152] logits torch's argmax took 2.4 ms
    on two cores and ``max(-1)`` 0.9 ms (SmolLM2's step, 158 ms, spent 3% of it in argmax, more than in any
    other op outside the matmuls and attention)."""
    return x.max(-1).indices


def _draw(probs: Tensor, generators: dict[int, torch.Generator]) -> Tensor:
    """One token per row of ``probs`` [S, V] (nonnegative, need not sum to one), distributed as the row's weights.

    Seeded rows draw from their own generator, so their tokens depend on neither their row position nor their
    neighbours. On CPU by inverting each row's cumulative weights at one uniform (``sample_categorical``): the
    exponential race draws S x V values, and torch's CPU ``exponential_`` spent 60 ms on a decode step's
    [64, 49,152] (a third of SmolLM2's two-core step, on one thread), where the inversion takes about 1 ms.
    """
    if probs.device.type != "cpu":
        return _exponential_race(probs, generators)
    uniforms = torch.rand(probs.shape[0], dtype=torch.float64)
    for row, gen in generators.items():
        uniforms[row] = torch.rand(1, dtype=torch.float64, generator=gen)
    return sample_categorical(probs, uniforms)


def skip_draws(gen: torch.Generator, num_tokens: int, vocab_size: int) -> None:
    """Advance a seeded row's generator past ``num_tokens`` tokens sampled elsewhere from the same seed (a KV
    transfer's first token, drawn by the prefill engine): ``_draw`` itself draws each one for a row of that width,
    and the token is dropped, so the tokens it samples next are the ones one engine would have sampled. (Off CPU
    this has not run on a GPU.)"""
    for _ in range(num_tokens):
        _draw(torch.ones(1, vocab_size, device=gen.device), {0: gen})


def _exponential_race(probs: Tensor, generators: dict[int, torch.Generator]) -> Tensor:
    """argmax(probs / q) with q ~ Exp(1) samples from probs (the Gumbel-max trick): one parallel pass on a GPU.
    Seeded rows redraw q from their own generator over exactly V values."""
    q = torch.empty_like(probs).exponential_()
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    # q == 0 would turn a masked token's 0/0 into NaN, which argmax would pick.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return argmax(probs.div_(q))


@dataclass(slots=True)
class LogprobRows:
    """Each row's logprob of its token and its top ``max(num_logprobs)``, on the device until ``to_list`` reads
    them back (after the step's sampled ids, so that reading them is no extra sync while the next step is built:
    ModelRunner.finish)."""

    chosen: Tensor
    top_values: Tensor
    top_ids: Tensor
    num_logprobs: list[int | None]  # per row: how many of the top it asked for (None: no logprobs)

    def to_list(self) -> list[SampledLogprobs | None]:
        # One transfer per tensor; per-row Python only touches plain lists.
        chosen, values, ids = self.chosen.tolist(), self.top_values.tolist(), self.top_ids.tolist()
        return [
            None
            if k is None
            else SampledLogprobs(logprob=chosen[i], top_token_ids=ids[i][:k], top_logprobs=values[i][:k])
            for i, k in enumerate(self.num_logprobs)
        ]


def verified_logprobs(
    entries: list[SampledLogprobs | None], num_drafts: list[int], num_accepted: list[int]
) -> tuple[list[SampledLogprobs | None], list[list[SampledLogprobs]]]:
    """A verifying step's logprob entries (its ``verify`` rows, read back) per request: its sampled token's, and
    its accepted proposals' (the rows before it). Request i's rows are the ``num_drafts[i] + 1`` after request
    i - 1's."""
    sampled, accepted, first = [], [], 0
    for k, a in zip(num_drafts, num_accepted):
        accepted.append(entries[first : first + a])
        sampled.append(entries[first + a])
        first += k + 1
    return sampled, accepted


def _logprob_rows(raw_logprobs: Tensor, sampled: Tensor, metadata: SamplingMetadata) -> LogprobRows:
    top_values, top_ids = raw_logprobs.topk(metadata.max_num_logprobs, dim=-1)
    chosen = raw_logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)
    return LogprobRows(chosen, top_values, top_ids, metadata.num_logprobs)
