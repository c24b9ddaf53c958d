"""The step pipeline on CPU: padded decode steps (what CUDA graphs replay), penalties kept across steps,
the order of a step's work, and the runner's own samples (what async scheduling rests on)."""

import asyncio
import json
import logging
import threading
from collections import deque

import pytest
import torch

from engine.inprocess import InProcessEngine
from raylm import EngineConfig, SamplingParams
from scheduler import EngineRequest, StructuredOutputsParams
from workers.runner_inputs import PromptLogprobRows


def run(engine: InProcessEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(EngineRequest(request_id=str(i), prompt_token_ids=p, sampling_params=sp))
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id].extend(o.new_token_ids)
    return [got[str(i)] for i in range(len(prompts))]


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    rng = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (5 + 13 * i,), generator=rng).tolist() for i in range(n)]


def engine(path: str, **kw) -> InProcessEngine:
    return InProcessEngine(EngineConfig(**{"model": path, "device": "cpu", "block_size": 8, **kw}))


def test_decodes_padded_to_graph_sizes_give_the_same_tokens(tiny_model_dir):
    path = tiny_model_dir("llama")
    ids = prompts(5)
    # The batch shrinks as requests finish: 5, 4, 3, 2 and 1 decodes pad to 8, 4, 4, 2 and 1 rows.
    params = [SamplingParams(temperature=0.0, max_tokens=3 + 3 * i, ignore_eos=True) for i in range(5)]
    expected = run(engine(path), ids, params)
    padded = engine(path)  # all five prompts fit one step, so all five then decode together
    runner = padded.worker.runner
    runner.decode_graphs.sizes = [1, 2, 4, 8]
    shapes = []
    forward = runner.forward

    def record(inputs):
        shapes.append((len(inputs.sampling_states), inputs.input_ids.shape[0], inputs.graph_size))
        return forward(inputs)

    runner.forward = record
    assert run(padded, ids, params) == expected
    assert {(5, 8, 8), (3, 4, 4), (2, 2, 2), (1, 1, 1)} <= set(shapes)


def test_verification_steps_padded_to_graph_shapes_give_the_same_tokens(tiny_model_dir):
    """With k = 3 proposals a request (the target as its own draft: all accepted), steps where every request
    verifies 3 are padded to a captured size of 4-token requests, and the draft's passes to a captured size of
    one-token requests, as their CUDA graphs replay them. Near its max_tokens a request is proposed fewer: that
    step is padded after its tokens to 4 a request as well, and the draft, catching up on the padded inputs, keeps
    proposing what the target accepts."""
    import json

    path = tiny_model_dir("llama")
    ids = prompts(3, seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=10 + 4 * i, ignore_eos=True) for i in range(3)]
    expected = run(engine(path), ids, params)
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    padded = engine(path, speculative_config=json.dumps(spec))
    runner = padded.worker.runner
    assert runner.decode_graphs.query_lens == runner.draft.graphs.query_lens == (1, 4)
    runner.decode_graphs.sizes = runner.draft.graphs.sizes = [1, 2, 4, 8]  # the draft's passes padded too
    shapes = []
    forward = runner.forward

    def record(inputs):
        shapes.append(
            (len(inputs.sampling_states), inputs.input_ids.shape[0], inputs.graph_size, inputs.graph_query_len)
        )
        if inputs.num_drafts is not None and len(set(inputs.num_drafts)) > 1:
            uneven.append(shapes[-1])
        return forward(inputs)

    uneven = []
    runner.forward = record
    assert run(padded, ids, params) == expected
    assert (3, 16, 4, 4) in shapes  # three requests verifying 3 proposals each, as four of 4 tokens
    assert uneven and all(q == 4 and tokens == 4 * size for _, tokens, size, q in uneven), uneven
    stats = padded.stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0


def test_verification_steps_of_uneven_proposals_are_padded_to_graph_shapes_and_give_the_same_tokens(tiny_model_dir):
    """n-gram proposals differ in count from request to request and step to step: a step verifying 0 to 3 a
    request is padded after each request's tokens to 4 (a captured graph's shape), the padding's KV on the null
    slot, and gives the tokens of no speculation; every request's logits rows are its own."""
    path = tiny_model_dir("llama")
    # Repetitive prompts, so that n-gram lookup finds continuations for some requests and not for others.
    ids = [(p[:6] * 4)[: 12 + 5 * i] for i, p in enumerate(prompts(4, seed=9))]
    params = [SamplingParams(temperature=0.0, max_tokens=14 + 3 * i, ignore_eos=True) for i in range(4)]
    expected = run(engine(path), ids, params)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    padded = engine(path, speculative_config=json.dumps(spec))
    runner = padded.worker.runner
    assert runner.decode_graphs.query_lens == (1, 4)
    runner.decode_graphs.sizes = [1, 2, 4, 8]
    uneven = []
    forward = runner.forward

    def record(inputs):
        drafts = inputs.num_drafts
        if drafts is not None and len(set(drafts)) > 1:
            uneven.append((inputs.graph_size, inputs.graph_query_len, inputs.input_ids.shape[0]))
        return forward(inputs)

    runner.forward = record
    assert run(padded, ids, params) == expected
    assert uneven and all(q == 4 and tokens == 4 * size for size, q, tokens in uneven), uneven
    assert padded.stats().spec_decode_num_draft_tokens > 0


def test_a_lone_requests_fewer_than_k_proposals_are_padded_to_the_graph_shape(tiny_model_dir):
    """One request, n-gram proposals of 1 to 3 tokens from step to step: every step that verifies any is padded to
    the 4-token graph's shape (before, one verifying fewer than 3 ran eagerly, all its requests' counts being
    alike), with the tokens of no speculation."""
    path = tiny_model_dir("llama")
    ids = [(prompts(1, seed=9)[0][:5] * 5)[:23]]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    expected = run(engine(path), ids, params)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    padded = engine(path, speculative_config=json.dumps(spec))
    runner = padded.worker.runner
    runner.decode_graphs.sizes = [1, 2, 4, 8]
    verified = []
    forward = runner.forward

    def record(inputs):
        if inputs.num_drafts is not None:
            verified.append((inputs.num_drafts[0], inputs.graph_size, inputs.graph_query_len))
        return forward(inputs)

    runner.forward = record
    assert run(padded, ids, params) == expected
    assert {k for k, _, _ in verified} > {3}, verified  # some steps verify fewer than k
    assert all((size, q) == (1, 4) for _, size, q in verified), verified


def test_repetition_penalty_matches_transformers_across_steps_and_reused_rows(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir("llama")
    ids = prompts(4, seed=2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    with torch.inference_mode():
        for p in ids:
            x = torch.tensor([p])
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=12,
                do_sample=False,
                repetition_penalty=1.8,
                eos_token_id=None,
                pad_token_id=0,
            )
            expected.append(out[0, len(p) :].tolist())
    # Two rows for four requests: the last two reuse rows whose statistics must start afresh.
    eng = engine(path, max_num_seqs=2)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.8, max_tokens=12, ignore_eos=True)] * 4
    assert run(eng, ids, params) == expected
    assert eng.worker.runner.penalty_state.output_counts.shape[0] == 2


def test_sampling_is_prepared_before_the_forward_is_queued(tiny_model_dir):
    eng = engine(tiny_model_dir("llama"))
    runner = eng.worker.runner
    order = []
    for name in ("prepare_inputs", "prepare_sampling", "forward", "_to_host"):
        method = getattr(runner, name)
        setattr(runner, name, lambda *a, _m=method, _n=name: order.append(_n) or _m(*a))
    run(eng, prompts(2), [SamplingParams(max_tokens=2, presence_penalty=0.5, top_p=0.9, seed=3)] * 2)
    step = ["prepare_inputs", "prepare_sampling", "forward", "_to_host"]
    assert order == step * (len(order) // 4) and len(order) >= 8


def test_the_runner_appends_its_own_samples_and_feeds_its_matcher_from_them(default_model_dir):
    # Async scheduling's order: step N+1 runs before the scheduler has step N's token, so the runner's row and
    # the matcher must already hold it (a mask from a matcher a token behind would allow a choice's start again).
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    prompt = tok.encode("Do you want tea? Answer:")
    choices = ["yes please, with milk", "no thanks"]
    params = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=StructuredOutputsParams(choice=choices))
    expected = run(engine(default_model_dir), [prompt], [params])[0]
    eng = engine(default_model_dir)
    eng.add_request(EngineRequest(request_id="0", prompt_token_ids=prompt, sampling_params=params))
    sched, runner = eng.scheduler, eng.worker.runner
    pending, got = deque(), []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        pending.append((so, eng.worker.execute_model(so)))
        state = runner.requests["0"]
        assert runner.token_ids[state.row, len(prompt) : state.num_tokens].tolist() == state.output_token_ids
        if len(pending) == 2:
            request = sched.requests["0"]  # the runner is ahead by the samples of the steps in flight
            assert len(state.output_token_ids) == len(request.output_token_ids) + request.num_output_placeholders
            got += [t for o in sched.update_from_output(*pending.popleft()) for t in o.new_token_ids]
    while pending:
        got += [t for o in sched.update_from_output(*pending.popleft()) for t in o.new_token_ids]
    assert got == expected and tok.decode(got, skip_special_tokens=True) in choices


class OrderCheckingEvent:
    """Stands in for the CUDA event InputBuffers records after each upload, to copy between CPU tensors: at
    record() the copies must have been queued (device side equal to the host side), and at synchronize() the
    host side must still hold what the last upload copied, i.e. nothing was rewritten under a pending copy."""

    def __init__(self):
        self.buffers, self.uploaded, self.waits = None, None, 0

    def record(self):
        host, dev = self.buffers.host, self.buffers.dev
        self.uploaded = {name: t.clone() for name, t in host.items()}
        # Only used prefixes are copied: compare where the step wrote (the token-sized buffers' first slots).
        assert all(torch.equal(dev[n][:1], host[n][:1]) for n in ("input_ids", "positions", "query_start_loc"))

    def query(self):
        return False  # as if the GPU were still behind: every rewrite must wait

    def synchronize(self):
        self.waits += 1
        if self.uploaded is not None:
            assert all(torch.equal(self.buffers.host[n], t) for n, t in self.uploaded.items()), (
                "the host side was rewritten before the last upload's copies were waited for"
            )
        self.uploaded = None  # waited for: until the next record, the host side is free to rewrite


def copying_buffers(runner, token_slots: bool = False) -> OrderCheckingEvent:
    """The runner's input buffers replaced by ones of the same sizes that copy, as on CUDA, between CPU tensors;
    their event, which checks the order of copies and rewrites."""
    from workers.runner_inputs import InputBuffers

    event, old = OrderCheckingEvent(), runner.buffers
    runner.buffers = event.buffers = InputBuffers(
        old.host["input_ids"].shape[0],
        old.host["seq_lens"].shape[0],
        old.host["block_tables"].shape[1],
        torch.device("cpu"),
        event,
        token_slots=token_slots,
    )
    return event


def test_the_drafts_pass_inputs_are_staged_as_the_runners_inputs_are(tiny_model_dir):
    """The draft's passes' inputs go through buffers of its own: on CPU one tensor, nothing copied; made to copy
    between CPU tensors as on CUDA (pinned, without blocking), the proposals (the target as its own draft: all
    accepted) and the output are the same, and no pass's inputs are rewritten under a pending copy."""
    from workers.runner_inputs import InputBuffers

    path = tiny_model_dir("llama")
    ids = prompts(3, seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=10 + 4 * i, ignore_eos=True) for i in range(3)]
    expected = run(engine(path), ids, params)
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    eng = engine(path, speculative_config=json.dumps(spec))
    draft = eng.worker.runner.draft
    old = draft.staging
    assert not old.copies and all(old.dev[name] is old.host[name] for name in old.layout)
    event = OrderCheckingEvent()
    draft.staging = event.buffers = InputBuffers(
        old.host["positions"].shape[0],
        old.host["input_ids"].shape[0],
        old.host["block_tables"].shape[1],
        torch.device("cpu"),
        event,
        layout=old.layout,
    )
    assert run(eng, ids, params) == expected
    stats = eng.stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    assert event.waits > 1


def test_input_buffers_are_rewritten_only_after_the_last_uploads_copies(tiny_model_dir):
    eng = engine(tiny_model_dir("llama"), max_num_batched_tokens=32)
    event = copying_buffers(eng.worker.runner)
    # A 100-token prompt in 32-token chunks: three steps that sample nothing (no sync at all on CUDA), then decodes.
    params = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)] * 2
    ids = [prompts(9)[8][:100], prompts(2)[1]]
    expected = run(engine(tiny_model_dir("llama"), max_num_batched_tokens=32), ids, params)
    assert run(eng, ids, params) == expected
    assert event.waits >= 6


def test_graph_sizes_stop_at_512_and_larger_decode_batches_run_eagerly(tiny_model_dir):
    from workers.runner_inputs import MAX_GRAPH_SIZE, graph_batch_sizes

    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(37) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert graph_batch_sizes(512)[-1] == graph_batch_sizes(2000)[-1] == MAX_GRAPH_SIZE == 512
    runner = engine(tiny_model_dir("llama"), max_num_seqs=600).worker.runner
    runner.decode_graphs.sizes = graph_batch_sizes(600)
    assert runner.decode_graphs.padded_size(512, 512) == 512 and runner.decode_graphs.padded_size(513, 513) == 0


def test_a_capture_that_raises_leaves_the_runner_decoding_eagerly(tiny_model_dir):
    """CUDA graphs cannot be captured on CPU: the capture raises as a backend that syncs with the host would
    on a GPU, and the runner must fall back to eager decodes with a warning instead of failing."""
    import pytest

    path = tiny_model_dir("llama")
    ids, params = prompts(3), [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)] * 3
    expected = run(engine(path), ids, params)
    eng = engine(path)
    runner = eng.worker.runner
    runner.decode_graphs.sizes = [1, 2, 4]
    with pytest.warns(UserWarning, match="CUDA graph capture failed .*decoding eagerly"):
        runner.capture_decode_graphs()
    assert runner.decode_graphs.sizes == [] and not runner.decode_graphs.graphs
    assert run(eng, ids, params) == expected


def test_a_capture_that_raises_names_the_verifications_it_leaves_eager(tiny_model_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    runner = engine(tiny_model_dir("llama"), speculative_config=json.dumps(spec)).worker.runner
    runner.decode_graphs.sizes = [1, 2, 4]
    with pytest.warns(UserWarning, match="; decoding and verifying num_speculative_tokens=3 proposals eagerly"):
        runner.capture_decode_graphs()
    assert runner.decode_graphs.sizes == [] and not runner.decode_graphs.graphs


@pytest.mark.parametrize("max_num_batched_tokens, verified, lines", [(20, [1, 2, 4], 1), (32, [1, 2, 4, 8], 0)])
def test_verification_batches_the_token_limit_leaves_eager_are_logged_once_at_capture(
    tiny_model_dir, monkeypatch, caplog, max_num_batched_tokens, verified, lines
):
    """k = 3 and batches of up to 8: 8 requests verifying take 32 tokens. Over a limit of 20 the capture stops at 4
    and says so, once (the draft's capture, of the same shapes, is silent); under a limit of 32 it says nothing."""
    from workers.decode_graphs import DecodeGraphs

    path = tiny_model_dir("llama")
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    eng = engine(
        path, max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens, speculative_config=json.dumps(spec)
    )
    runner = eng.worker.runner
    runner.decode_graphs.sizes = [1, 2, 4, 8]
    # CPU cannot capture: each shape is recorded instead, so that the capture succeeds and explains itself.
    monkeypatch.setattr(DecodeGraphs, "_capture", lambda self, size, q, pool, *rest: self.graphs.setdefault((size, q)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    with caplog.at_level(logging.INFO, logger="workers.decode_graphs"):
        runner.capture_decode_graphs()
    for graphs in (runner.decode_graphs, runner.draft.graphs):
        assert sorted(size for size, q in graphs.graphs if q == 4) == verified
    expected = [
        "raylm: verification steps (num_speculative_tokens=3) replay CUDA graphs at batches of up to 4 requests and "
        "run eagerly above: a batch of 8 takes 32 tokens, over a step's 20 (max_num_batched_tokens)"
    ]
    assert caplog.messages == expected[:lines]


def collect(eng: InProcessEngine, requests: list[EngineRequest], on_step=None) -> dict:
    """Every delta's fields per (request, sample), stepping until all finish; ``on_step(eng, k)`` after step k."""
    for r in requests:
        eng.add_request(r)
    got: dict = {}
    k = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            entry = got.setdefault((o.request_id, o.index), {"tokens": [], "logprobs": [], "prompt": None})
            entry["tokens"] += o.new_token_ids
            # Rounded: a batch split otherwise (async scheduling plans a step earlier) rounds the last bits otherwise.
            entry["logprobs"] += [(round(lp.logprob, 4), lp.top_token_ids) for lp in o.new_logprobs or []]
            entry["prompt"] = entry["prompt"] or [(round(lp.logprob, 4), lp.rank) for lp in o.prompt_logprobs or []]
            entry["finish"] = o.finish_reason
        k += 1
        if on_step is not None:
            on_step(eng, k)
    return got


def late_tokens(eng: InProcessEngine) -> list[int]:
    """How many input ids each step took from the unfinished step's sampled ids on the device (recorded)."""
    counts, upload = [], eng.worker.runner.buffers.upload

    def record(num_tokens, num_reqs, num_logits, num_late=0):
        counts.append(num_late)
        return upload(num_tokens, num_reqs, num_logits, num_late)

    eng.worker.runner.buffers.upload = record
    return counts


class LaterLaunchEvent:
    """Stands in for a step's copy event on a device a step behind: done once a later step is launched, or, for
    the last step, a moment after it is first waited for, as a GPU still running the step while the host builds
    the next (on CPU a step's work is done at its launch)."""

    def __init__(self):
        self.later = threading.Event()

    def query(self) -> bool:
        return self.later.is_set()

    def synchronize(self) -> None:
        self.later.wait(0.01)


def slow_device(runner) -> None:
    """Each sampling step's ids copied (as themselves, on CPU) under a LaterLaunchEvent: the engine waits for a
    step not ready yet on a thread (PendingStep.wait), and the runner's finish on the event."""
    events = []

    def start_copy(pending):
        if events:
            events[-1].later.set()
        pending.host, pending.copied = pending.sampled, LaterLaunchEvent()
        events.append(pending.copied)

    runner._start_copy = start_copy


class PendingRowsCheck:
    """After each step: a live request's ``pending`` names the latest unfinished step that sampled it and its row
    there, or is None where none did (steps without proposals); ``seen`` counts the requests that had one."""

    def __init__(self):
        self.seen = 0

    def __call__(self, eng: InProcessEngine, _step: int) -> None:
        runner = eng.worker.runner
        latest = {id(state): (step, i) for step in runner.unfinished for i, state in enumerate(step.states)}
        for state in runner.requests.values():
            expected = latest.get(id(state))
            if expected is None:
                assert state.pending is None
            else:
                assert state.pending[0] is expected[0] and state.pending[1] == expected[1]
                self.seen += 1


class CopyEvent:
    """A step's copy event the test completes (``done``), counting its polls and the threads that waited on it."""

    def __init__(self):
        self.done, self.queries, self.waiters = threading.Event(), 0, []

    def query(self) -> bool:
        self.queries += 1
        return self.done.is_set()

    def synchronize(self) -> None:
        self.waiters.append(threading.current_thread())
        assert self.done.wait(5), "the step was waited for on the event loop's thread: nothing could complete it"


def test_a_step_not_ready_is_awaited_on_a_thread_with_the_event_loop_free():
    from workers.runner_inputs import PendingStep

    event = CopyEvent()
    step = PendingStep([], sampled=torch.zeros(1, dtype=torch.int64), copied=event)

    async def scenario():
        waiting = asyncio.ensure_future(step.wait())
        for _ in range(20):  # the loop runs other work while the device runs the step
            await asyncio.sleep(0)
        assert not waiting.done()
        event.done.set()
        await asyncio.wait_for(waiting, 5)

    asyncio.run(scenario())
    # Polled once, then blocked on the event: a loop polling is_ready would have queried it at every turn.
    assert event.queries == 1 and len(event.waiters) == 1 and event.waiters[0] is not threading.main_thread()


def test_a_ready_step_is_awaited_without_a_thread(tiny_model_dir, monkeypatch):
    """A finished step, one without a copy (always on CPU), or one whose copy is done returns at once: a CPU
    engine with async scheduling never pays a thread round-trip."""
    from workers.runner_inputs import PendingStep

    path = tiny_model_dir("llama")
    ids, params = prompts(3), [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)] * 3
    expected = run(engine(path), ids, params)

    def no_thread(*args):
        raise AssertionError("a ready step was waited for on a thread")

    monkeypatch.setattr(asyncio, "to_thread", no_thread)
    done = CopyEvent()
    done.done.set()
    for step in (PendingStep([], finished=True), PendingStep([]), PendingStep([], copied=done)):
        asyncio.run(step.wait())
    assert run(engine(path, async_scheduling=True), ids, params) == expected


def test_async_scheduling_launches_each_step_before_the_last_ones_ids_reach_the_host(tiny_model_dir, monkeypatch):
    """Two steps in flight in-process: step N+1 is launched with step N's sampled ids still on the device (as on
    CUDA: copying buffers, a device a step behind), and every request's tokens, logprobs (prompt ones too, read back
    only as their step finishes) and finish are those of one step at a time."""
    path = tiny_model_dir("llama")
    ids = prompts(6, seed=4)
    params = [
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=12, logprobs=3),
        SamplingParams(temperature=1.0, top_k=20, seed=5, max_tokens=10, n=2, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=2, repetition_penalty=1.3, frequency_penalty=0.4, max_tokens=11),
        SamplingParams(temperature=0.0, max_tokens=8, min_tokens=6, prompt_logprobs=2, stop_token_ids=[7, 9, 11]),
        SamplingParams(temperature=0.9, seed=8, max_tokens=14, ignore_eos=True),
    ]
    requests = [
        EngineRequest(request_id=str(i), prompt_token_ids=p, sampling_params=sp)
        for i, (p, sp) in enumerate(zip(ids, params))
    ]
    expected = collect(engine(path, max_num_batched_tokens=40), requests)
    eng = engine(path, max_num_batched_tokens=40, async_scheduling=True)
    assert eng.core.depth == 2
    copying_buffers(eng.worker.runner)
    slow_device(eng.worker.runner)
    counts = late_tokens(eng)
    pending_rows = PendingRowsCheck()
    # Prompt logprobs are read back as their step finishes (in _complete), the next step already launched.
    runner, completing, reads = eng.worker.runner, [], []
    complete, to_dict = type(runner)._complete, PromptLogprobRows.to_dict

    def completing_step(self, pending):
        completing.append(pending)
        complete(self, pending)
        completing.pop()

    def read(rows):
        reads.append((bool(completing), len(runner.unfinished)))
        return to_dict(rows)

    monkeypatch.setattr(type(runner), "_complete", completing_step)
    monkeypatch.setattr(PromptLogprobRows, "to_dict", read)
    assert collect(eng, requests, on_step=pending_rows) == expected
    assert reads and all(inside for inside, _ in reads) and max(n for _, n in reads) >= 1, reads
    # Decode steps of all the requests took each one's newest token from the device.
    assert max(counts) >= 5 and sum(counts) > 40 and pending_rows.seen > 40
    assert not eng.worker.runner.unfinished or eng.worker.runner.unfinished[-1].states == []


def test_async_scheduling_finishes_the_step_first_where_the_host_needs_its_tokens(default_model_dir):
    """A grammar's matcher and bad words need a request's tokens on the host before its next sampling: the step
    that sampled it is finished before the next one is launched, and the outputs are those of one step at a time."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    prompt = tok.encode("Do you want tea? Answer:")
    choices = ["yes please, with milk", "no thanks"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=StructuredOutputsParams(choice=choices)),
        SamplingParams(temperature=0.0, max_tokens=8, bad_words_token_ids=[tok.encode(" yes"), tok.encode(" no")]),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    ]
    requests = [
        EngineRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=p) for i, p in enumerate(params)
    ]
    sync = engine(default_model_dir)
    expected = collect(sync, requests)
    eng = engine(default_model_dir, async_scheduling=True)
    counts = late_tokens(eng)
    assert collect(eng, requests) == expected
    assert tok.decode(expected[("0", 0)]["tokens"], skip_special_tokens=True) in choices
    assert sum(counts) == 0  # the grammar's request ran every step: none took a token from the device


def test_a_request_finished_while_its_step_is_unfinished_leaves_its_reused_row_alone(tiny_model_dir):
    """Aborted with a step that sampled it still unfinished, a request's row goes to the next request at once;
    that step's late token for it must not land in the new request's prompt (chunked, read step by step)."""
    path = tiny_model_dir("llama")
    first = EngineRequest(
        request_id="a",
        prompt_token_ids=prompts(4, seed=6)[3][:40],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
    )
    long_prompt = prompts(9, seed=7)[8][:100]
    after = EngineRequest(
        request_id="c",
        prompt_token_ids=long_prompt,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    )
    expected = collect(engine(path, max_num_batched_tokens=32), [after])[("c", 0)]["tokens"]
    eng = engine(path, max_num_batched_tokens=32, async_scheduling=True)
    copying_buffers(eng.worker.runner)
    slow_device(eng.worker.runner)

    def abort_then_add(eng, k):
        if k == 8:  # "a" holds ~46 tokens: inside the long prompt's second and third chunks
            assert eng.core.in_flight and eng.worker.runner.unfinished
            assert [o.finish_reason for o in eng.abort("a")] == ["abort"]
            eng.add_request(after)
        if k == 9:  # "a"'s step finished after "c" took its row: the row still holds c's prompt
            runner = eng.worker.runner
            assert runner.token_ids[runner.requests["c"].row, : len(long_prompt)].tolist() == long_prompt

    got = collect(eng, [first], on_step=abort_then_add)
    assert got[("c", 0)]["tokens"] == expected
